"""The gradient through a GELU and the bias gradient it feeds, in one pass over memory.

In the backward of ``gelu(x @ W.T + b)`` the gradient at the Linear's output is
``g = gelu_backward(dy, x)``; it feeds the two gradient matmuls and the bias gradient
``g.sum(0)``. Inductor writes ``g`` in one kernel (the matmuls need it in memory) and
reads it all again in a second for the column sums: on gpt-med's MLP (16384 x 4096
bf16) a 128 MiB read per layer. Here one Triton kernel writes ``g`` and sums its
columns as it goes, each program over a group of rows, and a small second kernel adds
the groups' partial sums (a single group, as in a small batch, writes the bias
gradient directly: one launch).

Numerics are eager's: ``g`` computed in fp32 as ATen's kernel computes it (same order
of operations; on the GPU the same ``tanh``) and rounded to the inputs' dtype; the bias
gradient is the sum of those rounded values, accumulated in fp32 and rounded once, as
ATen's ``sum`` of a bf16 tensor does (in another order of additions). On CPU tensors
outside Triton's interpreter, the op runs ATen's ``gelu_backward`` and ``sum``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import Tensor

from .triton_support import require_interpreter, triton_available

__all__ = ["gelu_bias_grad", "gelu_bias_grad_reference", "gelu_bias_grad_triton", "plan", "scratch_bytes"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_M = 32
_PROGRAMS = 1024  # programs wanted per launch: several per SM on a large GPU
_MAX_ROWS = 4096
_ONE_GROUP = 256  # rows
_SUM_BLOCK = 64


def plan(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """``(block_n, rows, groups)``: columns per program, rows per program (a power of
    two, at least one block of rows), and the groups of rows whose partial sums are
    added. Up to ``_ONE_GROUP`` rows (a small batch) one group covers them all, so the
    bias gradient is written by the one launch; narrower column blocks then keep more
    programs busy."""
    if n_rows <= _ONE_GROUP:
        return 32, max(_BLOCK_M, _pow2(n_rows)), 1
    block_n = 128
    wanted = max(1, _PROGRAMS // -(-n_cols // block_n))
    rows = min(_MAX_ROWS, max(_BLOCK_M, _pow2(-(-n_rows // wanted))))
    return block_n, rows, -(-n_rows // rows)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def scratch_bytes(dy: Tensor) -> list[tuple[int, str]]:
    """What the op holds beyond its outputs: the fp32 partial column sums of its groups of rows."""
    n_rows, n_cols = dy.shape
    groups = plan(n_rows, n_cols)[2]
    return [(groups * n_cols * 4, "partial bias-gradient sums")] if groups > 1 else []


def runs_triton(dy: Tensor, x: Tensor) -> bool:
    """Whether the Triton kernel takes these inputs (else ATen's ops run)."""
    return (
        dy.is_cuda
        and triton_available()
        and dy.dtype in _DTYPES
        and dy.dtype == x.dtype
        and dy.shape == x.shape
        and dy.dim() == 2
        and dy.is_contiguous()
        and x.is_contiguous()
    )


@torch.library.custom_op("sgraph::gelu_bias_grad", mutates_args=())
def gelu_bias_grad(dy: Tensor, x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """``(g, g.sum(0))`` for ``g = gelu_backward(dy, x, approximate)``, ``dy`` and ``x``
    of shape ``[rows, columns]``.

    Example:
        >>> g, bias_grad = torch.ops.sgraph.gelu_bias_grad(dy, pre_activation, "tanh")
    """
    if runs_triton(dy, x):
        return gelu_bias_grad_triton(dy, x, approximate)
    return gelu_bias_grad_reference(dy, x, approximate)


@gelu_bias_grad.register_fake
def _(dy: Tensor, x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(dy, memory_format=torch.contiguous_format), dy.new_empty(dy.shape[1])


def gelu_bias_grad_reference(dy: Tensor, x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """The op in ATen's ops (the CPU path, and the tests' reference)."""
    g = torch.ops.aten.gelu_backward(dy, x, approximate=approximate)
    return g.contiguous(), g.sum(0)


def gelu_bias_grad_triton(dy: Tensor, x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """The op on the Triton kernels (for CPU tensors, in Triton's interpreter: the
    process must start with ``TRITON_INTERPRET=1``)."""
    n_rows, n_cols = dy.shape
    on_gpu = dy.device.type == "cuda"
    kernels = _kernels(not on_gpu)
    g = torch.empty_like(dy, memory_format=torch.contiguous_format)
    bias = dy.new_empty(n_cols)
    if dy.numel() == 0:
        return g, bias.zero_()
    block_n, rows, groups = plan(n_rows, n_cols)
    sums = bias if groups == 1 else torch.empty(groups, n_cols, dtype=torch.float32, device=dy.device)
    flags: dict[str, Any] = {"TANH": approximate == "tanh", "LIBDEVICE": on_gpu}
    with torch.cuda.device(dy.device) if on_gpu else contextlib.nullcontext():  # Triton launches on the current device
        kernels.gelu_bias_grad[(groups, -(-n_cols // block_n))](
            dy, x, g, sums, n_rows, n_cols, **flags, ROWS=rows, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, num_warps=4
        )
        if groups > 1:
            padded = 1 << (groups - 1).bit_length()
            kernels.column_sums[(-(-n_cols // _SUM_BLOCK),)](
                sums, bias, groups, n_cols, GROUPS=padded, BLOCK_G=min(32, padded), BLOCK_N=_SUM_BLOCK, num_warps=4
            )
    return g, bias


@functools.cache
def _kernels(interpret: bool) -> Any:
    """The Triton kernels' module (Triton is imported only now)."""
    if interpret:
        require_interpreter("gelu_bias_grad", " (or use gelu_bias_grad_reference)")
    from . import _gelu_bias_grad_triton

    return _gelu_bias_grad_triton
