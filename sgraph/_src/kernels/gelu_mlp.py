"""``linear(gelu_tanh(linear(x, W1, b1)), W2, b2)`` with the GELU in the matmuls' epilogues.

A transformer's MLP under bf16 autocast, written the ordinary way, runs a matmul for
``h = x @ W1.T + b1``, a kernel for ``g = gelu(h)`` (reading ``h``, writing ``g``), and
in the backward a kernel for ``dh = gelu'(h) * dg`` after the matmul that makes ``dg``,
then the sum of ``dh`` for ``b1``'s gradient. Here the forward's first matmul writes
``g`` and ``h`` itself (cuBLASLt's ``GELU_AUX_BIAS`` epilogue) and the backward's matmul
``dy @ W2`` writes ``dh`` (``DGELU``): the GELU and its gradient make no pass of their
own over the ``rows x hidden`` activations (the bias gradient's sum still does). Saved
for the backward: ``x``, ``g``, ``h`` and the weights, as in the ordinary code.

Two custom ops (``sgraph::gelu_linear``, ``sgraph::gelu_linear_backward``) and the
autograd function :func:`gelu_mlp` over them. On a GPU they run
:mod:`sgraph._src.kernels.cublaslt`; elsewhere, or where cuBLASLt does not take the
tensors, the same arithmetic in ATen ops (``addmm``, ``gelu``, ``gelu_backward``).
cuBLASLt's GELU is the tanh approximation, so only ``approximate="tanh"`` is matched
(:mod:`sgraph._src.patterns`).

Numerics: cuBLASLt applies the bias and the GELU (or its derivative) to the fp32
accumulator before rounding to bf16 once; the ordinary code rounds the product to bf16
first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cublaslt

__all__ = ["gelu_mlp", "scratch_bytes"]


def scratch_bytes(first: Tensor) -> list[tuple[int, str]]:
    """What either op holds beyond its outputs, given its first argument: on a GPU at
    most one cuBLASLt workspace (the memory analysis counts that bound)."""
    return [(cublaslt.WORKSPACE_BYTES, "cuBLASLt workspace")] if first.device.type == "cuda" else []


@torch.library.custom_op("sgraph::gelu_linear", mutates_args=())
def _gelu_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(gelu_tanh(h), h)``, ``h = x @ weight.T + bias``; ``x [n, k]``, ``weight [m, k]``."""
    if x.is_cuda:
        try:
            return cublaslt.gelu_matmul(x.contiguous(), weight.contiguous(), _contiguous(bias))
        except cublaslt.Unsupported:
            pass
    pre = torch.addmm(bias, x, weight.t()) if bias is not None else torch.mm(x, weight.t())
    return F.gelu(pre, approximate="tanh"), pre


@_gelu_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("sgraph::gelu_linear_backward", mutates_args=())
def _gelu_linear_backward(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """``gelu_tanh'(pre) * (grad @ weight)``; ``grad [n, k]``, ``weight [k, m]`` (the
    second linear's weight), ``pre [n, m]``."""
    if grad.is_cuda:
        try:
            return cublaslt.dgelu_matmul(grad.contiguous(), weight.contiguous(), pre.contiguous())
        except cublaslt.Unsupported:
            pass
    return torch.ops.aten.gelu_backward(torch.mm(grad, weight), pre, approximate="tanh")


@_gelu_linear_backward.register_fake
def _(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    return pre.new_empty(pre.shape)


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


class _GeluMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):  # type: ignore[override]
        g, h = torch.ops.sgraph.gelu_linear(x, w1, b1)
        y = torch.addmm(b2, g, w2.t()) if b2 is not None else torch.mm(g, w2.t())
        ctx.save_for_backward(x, w1, w2, g, h, b1, b2)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w1, w2, g, h, b1, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():
            # This backward is itself differentiated (an outer sg.grad): the own ops have
            # no derivatives, so take the ordinary ops' gradients, which do.
            inputs = [(i, t) for i, t in enumerate((x, w1, b1, w2, b2)) if t is not None and need[i]]
            y = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
            found = torch.autograd.grad(y, [t for _, t in inputs], dy, create_graph=True)
            grads: list[Tensor | None] = [None] * 5
            for (i, _), grad in zip(inputs, found):
                grads[i] = grad
            return tuple(grads)
        dw2 = torch.mm(dy.t(), g) if need[3] else None
        db2 = dy.sum(0) if b2 is not None and need[4] else None
        dx = dw1 = db1 = None
        if need[0] or need[1] or need[2]:
            dh = torch.ops.sgraph.gelu_linear_backward(dy, w2, h)
            dx = torch.mm(dh, w1) if need[0] else None
            dw1 = torch.mm(dh.t(), x) if need[1] else None
            db1 = dh.sum(0) if b1 is not None and need[2] else None
        return dx, dw1, db1, dw2, db2


def gelu_mlp(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
    """``F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)``, GELU and
    its gradient in the matmuls' epilogues.

    Args:
        x: ``[..., k]``; all tensors of one dtype (bf16 or fp16 for the cuBLASLt path).
        w1, b1: the first linear, ``[m, k]`` and ``[m]`` (or ``None``).
        w2, b2: the second linear, ``[o, m]`` and ``[o]`` (or ``None``).

    Example:
        >>> y = gelu_mlp(x, fc.weight, fc.bias, out.weight, out.bias)
    """
    lead = x.shape[:-1]
    y = _GeluMlp.apply(x.reshape(-1, x.shape[-1]), w1, b1, w2, b2)
    return y.reshape(*lead, w2.shape[0])
