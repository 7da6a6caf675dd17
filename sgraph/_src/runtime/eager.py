"""Run a Program's graph on eager ATen kernels (the CPU runtime, and what a CUDA
graph captures when no generated kernels are asked for)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..program import Program
from ..source import SOURCE_KEY

__all__ = ["OWN_COPY_BYTES", "EagerExecutable", "copy_lists", "note_failing_node", "write_back"]

OWN_COPY_BYTES = 32 * 1024
"""Bytes from which :func:`copy_lists` copies a tensor on its own rather than in a
multi-tensor copy: from there ATen's multi-tensor copy takes about 1 us more than a copy
of its own on an H200 (docs/performance.md)."""


class EagerExecutable:
    """Calls the graph module, then writes outputs into the donated inputs they alias.

    The write-back happens after the whole graph ran, so the step reads every
    donated input before anything overwrites it.
    """

    def __init__(self, program: Program) -> None:
        self.graph_module = program.graph_module
        self.aliases = program.aliases
        self.kernel_launches: int | None = None

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            try:
                outputs = list(self.graph_module(*inputs))
            except Exception as error:
                note_failing_node(error, self.graph_module)
                raise
            write_back(inputs, outputs, self.aliases)
        return outputs


def note_failing_node(error: BaseException, graph_module: torch.fx.GraphModule) -> None:
    """Add a note to ``error``, raised while ``graph_module`` ran, naming the traced op
    that raised and the user's source line it came from (the traceback itself points
    into the generated code of the graph). Nothing is added where the op is not found,
    or before Python 3.11 (no exception notes)."""
    if not hasattr(error, "add_note"):
        return
    code = graph_module.forward.__code__
    lineno = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = getattr(graph_module, "_lineno_map", None)
    if lineno is None or not lines:
        return
    index = lines.get(lineno - code.co_firstlineno)
    nodes = list(graph_module.graph.nodes)
    if index is None or not 0 <= index < len(nodes):
        return
    node = nodes[index]
    source = node.meta.get(SOURCE_KEY)
    where = f", traced from {source.describe()}" if source is not None else ""
    error.add_note(f"sgraph: raised by the compiled step's {node.target} (node %{node.name}){where}")


def write_back(inputs: Sequence[torch.Tensor], outputs: list[torch.Tensor], aliases: Sequence[tuple[int, int]]) -> None:
    """Copy each aliased output into its donated input (one multi-tensor copy), then
    return that input in the output's place."""
    pairs = [(inputs[into], outputs[out]) for out, into in aliases if outputs[out] is not inputs[into]]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
    for out, into in aliases:
        outputs[out] = inputs[into]


def copy_lists(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all ``i``: a copy of its own for each large
    tensor, one multi-tensor copy per dtype pair for the small ones.

    ATen's ``_foreach_copy_`` takes its one-kernel path on a GPU only for lists of one
    dtype (one int64 batch among fp32 params sends every tensor to a copy of its own: a
    launch each, which dominates the call of a small step). That kernel gives each
    thread block a chunk of 65536 elements, so a large tensor is copied by one block or
    a few: on an H200, 64 x 1024 fp32 took 7.4 us through it against 1.0 us through
    ``copy_``, while eight tensors of 4 KiB took 1.1 us in it against 6.2 us in eight
    copies (docs/performance.md). Tensors of at least ``OWN_COPY_BYTES`` therefore get a
    ``copy_`` of their own, and so does a dtype pair left with a single tensor. The
    copies then run in another order than the lists', so no target may be read by
    another pair's source (the graph's static buffers and fresh outputs are not)."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources):
        if source.numel() * source.element_size() >= OWN_COPY_BYTES:
            target.copy_(source)
            continue
        group = groups.setdefault((target.dtype, source.dtype), ([], []))
        group[0].append(target)
        group[1].append(source)
    for group_targets, group_sources in groups.values():
        if len(group_targets) == 1:
            group_targets[0].copy_(group_sources[0])
        else:
            torch._foreach_copy_(group_targets, group_sources)
