"""ATen's multi-tensor copy against a ``copy_`` per tensor, by size and count, on a GPU:
the rule of ``sgraph._src.runtime.eager.copy_lists`` (GPU us per call and launches,
from torch.profiler).

    python examples/bench_copies.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def gpu_us(f: Callable[[], object], n: int = 50) -> tuple[float, float]:
    """GPU us per call of ``f`` and its launches per call."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            f()
        torch.cuda.synchronize()
    events = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in events) / n, len(events) / n


def main() -> None:
    print("dtype numel count | foreach us (launches) | copy_ each us (launches)")
    for dtype in (torch.float32, torch.int64):
        for numel in (256, 1024, 4096, 8192, 16384, 65536, 262144):
            for count in (1, 2, 8):
                src = [torch.ones(numel, device="cuda", dtype=dtype) for _ in range(count)]
                dst = [torch.empty_like(s) for s in src]
                a = gpu_us(lambda dst=dst, src=src: torch._foreach_copy_(dst, src))
                b = gpu_us(lambda dst=dst, src=src: [d.copy_(s) for d, s in zip(dst, src)])
                print(f"{str(dtype)[6:]} {numel} {count} | {a[0]:.2f} ({a[1]:.0f}) | {b[0]:.2f} ({b[1]:.0f})")


if __name__ == "__main__":
    main()
