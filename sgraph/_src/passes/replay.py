"""Make kernels replay as they ran while the step was traced.

A traced graph is replayed under ``torch.no_grad()`` from what fake (meta) kernels
said each op returns. Three kinds of ATen op break that, each listed in a table
below; ``nn.LSTM`` on CPU (oneDNN's ``aten.mkldnn_rnn_layer``) hits all three:

- Its kernel reads the thread-local grad mode instead of an argument: the forward
  saves the workspace its backward needs only when grad mode is on, so under
  ``no_grad`` the backward fails on an undefined workspace. Where the graph reads
  that output, the op becomes an ``sgraph::<op>_grad_enabled`` twin of the same
  schema, which runs the ATen kernel with grad mode on (a thread-local switch,
  scoped to the call) on detached inputs (so no autograd graph is recorded).
- Its meta kernel returns one tensor for two outputs: the backward's meta returns
  ``diff_b`` for both bias gradients (the kernel returns a clone), so tracing can
  record both as one node and the step returns one tensor object for two leaves.
  When one such output is returned more than once and the other is read by
  nothing, its first return reads the other.
- Its meta kernel gives another dtype than the kernel: the backward computes in
  float32, but torch 2.11's meta keeps the input's dtype, so for bf16 the trace
  records no cast and the step would return float32 gradients. A cast to the
  traced dtype, the one autograd applies in eager, goes after each such output.

And one more, which only generated code meets: its kernel reads its tensors as if
contiguous, whatever their strides. Eagerly they are (the forward's input is
``x.transpose(0, 1).contiguous()`` for ``batch_first``), but Inductor may hand an
ATen op it calls a buffer of the same values on other strides (the backward's copy
of that input, made again for the backward), and the weights' gradient came out
wrong. Such an op becomes an ``sgraph::<op>_contiguous`` twin (folded into the grad
mode twin above where both apply) that passes its kernel contiguous tensors: no copy
where they already are.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, cast

import torch
import torch.fx

from ..program import Program, output_node, returned

__all__ = ["replay"]

Node = torch.fx.Node
aten = torch.ops.aten

# op -> index of the output its kernel makes only under grad mode (what backward reads).
_GRAD_MODE_STATE: dict[torch._ops.OpOverload, int] = {aten.mkldnn_rnn_layer.default: 3}

# op -> output pairs its meta kernel returns as one tensor, its real kernel as two.
_SHARED_FAKE_OUTPUTS: dict[torch._ops.OpOverload, tuple[tuple[int, int], ...]] = {
    aten.mkldnn_rnn_layer_backward.default: ((3, 4),),
}

# op -> the dtype its real kernel gives every output, whatever its meta kernel says.
_REAL_DTYPE: dict[torch._ops.OpOverload, torch.dtype] = {aten.mkldnn_rnn_layer_backward.default: torch.float32}

# ops whose kernels read their tensor arguments as contiguous, whatever their strides.
_CONTIGUOUS_INPUTS = frozenset({aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default})

_LIB = torch.library.Library("sgraph", "FRAGMENT")


def replay(program: Program, *, in_place: bool = False) -> Program:
    """Rewrite ops whose traced form would not replay as traced (see the module).

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Returns:
        A Program over a new graph module, the input's graph untouched (with
        ``in_place``: over the input's graph module, edited).
        Idempotent.

    Example:
        >>> [str(n.target) for n in replay(lstm_program).ops() if "rnn_layer" in str(n.target)]
        ['sgraph.mkldnn_rnn_layer_grad_enabled.default', 'aten.mkldnn_rnn_layer_backward.default']
    """
    gm = program.graph_module_to_edit(in_place)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        op = node.target
        grad_mode = op in _GRAD_MODE_STATE and _items(node).get(_GRAD_MODE_STATE[op]) is not None
        if grad_mode or op in _CONTIGUOUS_INPUTS:
            node.target = _twin(op, grad_mode=grad_mode, contiguous=op in _CONTIGUOUS_INPUTS)
        for pair in _SHARED_FAKE_OUTPUTS.get(op, ()):
            _split(graph, node, pair)
        if op in _REAL_DTYPE:
            _cast_to_traced_dtypes(graph, node, _REAL_DTYPE[op])
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("replay",))


def _items(op: Node) -> dict[int, Node]:
    """``op``'s getitem nodes that something reads, by output index."""
    return {cast(int, u.args[1]): u for u in op.users if u.target is operator.getitem and u.users}


@functools.cache
def _twin(op: torch._ops.OpOverload, *, grad_mode: bool, contiguous: bool) -> torch._ops.OpOverload:
    """``sgraph::<name>_grad_enabled`` (run with grad mode on) or ``..._contiguous`` (its
    tensors passed contiguous), or both: ``op``'s schema, ``op``'s kernel."""
    name = op._schema.name.split("::")[1] + ("_grad_enabled" if grad_mode else "_contiguous")
    _LIB.define(name + "(" + str(op._schema).split("(", 1)[1])

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
        if contiguous:
            args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.contiguous, (args, kwargs))
        with torch.enable_grad() if grad_mode else contextlib.nullcontext():
            return op(*args, **kwargs)

    # CompositeExplicitAutograd serves every backend, Meta (so fake tensors) included.
    _LIB.impl(name, run, "CompositeExplicitAutograd")
    return getattr(torch.ops.sgraph, name).default


def _split(graph: torch.fx.Graph, op: Node, pair: tuple[int, int]) -> None:
    values = returned(graph)
    items = _items(op)
    for mine, other in (pair, pair[::-1]):
        item = items.get(mine)
        if item is None or other in items or sum(v is item for v in values) < 2:
            continue
        with graph.inserting_after(item):
            twin = graph.call_function(operator.getitem, (op, other))
        twin.meta = dict(item.meta)
        values[next(i for i, v in enumerate(values) if v is item)] = twin
        output_node(graph).args = (values,)
        return


def _cast_to_traced_dtypes(graph: torch.fx.Graph, op: Node, real: torch.dtype) -> None:
    for item in _items(op).values():
        val = item.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype != real:
            _insert_cast(graph, item, val.dtype)
            item.meta["val"] = _retyped(val, real)


def _insert_cast(graph: torch.fx.Graph, item: Node, dtype: torch.dtype) -> None:
    """Make every reader of ``item`` read it cast to ``dtype``."""
    with graph.inserting_after(item):
        converted = graph.call_function(aten._to_copy.default, (item,), {"dtype": dtype})
    converted.meta = dict(item.meta)
    item.replace_all_uses_with(converted, delete_user_cb=lambda user: user is not converted)


def _retyped(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``val``'s metadata with another dtype, made in ``val``'s own fake mode."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta")
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)
