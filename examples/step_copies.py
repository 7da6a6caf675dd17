"""The copies a compiled step makes outside its CUDA graph (the batch into the graph's
static buffers), on a GPU: each workload's wall ms per step, its copy kernels per step,
and the GPU time of ``copy_lists`` on its static buffers against a ``copy_`` per tensor.

    python examples/step_copies.py
"""

from __future__ import annotations

import statistics

import torch
from bench_copies import gpu_us
from benchmark import VARIANTS, event_times
from torch.profiler import ProfilerActivity, profile

from sgraph._src.runtime.eager import copy_lists

STEPS = 5


def static_buffers(compiled: object) -> list[torch.Tensor] | None:
    """The CUDA graph's static input buffers, found on the compiled step or one level below."""
    for value in vars(compiled).values():
        for candidate in (value, *getattr(value, "__dict__", {}).values()):
            if hasattr(candidate, "static_buffers"):
                return candidate.static_buffers
    return None


def main() -> None:
    for workload in ("mlp-small", "gpt-mini"):
        run = VARIANTS["sg-fuse"][1](workload)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        print(workload, "wall ms", statistics.median(event_times(run, 50)))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                run()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA and ("multi_tensor" in e.key or "copy" in e.key.lower()):
                print(f"  {e.count / STEPS:.0f}/step {e.device_time_total / STEPS:.1f} us/step  {e.key[:160]}")
        buffers = static_buffers(run.step.last_compiled)  # type: ignore[attr-defined]
        if buffers is None:
            print("  no CUDA graph's static buffers found")
            continue
        print("  static inputs:", [(tuple(b.shape), str(b.dtype)) for b in buffers])
        sources = [b.clone() for b in buffers]
        lists = gpu_us(lambda buffers=buffers, sources=sources: copy_lists(buffers, sources))[0]
        print(f"  copy_lists: {lists:.2f} us GPU per call")
        each = gpu_us(lambda buffers=buffers, sources=sources: [b.copy_(s) for b, s in zip(buffers, sources)])[0]
        print(f"  copy_ each: {each:.2f} us GPU per call")
        del run


if __name__ == "__main__":
    main()
