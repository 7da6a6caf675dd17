"""Run a Program's graph on eager ATen kernels (the CPU runtime, and what a CUDA
graph captures when no generated kernels are asked for)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..program import Program

__all__ = ["EagerExecutable", "copy_lists", "write_back"]


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
            outputs = list(self.graph_module(*inputs))
            write_back(inputs, outputs, self.aliases)
        return outputs


def write_back(inputs: Sequence[torch.Tensor], outputs: list[torch.Tensor], aliases: Sequence[tuple[int, int]]) -> None:
    """Copy each aliased output into its donated input (one multi-tensor copy), then
    return that input in the output's place."""
    pairs = [(inputs[into], outputs[out]) for out, into in aliases if outputs[out] is not inputs[into]]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
    for out, into in aliases:
        outputs[out] = inputs[into]


def copy_lists(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all ``i``, one multi-tensor copy per dtype.

    ATen's ``_foreach_copy_`` takes its one-kernel path on a GPU only for lists of one
    dtype (one int64 batch among fp32 params sends every tensor to a copy of its own: a
    launch each, which dominates the call of a small step). The copies of different
    dtypes then run in another order than the lists', so no target may be read by
    another pair's source (the graph's static buffers and fresh outputs are not)."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources):
        group = groups.setdefault((target.dtype, source.dtype), ([], []))
        group[0].append(target)
        group[1].append(source)
    for group_targets, group_sources in groups.values():
        torch._foreach_copy_(group_targets, group_sources)
