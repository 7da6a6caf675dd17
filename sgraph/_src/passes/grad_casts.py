"""Hand the AdamW update its gradients in the dtype they were computed in.

Under autocast a weight's gradient leaves its matmul in bf16 (a bias gradient its sum),
and the backward of the forward's cast of the fp32 weight casts it to fp32 again for
the update: a ``_to_copy`` that writes 4 bytes per parameter which the update then
reads back. Where such a cast feeds an ``sgraph::adamw`` update, this pass hands the
update the low-precision gradient itself; the update reads it as it is and casts in
registers (:mod:`sgraph._src.kernels.adamw_lists`), and the cast, read by nothing
else, is removed. Exact: a bf16 or fp16 value is an fp32 value, and the update does
the same arithmetic on it.

Applied under ``sg.fuse`` with its own kernel ``"adamw"`` (the default; ``kernels=()``
keeps the casts).
"""

from __future__ import annotations

from typing import Any

import torch

from ..program import Program

__all__ = ["grad_casts"]

Node = torch.fx.Node
_UPDATES = (torch.ops.sgraph.adamw.default, torch.ops.sgraph.adamw_.default)
_LOW = (torch.bfloat16, torch.float16)


def grad_casts(program: Program, *, in_place: bool = False) -> Program:
    """Replace each fp32 cast of a bf16 / fp16 gradient feeding an AdamW update by the
    gradient itself.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> [n.target for n in grad_casts(program).ops()].count(torch.ops.aten._to_copy.default)
        0
    """
    gm = program.graph_module_to_edit(in_place)
    for node in gm.graph.nodes:
        if node.target in _UPDATES:
            params, grads = node.args[0], node.args[1]
            node.update_arg(1, [_uncast(g, p) for g, p in zip(grads, params)])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("grad_casts",))


def _uncast(grad: Any, param: Any) -> Any:
    """The low-precision tensor ``grad`` casts to ``param``'s fp32, if it is such a cast
    that changes nothing else (device, layout, shape, strides); else ``grad``."""
    if not isinstance(grad, Node) or grad.target is not torch.ops.aten._to_copy.default:
        return grad
    source = grad.args[0]
    if len(grad.args) != 1 or not isinstance(source, Node) or not isinstance(param, Node):
        return grad
    old, new, p = (n.meta.get("val") for n in (source, grad, param))
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(p, torch.Tensor)):
        return grad
    kwargs = dict(grad.kwargs)
    plain = (
        kwargs.pop("dtype", None) == p.dtype == new.dtype == torch.float32
        and kwargs.pop("layout", torch.strided) == torch.strided
        and kwargs.pop("device", old.device) == old.device
        and kwargs.pop("memory_format", torch.preserve_format) == torch.preserve_format
        and not kwargs.pop("non_blocking", False)
        and not kwargs
    )
    same = old.dtype in _LOW and old.shape == new.shape and old.stride() == new.stride() and old.device == new.device
    return source if plain and same else grad
