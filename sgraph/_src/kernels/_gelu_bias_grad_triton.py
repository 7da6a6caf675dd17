"""The Triton kernels of :mod:`gelu_bias_grad`, imported only when they run (Triton is
optional on CPU). In a process started with ``TRITON_INTERPRET=1`` they run in
Triton's interpreter, on CPU tensors too."""

# mypy: ignore-errors
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _tanh(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        t = libdevice.tanh(z)
    else:
        # Triton's interpreter has no libdevice: the same function from its series near 0
        # and from exp elsewhere (each within a few fp32 roundings there)
        a = tl.abs(z)
        z2 = z * z
        series = z * (1.0 + z2 * (-1.0 / 3 + z2 * (2.0 / 15 + z2 * (-17.0 / 315 + z2 * (62.0 / 2835)))))
        far = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(a, 10.0)) + 1.0)  # +-1 in fp32 beyond |z| = 10
        t = tl.where(a < 0.3, series, tl.where(z < 0, -far, far))
    return t


@triton.jit
def _gelu_backward(dy, x, TANH: tl.constexpr, LIBDEVICE: tl.constexpr):
    """ATen's ``gelu_backward`` in fp32, in the order its CUDA kernel computes it."""
    if TANH:
        beta = 0.7978845608028654  # sqrt(2 / pi)
        kappa = 0.044715
        x_sq = x * x
        inner = beta * (x + kappa * (x_sq * x))
        t = _tanh(inner, LIBDEVICE)
        left = 0.5 * x
        right = 1.0 + t
        right_derivative = left * (1.0 - t * t) * (beta * (1.0 + 3.0 * kappa * x_sq))
        g = dy * (0.5 * right + right_derivative)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * x * x)
        g = dy * (cdf + x * pdf)
    return g


@triton.jit
def gelu_bias_grad(
    dy_ptr,
    x_ptr,
    dx_ptr,
    sums_ptr,
    n_rows,
    n_cols,
    TANH: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: ``ROWS`` rows of a block of ``BLOCK_N`` columns. Writes ``dx`` and
    the columns' sums of the rounded ``dx`` over those rows (fp32, or already in
    ``sums_ptr``'s dtype where one group of rows covers them all)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n_cols
    total = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, ROWS, BLOCK_M):
        rows = group * ROWS + start + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & in_cols[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = _gelu_backward(dy, x, TANH, LIBDEVICE).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offsets, dx, mask=mask)
        total += tl.sum(tl.where(mask, dx.to(tl.float32), 0.0), axis=0)
    tl.store(sums_ptr + group * n_cols + cols, total.to(sums_ptr.dtype.element_ty), mask=in_cols)


@triton.jit
def column_sums(
    partial_ptr, out_ptr, n_groups, n_cols, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr
):
    """``out[c] = sum(partial[:, c])`` over ``n_groups`` fp32 rows, in ``out``'s dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n_cols
    total = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, GROUPS, BLOCK_G):
        groups = start + tl.arange(0, BLOCK_G)
        mask = (groups < n_groups)[:, None] & in_cols[None, :]
        total += tl.sum(tl.load(partial_ptr + groups[:, None] * n_cols + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=in_cols)
