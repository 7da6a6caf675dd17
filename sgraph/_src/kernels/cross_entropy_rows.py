"""Cross-entropy of a block of logit rows, with its gradient written over the logits.

One Triton program per row reads the row twice: once for the log-sum-exp (an online
max and sum of exponentials, in fp32; the max is the row's, updated once per block of
columns, so each logit costs one exponential) and the sum of the logits (for label
smoothing), once to overwrite the row with ``d loss / d logits``. The rows' losses
go to a separate fp32 vector. With ``V`` classes, smoothing ``e``, target ``y`` and
``lse`` the log-sum-exp of the row ``z``:

    loss = lse - (1 - e) * z[y] - e * mean(z)
    grad = (softmax(z) - (1 - e) * onehot(y) - e / V) * scale

and both are zero on a row whose target is ``ignore_index``. A row whose target is
outside ``[0, V)`` gets a NaN loss and gradient (eager PyTorch raises there, which a
captured graph cannot; the ATen reference raises too). ``scale`` is a
one-element fp32 tensor (``1 / count`` for a mean), read on the device, so nothing
waits for the host. On CPU tensors the kernel runs in Triton's interpreter (tests,
with ``TRITON_INTERPRET=1`` set before Triton is imported);
:func:`cross_entropy_rows_reference` is the same computation in ATen ops.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from .triton_support import require_interpreter

__all__ = ["cross_entropy_rows_", "cross_entropy_rows_reference"]


def launch(classes: int) -> tuple[int, int]:
    """Columns per step and warps per row, the fastest of a sweep on an H200
    (docs/results/cross-entropy-rows-2026-12-03-h200.txt): 4096 and 8 for 16384 classes
    or more (0.175 ms on gpt-med's chunk of 4096 x 32768 bf16 logits; 0.198 at 2048 and
    4), 2048 and 4 below (0.087 ms on gpt-mini's 8192 x 8192; 0.090 at 4096 and 4)."""
    block, warps = (4096, 8) if classes >= 16384 else (2048, 4)
    return min(block, 1 << max(classes - 1, 1).bit_length()), warps


def cross_entropy_rows_(z: Tensor, target: Tensor, scale: Tensor, ignore_index: int, smoothing: float) -> Tensor:
    """Row losses of ``z`` ([rows, V], contiguous rows) against ``target`` ([rows]);
    ``z`` is overwritten with the gradient (times ``scale``). Runs the Triton kernel
    (for CPU tensors, in Triton's interpreter: the process must start with
    ``TRITON_INTERPRET=1``).

    Example:
        >>> losses = cross_entropy_rows_(logits, y, torch.ones(1), -100, 0.0)  # logits now hold grads
    """
    rows, classes = z.shape
    assert z.stride(1) == 1, "rows must be contiguous"
    losses = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows == 0:
        return losses
    kernel = _kernel(z.device.type != "cuda")
    block, warps = launch(classes)
    kernel[(rows,)](
        z, z.stride(0), target, losses, scale, classes, ignore_index, float(smoothing), BLOCK=block, num_warps=warps
    )
    return losses


def cross_entropy_rows_reference(
    z: Tensor, target: Tensor, scale: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    """:func:`cross_entropy_rows_` in ATen ops (the CPU path, and the tests' reference)."""
    classes = z.shape[1]
    zf = z.float()
    lse = zf.logsumexp(1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = zf.gather(1, safe[:, None])[:, 0]
    smoothed = smoothing * zf.mean(1) if smoothing else 0.0  # no 0 * -inf where a class is masked
    losses = torch.where(valid, lse - (1 - smoothing) * picked - smoothed, 0.0)
    grad = (zf - lse[:, None]).exp_().sub_(smoothing / classes)
    grad.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -(1 - smoothing)))
    grad.mul_(torch.where(valid, scale.float(), 0.0)[:, None])
    z.copy_(grad)
    return losses


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The Triton kernel (Triton is imported only now)."""
    if interpret:
        require_interpreter("cross_entropy_rows_", " (or use cross_entropy_rows_reference)")
    from ._cross_entropy_triton import cross_entropy_rows

    return cross_entropy_rows
