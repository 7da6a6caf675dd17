"""``cross_entropy(x @ W.T, y)`` in row chunks, never holding the full logits.

For each chunk of rows the op computes that chunk's logits with one matmul, turns
them in place into ``d loss / d logits`` with :mod:`cross_entropy_rows` (the Triton
kernel on a GPU), and immediately multiplies them back: ``grad_x`` for those rows and
a running ``grad_W``. So forward and backward happen in one pass, and at most one
chunk of logits exists at a time (instead of logits, their fp32 copy, log-softmax
and its gradient, each rows x classes). The backward of the loss then only scales
the two stored gradients by the incoming gradient.

Numerics follow the ordinary code under autocast: logits and their gradient in the
matmul dtype, softmax and loss in fp32 (even when the user did not cast the logits
to fp32 first), ``grad_W`` accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cross_entropy_rows import cross_entropy_rows_, cross_entropy_rows_reference
from .triton_support import triton_available

__all__ = ["linear_cross_entropy", "chunk_rows", "scratch_bytes"]

_CHUNK_ELEMENTS = 1 << 27  # logits per chunk: 256 MiB in bf16
# ``addmm(..., out_dtype=float32)`` (CUDA only) adds a bf16 product into an fp32 matrix in
# the matmul's epilogue, instead of writing the product and adding it in a second kernel.
# Measured and tested for bf16 only; fp16 keeps the second kernel.
_ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()


def chunk_rows(rows: int, classes: int) -> int:
    """Rows per chunk: about 128M logits, at least 128 rows, at most all of them."""
    return max(1, min(rows, max(128, _CHUNK_ELEMENTS // max(classes, 1))))


def scratch_bytes(x: Tensor, weight: Tensor) -> list[tuple[int, str]]:
    """What the op holds inside beyond its three outputs, at its peak: one chunk of
    logits and, for low-precision inputs, the fp32 running ``grad_W`` (for fp32 inputs
    that is the returned ``grad_W`` itself). A chunk's low-precision ``grad_W`` product
    is as large as the returned ``grad_W``, which does not exist yet while it does."""
    rows, classes = x.shape[0], weight.shape[0]
    found = [(chunk_rows(rows, classes) * classes * x.element_size(), "one chunk of logits")]
    if x.dtype != torch.float32:
        found.append((weight.numel() * 4, "fp32 running grad_W"))
    return found


@torch.library.custom_op("sgraph::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, mean: bool
) -> tuple[Tensor, Tensor, Tensor]:
    rows, classes = x.shape[0], weight.shape[0]
    valid = (target != ignore_index).sum(dtype=torch.float32)
    scale = (1.0 / valid if mean else torch.ones((), device=x.device)).reshape(1)
    step = chunk_rows(rows, classes)
    logits = torch.empty(step, classes, dtype=x.dtype, device=x.device)
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    rows_kernel = cross_entropy_rows_ if x.is_cuda and triton_available() else cross_entropy_rows_reference
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        z = logits[: stop - start]
        torch.mm(x[start:stop], weight.t(), out=z)
        loss += rows_kernel(z, target[start:stop], scale, ignore_index, label_smoothing).sum()
        torch.mm(z, weight, out=grad_x[start:stop])
        if x.dtype == torch.float32:
            grad_w.addmm_(z.t(), x[start:stop])
        elif x.is_cuda and x.dtype == torch.bfloat16 and _ADDMM_OUT_DTYPE:  # summed in fp32 by the matmul
            torch.addmm(grad_w, z.t(), x[start:stop], out_dtype=torch.float32, out=grad_w)
        else:  # a low-precision product per chunk, then summed in fp32
            grad_w += torch.mm(z.t(), x[start:stop])
    return loss * scale[0], grad_x, grad_w.to(weight.dtype)


@_linear_cross_entropy.register_fake
def _(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, mean: bool):
    # The layouts the op returns: ``grad_x`` like ``x`` (``empty_like``), ``grad_W`` dense
    # row-major whatever ``weight``'s strides (a transposed ``[features, classes]`` head).
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x), weight.new_empty(weight.shape)


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss; its backward scales the gradients the forward already computed."""

    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, label_smoothing, mean):  # type: ignore[override]
        loss, grad_x, grad_w = torch.ops.sgraph.linear_cross_entropy(
            x, weight, target, ignore_index, label_smoothing, mean
        )
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "sg.fuse's linear_cross_entropy kernel computes its gradients in the forward and "
                "cannot be differentiated twice (an outer sg.grad over this loss): leave it out with "
                'sg.fuse(kernels=("adamw", "gelu_mlp")).'
            )
        grad_x, grad_w = ctx.saved_tensors
        dx = grad_x * grad.to(grad_x.dtype) if ctx.needs_input_grad[0] else None
        dw = grad_w * grad.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy(x @ weight.T, target, ...)`` computed in row chunks.

    Args:
        x: ``[rows, features]`` (bf16/fp16 under autocast-like use, or fp32).
        weight: ``[classes, features]``, same dtype as ``x``.
        target: ``[rows]`` class indices.
        ignore_index / label_smoothing: as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over rows whose target is not ignored) or ``"sum"``.

    Returns:
        The fp32 scalar loss; differentiable in ``x`` and ``weight``.

    Example:
        >>> loss = linear_cross_entropy(hidden.reshape(-1, d), head.weight, y.reshape(-1))
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'.")
    return _LinearCrossEntropy.apply(x, weight, target, ignore_index, float(label_smoothing), reduction == "mean")
