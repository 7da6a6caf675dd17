"""Run a Program's graph on eager ATen kernels (the CPU runtime, and what a CUDA
graph captures when no generated kernels are asked for)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..program import Program

__all__ = ["EagerExecutable"]


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
            for out, into in self.aliases:
                target = inputs[into]
                if outputs[out] is not target:
                    target.copy_(outputs[out])
                    outputs[out] = target
        return outputs
