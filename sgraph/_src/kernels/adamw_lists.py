"""AdamW over lists of fp32 leaves whose grads come in their own dtypes, in one Triton
launch per grad dtype.

Under bf16 autocast a weight's gradient leaves its matmul in bf16, and the step casts
it to fp32 for the update, which ATen's fused AdamW takes only with all four tensors
of one dtype: 6 bytes per parameter written and read again before the update reads
4 more. Under ``sg.fuse`` (own kernel ``"adamw"``) the update takes the bf16 gradient
itself (see :mod:`sgraph._src.passes.grad_casts`) and runs this kernel, which reads
it as it is and casts in registers.

The kernel walks a table of the leaves' places (in elements from the first leaf's
tensors, which it takes as pointers) and sizes: each program updates
one chunk of 1024 elements of one leaf, found by a binary search over the leaves'
first chunks, so the whole update is one launch per grad dtype whatever the number of
leaves. The table is copied to the device from pinned host memory, so the copy is
recorded into a CUDA graph being captured and replayed with it (both copies of the
table are then kept as long as the graph: :mod:`sgraph._src.runtime.keepalive`).
On CPU tensors the kernel runs in Triton's interpreter (tests, with
``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
from torch import Tensor

from ..runtime.keepalive import keep_for_replays
from .triton_support import require_interpreter, triton_available

__all__ = ["adamw_lists_", "runs_here"]

# Each program updates one block of 1024 elements with 4 warps: the fastest of a sweep on
# an H200 (docs/results/adamw-lists-2026-12-03-h200.txt; 1.377 ms for gpt-med's update,
# 4.1 TB/s, against 1.460 ms for 4 blocks per program).
_BLOCK = 1024
_ITERS = 1
_WARPS = 4
_CHUNK = _BLOCK * _ITERS
_ALIGN = 16  # bytes: every address a multiple of this, for vector loads and stores
_GRADS = (torch.float32, torch.bfloat16, torch.float16)


def runs_here(params: list[Tensor], grads: list[Tensor], mu: list[Tensor], nu: list[Tensor]) -> bool:
    """Whether :func:`adamw_lists_` takes these leaves (as paired, one dense layout per
    leaf): CUDA tensors with Triton present, fp32 params and moments, fp32 / bf16 / fp16
    grads, every address 16-byte aligned."""
    if not params or params[0].device.type != "cuda" or not triton_available():
        return False
    if any(t.dtype != torch.float32 for t in (*params, *mu, *nu)) or any(g.dtype not in _GRADS for g in grads):
        return False
    return all(t.data_ptr() % _ALIGN == 0 for t in (*params, *grads, *mu, *nu))


def adamw_lists_(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    step: Tensor,
    lr: Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    out: tuple[list[Tensor], list[Tensor], list[Tensor]] | None = None,
) -> None:
    """One AdamW update, as ATen's fused AdamW computes it, for leaves whose four
    tensors share one dense layout (each grad in any of its dtypes), one launch per
    grad dtype.

    Written in place, or with ``out`` (new params, new mu, new nu, each tensor in the
    layout of the one it replaces) into those, the inputs left as they were.

    Example:
        >>> adamw_lists_(params, bf16_grads, mu, nu, step, lr, 0.9, 0.999, 1e-8, 0.01)
        >>> adamw_lists_(params, bf16_grads, mu, nu, step, lr, 0.9, 0.999, 1e-8, 0.01, out=(p2, m2, v2))
    """
    device = params[0].device
    kernel = _kernel(device.type != "cuda")
    lr = lr.to(device, torch.float32)
    step = step.to(device, torch.float32)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(i)
    # Triton launches on the current device
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    for dtype, leaves in by_dtype.items():
        sizes = [params[i].numel() for i in leaves]
        firsts = [0]
        for n in sizes:
            firsts.append(firsts[-1] + -(-n // _CHUNK))
        lists = (params, grads, mu, nu, *out) if out is not None else (params, grads, mu, nu)
        bases = [ts[leaves[0]] for ts in lists]
        table = [(ts[i].data_ptr() - b.data_ptr()) // b.element_size() for ts, b in zip(lists, bases) for i in leaves]
        table += sizes + firsts
        written = bases[4:] if out is not None else [bases[0], bases[2], bases[3]]
        with on_device:
            kernel[(firsts[-1],)](
                *bases[:4],
                *written,
                _on_device(table, device),
                len(leaves),
                lr,
                step,
                b1,
                b2,
                math.log2(b1) if b1 > 0 else -math.inf,
                math.log2(b2) if b2 > 0 else -math.inf,
                eps,
                weight_decay,
                GRAD=_triton_dtype(dtype),
                OUT=out is not None,
                GRAD_ALIGN=_ALIGN // bases[1].element_size(),
                SEARCH=len(leaves).bit_length(),
                BLOCK=_BLOCK,
                ITERS=_ITERS,
                num_warps=_WARPS,
            )


def _on_device(values: list[int], device: torch.device) -> Tensor:
    """``values`` as an int64 tensor on ``device``, copied from pinned host memory (a copy
    a CUDA graph being captured records; both are then kept as long as the graph)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    host = host.pin_memory()
    table = host.to(device, non_blocking=True)
    if torch.cuda.is_current_stream_capturing():
        keep_for_replays(host, table)
    return table


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The Triton kernel (Triton is imported only now)."""
    if interpret:
        require_interpreter("adamw_lists_")
    from ._adamw_triton import adamw_lists

    return adamw_lists
