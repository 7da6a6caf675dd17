"""Ops whose result needs no data, made as constants under ``sg.fuse``.

An op over tensors with no elements computes nothing, and an op whose result has no
elements has nothing to compute: ``x.mean(0)`` of an empty ``x`` is NaN,
``a @ b`` of shapes ``[3, 0]`` and ``[0, 4]`` is zeros, and any result of shape
``[0, 3]`` is only its shape. Eagerly ATen handles such ops; Inductor refuses some
(a mean over the concatenation of an empty bool and an empty float tensor trips an
assertion in its scheduler; a bool matmul has no lowering), and the step would fail
under ``sg.fuse`` alone. This pass gives those nodes the value they have whatever the
step's data:

- a result with no elements becomes ``empty_strided`` of its shape and strides;
- a result with elements, whose elements are all one value (computed once here, on
  empty CPU tensors of the inputs' dtypes), becomes ``full`` of that value, where the
  result is contiguous.

Both only where every tensor the op reads is empty.

Only ATen's functional ops are folded: not an op that writes an input or returns a
view of one, not a random op, not a factory (no tensor input). The graph is otherwise
as traced, so values, dtypes, shapes and strides are those of eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx

from ..program import Program, pure_op

__all__ = ["empty_folds"]

Node = torch.fx.Node
aten = torch.ops.aten
# Views whose schema does not say so.
_VIEWS = {aten._unsafe_view.default}


def empty_folds(program: Program, *, in_place: bool = False) -> Program:
    """``program`` with each op whose result needs no data replaced by a constant
    (module docstring); ``program`` itself where there is none.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> [n.target for n in empty_folds(program).ops()]  # traced from ``x.mean(0)``, x: f32[0]
        [aten.full.default]
    """
    folds = {n.name: fold for n in program.graph.nodes if (fold := _fold(n)) is not None}
    if not folds:
        return program
    gm = program.graph_module_to_edit(in_place)
    for node in gm.graph.nodes:
        if node.name in folds:
            node.target, node.args, node.kwargs = folds[node.name]
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("empty_folds",))


def _fold(node: Node) -> tuple[Any, tuple, dict] | None:
    """The constant op for ``node`` (target, args, kwargs), or None to keep it."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or not _functional(node.target):
        return None
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    if not inputs or not all(isinstance(v, torch.Tensor) and v.numel() == 0 for v in inputs):
        return None
    like = {"dtype": val.dtype, "layout": torch.strided, "device": val.device, "pin_memory": False}
    if val.numel() == 0:
        return aten.empty_strided.default, (list(val.shape), list(val.stride())), like
    if not val.is_contiguous():
        return None
    value = _uniform_value(node)
    if value is None:
        return None
    return aten.full.default, (list(val.shape), value), like


def _functional(target: Any) -> bool:
    """An ATen op that writes no input, returns no view of one and draws no random numbers."""
    if not pure_op(target) or target.namespace != "aten" or target in _VIEWS:
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None


def _uniform_value(node: Node) -> bool | int | float | complex | None:
    """The one value of every element of ``node``'s result, computed on empty CPU tensors
    standing for its inputs; None where the op fails there or its elements differ."""

    def real(arg: Any) -> Any:
        val = arg.meta["val"]
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), real)
    kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
    op = cast("Callable[..., Any]", node.target)
    try:
        out = op(*args, **kwargs)
    except Exception:  # an op CPU tensors cannot run: keep it for Inductor
        return None
    if not isinstance(out, torch.Tensor) or out.shape != node.meta["val"].shape or out.numel() == 0:
        return None
    flat = out.reshape(-1).contiguous()
    bits = flat.view(torch.uint8).reshape(flat.numel(), -1)  # bitwise: -0.0 is not 0.0
    if not bool((bits == bits[0]).all()):
        return None
    return flat[0].item()
