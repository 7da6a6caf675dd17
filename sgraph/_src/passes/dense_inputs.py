"""Lay a CUDA graph's copied inputs out densely when the user's tensors have gaps.

Under ``sg.static`` on a GPU, an input that is not donated is copied before each
replay into a buffer the graph owns. The buffer had the input's own strides, because
the traced program (and Inductor's code for it) reads those strides; for a gapped view
that is the input's whole memory extent, not its elements: ``feats[:, :16]`` of a
4096-column tensor took a buffer 256 times the size of what the step reads.

This pass gives such an input a dense layout in the program: its placeholder's
strides are those of a dense tensor with the dimensions in the same order (what
``torch.empty_like`` makes for it), and every node computed from it has its value
computed again. The runtime then copies the user's gapped tensor into a dense buffer
(see ``runtime/cudagraph.py``); the values the step computes are the same, since no op
left in the program reads an input's strides except those excluded below.

Left as traced:
- donated inputs (the graph works in the user's own memory);
- inputs whose elements may share memory (an expanded view: its span is small);
- DTensor inputs (their local shards are laid out by the mesh code);
- inputs read through an op that takes explicit strides (``as_strided`` and its
  kin, on the input or a view of it): those strides address the input's memory;
- any program where an op refuses the new layout (computing values again raises).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..program import Program, alias_root, fake_mode, placeholders

__all__ = ["dense_inputs", "dense_layout", "element_reach", "has_gaps"]

Node = torch.fx.Node
aten = torch.ops.aten
# Ops whose arguments name strides or offsets into the input's memory.
_ADDRESSING = {
    aten.as_strided.default,
    aten.as_strided_.default,
    aten.as_strided_copy.default,
    aten.as_strided_scatter.default,
    aten._reshape_alias.default,
    aten.set_.source_Storage_storage_offset,
}


def dense_inputs(program: Program) -> Program:
    """``program`` with its gapped, undonated tensor inputs laid out densely (module
    docstring); ``program`` itself where there are none.

    Example:
        >>> lowered = dense_inputs(program)  # traced with x = feats[:, :16]
        >>> placeholders(lowered.graph)[1].meta["val"].stride()
        (16, 1)
    """
    nodes = placeholders(program.graph)
    leaves = program.tensor_inputs
    chosen = [
        node
        for i, (node, leaf) in enumerate(zip(nodes, leaves))
        if i not in program.donated and leaf.dist is None and has_gaps(node.meta.get("val"))
    ]
    if not chosen:
        return program
    addressed = {alias_root(n) for n in program.graph.nodes if n.target in _ADDRESSING}
    chosen = [n for n in chosen if n not in addressed]
    if not chosen:
        return program
    mode = fake_mode(program.graph)
    if mode is None:
        return program
    work = program.copy_graph_module()
    graph_nodes = placeholders(work.graph)
    index = {n: i for i, n in enumerate(nodes)}
    new_vals: dict[Node, Any] = {}
    with mode:
        for node in chosen:
            val = node.meta["val"]
            new_vals[graph_nodes[index[node]]] = torch.empty_strided(
                val.shape, dense_layout(val), dtype=val.dtype, device=val.device
            )
    try:
        vals = _propagate(work.graph, new_vals, mode)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return program  # an op refused the dense layout: the traced one stays
    for node, val in vals.items():
        node.meta["val"] = val
    return program.replace(graph_module=work, passes=program.passes + ("dense_inputs",))


def has_gaps(val: Any) -> bool:
    """Whether a tensor's elements are apart but do not fill the memory from its first
    to its last (``x[:, :16]``, ``x[::2]``); an empty tensor has none."""
    if not isinstance(val, torch.Tensor) or val.numel() <= 1:
        return False
    reach = element_reach(val)
    return reach is not None and reach + 1 > val.numel()


def element_reach(t: torch.Tensor) -> int | None:
    """How many elements past its first ``t``'s last one lies, where no two of its
    elements can share memory (with its dims ordered by stride, each stride steps past
    everything the smaller dims reach); ``None`` where they may (an expanded view; a
    layout that fails the test may still not overlap)."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return None
        reach += (size - 1) * stride
    return reach


def dense_layout(val: torch.Tensor) -> tuple[int, ...]:
    """Dense strides with the dimensions in ``val``'s order, largest stride outermost
    (dimensions of equal stride keep their order)."""
    order = sorted(range(val.dim()), key=lambda d: (val.stride(d), -d), reverse=True)
    strides = [0] * val.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(val.shape[d], 1)
    return tuple(strides)


def _propagate(graph: torch.fx.Graph, changed: dict[Node, Any], mode: Any) -> dict[Node, Any]:
    """New values of ``changed``'s nodes and of every node whose value follows from
    them: each op computed again on fake tensors, in graph order. A node whose new
    value is laid out as the old one, and is not a view of a changed input, is left
    alone, and so is what follows from it alone."""
    vals: dict[Node, Any] = dict(changed)
    bases = set(changed)
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in vals for a in node.all_input_nodes):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: vals.get(a, a.meta.get("val")))
        with mode:
            val = node.target(*args, **kwargs)
        if alias_root(node) in bases or not _same_layout(val, node.meta.get("val")):
            vals[node] = val
    return vals


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
        )
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)
