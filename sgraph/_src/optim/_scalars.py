"""Scalars derived from the step count, as tensor ops that trace into the graph.

The count is a 0-dim int64 tensor on the params' device: the number of updates
already applied. Bias corrections and scheduled learning rates are computed from it
in float64 (as PyTorch's optimizers compute them in Python floats), then cast once
per use to the dtype the foreach kernels need. Nothing here reads a tensor's value
on the host, so a traced step never syncs and a new count never retraces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

__all__ = [
    "Scalar",
    "Tensors",
    "init_count",
    "step_number",
    "learning_rate",
    "bias_correction",
    "like",
    "as_tensor",
    "dtypes_of",
    "lerp",
    "sign",
]

Scalar = Union[float, torch.Tensor]
"""A hyperparameter after evaluation: a Python float, or a 0-dim tensor when scheduled."""

Tensors = Union[tuple[torch.Tensor, ...], list[torch.Tensor]]
"""A list of leaves, as the ``torch._foreach_*`` ops take and return them."""


def init_count(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh 0-dim int64 zero on the device of the first leaf (CPU when there is none)."""
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int64, device=device)


def step_number(count: torch.Tensor) -> torch.Tensor:
    """The 1-based number of the update being computed, as a float64 0-dim tensor.

    PyTorch increments ``state['step']`` before using it, so the first update uses 1.
    """
    return (count + 1).to(torch.float64)


def learning_rate(lr: Any, count: torch.Tensor) -> Scalar:
    """The learning rate of the update that ``count`` precedes.

    Args:
        lr: a float (returned unchanged, so eager math matches PyTorch exactly) or a
            schedule, called on the count of updates already applied (optax's rule).
        count: the state's count before this update.

    Returns:
        ``lr`` itself, or the schedule's value as a float64 0-dim tensor.
    """
    if isinstance(lr, float):
        return lr
    return as_tensor(lr(count), torch.float64, count.device)


def as_tensor(value: Scalar, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-dim tensor. A Python number goes through a factory op
    (``torch.full``), which a trace records like any op: ``torch.as_tensor`` of a number
    allocates on the device for real first, so a step for a GPU could not be traced
    (analysed, lowered) on a machine without one."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=dtype, device=device)
    return torch.full((), value, dtype=dtype, device=device)


def bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**step`` as a float64 0-dim tensor."""
    return 1.0 - beta**step


def like(value: Scalar, leaf: torch.Tensor) -> Scalar:
    """``value`` ready to combine with ``leaf`` in a foreach op.

    A float passes through. A tensor goes to the leaf's device, in float32 for
    float32/bf16/fp16 leaves (the precision PyTorch uses for Python scalars with
    those dtypes) and float64 for float64 leaves. A foreach op on a CUDA list takes
    its multi-tensor path only when a tensor scalar has the list's dtype, so bf16
    and fp16 lists use the per-tensor path eagerly; inside a compiled step the ops
    are fused either way. A 0-dim bf16/fp16 leaf times a 0-dim float32 scalar
    promotes to float32; :func:`dtypes_of` casts such results back.
    """
    if isinstance(value, float):
        return value
    dtype = torch.float64 if leaf.dtype == torch.float64 else torch.float32
    return value.to(device=leaf.device, dtype=dtype)


def dtypes_of(results: Tensors, leaves: Tensors) -> list[torch.Tensor]:
    """``results`` in the dtypes of ``leaves`` (only promoted 0-dim low-precision leaves change)."""
    return [r if r.dtype == x.dtype else r.to(x.dtype) for r, x in zip(results, leaves)]


def _dtensors(leaves: Tensors) -> bool:
    return type(leaves[0]).__name__ == "DTensor"


def lerp(start: Tensors, end: Tensors, weight: float) -> Tensors:
    """``torch._foreach_lerp(start, end, weight)``; leaf by leaf for DTensors, which have
    no sharding rule for the foreach form in torch 2.11 (the same kernel per leaf on CPU)."""
    if _dtensors(start):
        return [torch.lerp(s, e, weight) for s, e in zip(start, end)]
    return torch._foreach_lerp(start, end, weight)


def sign(leaves: Tensors) -> Tensors:
    """``torch._foreach_sign(leaves)``; leaf by leaf for DTensors, as :func:`lerp`."""
    if _dtensors(leaves):
        return [torch.sign(x) for x in leaves]
    return torch._foreach_sign(leaves)
