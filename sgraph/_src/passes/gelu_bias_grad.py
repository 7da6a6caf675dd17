"""The gradient through a GELU and its bias gradient, on one own kernel.

In the backward of ``gelu(x @ W.T + b)`` the traced graph computes
``g = gelu_backward(dy, x)``, which the two gradient matmuls read, and the bias
gradient as a column sum of ``g`` (``sum`` over every dimension but the last, or over
rows of its 2-D view). Inductor writes ``g`` in one kernel and reads it all again for
the sum, since the matmuls, library calls, need ``g`` in memory. This pass replaces
both by ``sgraph::gelu_bias_grad`` (:mod:`sgraph._src.kernels.gelu_bias_grad`), which
writes ``g`` and sums its columns in the same pass. The two ops' other readers read
the op's results, in the same shapes.

Applied under ``sg.fuse`` with its own kernel ``"gelu_bias_grad"`` (in the default
``kernels="all"``), to CUDA tensors only (``DEVICES``): on a CPU, Inductor's C++ for
the two ops is as good, and an own op would cut fusions around them.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch

from ..kernels import gelu_bias_grad as _kernel  # noqa: F401 - registers sgraph::gelu_bias_grad
from ..program import Program
from ..source import GRAD_MODULE_KEY, MODULE_KEY, SOURCE_KEY
from ..tags import TAGS_KEY

__all__ = ["DEVICES", "gelu_bias_grad"]

Node = torch.fx.Node
aten = torch.ops.aten

DEVICES = ("cuda",)
"""Device types whose GELU gradients the pass hands to the own kernel."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_CARRIED = (SOURCE_KEY, MODULE_KEY, GRAD_MODULE_KEY, TAGS_KEY)  # what the new nodes take from the GELU's


def gelu_bias_grad(program: Program, *, in_place: bool = False) -> Program:
    """Replace each ``gelu_backward`` whose result a bias-gradient sum reads, and that
    sum, by one ``sgraph::gelu_bias_grad``.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> ops = {n.target for n in gelu_bias_grad(program).ops()}
        >>> torch.ops.sgraph.gelu_bias_grad.default in ops
        True
    """
    gm = program.graph_module_to_edit(in_place)
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is aten.gelu_backward.default:
            changed |= _rewrite(gm.graph, node)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("gelu_bias_grad",))


def _rewrite(graph: torch.fx.Graph, gelu: Node) -> bool:
    """Rewrite one ``gelu_backward`` and its bias sum; False where they do not match."""
    approximate = gelu.kwargs.get("approximate", gelu.args[2] if len(gelu.args) > 2 else "none")
    val = _value(gelu)
    total = _bias_sum(gelu, val) if val is not None and approximate in ("none", "tanh") else None
    if val is None or total is None:
        return False
    rows, cols = val.numel() // val.shape[-1], val.shape[-1]
    with graph.inserting_before(gelu):
        flat = [_node(graph, aten.view.default, (n, [rows, cols]), gelu) for n in gelu.args[:2]]
        op = _node(graph, torch.ops.sgraph.gelu_bias_grad.default, (*flat, approximate), gelu)
        grad, bias = (_node(graph, operator.getitem, (op, i), gelu) for i in (0, 1))
        grad = _node(graph, aten.view.default, (grad, list(val.shape)), gelu)
        bias = _node(graph, aten.view.default, (bias, list(total.meta["val"].shape)), gelu)
    gelu.replace_all_uses_with(grad)
    total.replace_all_uses_with(bias)
    return True


def _value(gelu: Node) -> torch.Tensor | None:
    """The gradient's (fake) value, where the kernel takes it and both inputs: one shape
    and dtype, dense and row-major, at least 2-D, on a device in ``DEVICES``."""
    args = gelu.args[:2]
    if not all(isinstance(a, Node) for a in args):
        return None
    vals = [n.meta.get("val") for n in (gelu, *cast("tuple[Node, Node]", args))]
    if not all(_plain(v) for v in vals):
        return None
    val, dy, x = cast("list[torch.Tensor]", vals)
    same = dy.shape == x.shape == val.shape and dy.dtype == x.dtype == val.dtype
    return val if same and val.dim() >= 2 and val.device.type in DEVICES else None


def _plain(val: Any) -> bool:
    """A dense, row-major tensor of a dtype the kernel takes."""
    return isinstance(val, torch.Tensor) and val.dtype in _DTYPES and val.is_contiguous() and val.numel() > 0


def _bias_sum(gelu: Node, val: torch.Tensor) -> Node | None:
    """The sum over all but the last dimension of ``gelu``'s result (or over the rows of
    a 2-D view of it), in its dtype; None if there is none."""
    for reader, ndim in _column_reads(gelu, val):
        if reader.target is aten.sum.dim_IntList and not reader.kwargs.get("dtype"):
            reduced = reader.args[1] if len(reader.args) > 1 else reader.kwargs.get("dim")
            if isinstance(reduced, (list, tuple)) and sorted(d % ndim for d in reduced) == list(range(ndim - 1)):
                return reader
    return None


def _column_reads(gelu: Node, val: torch.Tensor) -> list[tuple[Node, int]]:
    """Readers of ``gelu``'s result, directly or through a 2-D ``[rows, columns]`` view,
    with the number of dimensions of the tensor each reads."""
    flat = (val.numel() // val.shape[-1], val.shape[-1])
    found = [(reader, val.dim()) for reader in gelu.users]
    for view in gelu.users:
        shape = getattr(view.meta.get("val"), "shape", None)
        if view.target in _VIEWS and shape is not None and tuple(shape) == flat:
            found += [(reader, 2) for reader in view.users]
    return found


def _node(graph: torch.fx.Graph, target: Any, args: tuple, like: Node) -> Node:
    node = graph.call_function(target, args)
    node.meta.update({k: like.meta[k] for k in _CARRIED if k in like.meta})
    node.meta["val"] = _fake(target, args, like)
    return node


def _fake(target: Any, args: tuple, like: Node) -> Any:
    """The new node's value, computed on the fake tensors of its arguments."""
    from torch._guards import detect_fake_mode

    values = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    mode = detect_fake_mode([like.meta["val"]])
    with mode if mode is not None else torch._subclasses.FakeTensorMode():
        return target(*values)
