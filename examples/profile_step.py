"""Where a step's GPU time goes: the top kernels of sg.static with and without sg.fuse.

    python examples/profile_step.py --workloads gpt-med --top 15

Builds the benchmark's workloads (see benchmark.py), replays each compiled step a
few times under torch.profiler and prints, per variant, the kernels that take the
most GPU time per step, with their launches per step and, for generated kernels, the
step's ATen ops each one computes (from ``Compiled.as_text()``).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
from benchmark import VARIANTS, WORKLOADS
from torch.profiler import ProfilerActivity, profile

STEPS = 5


_LISTED = re.compile(r"^\s+#\d+ (\S+)(?: \(\d+ kernels\))?: (.*)$")


def kernel_ops(text: str) -> dict[str, str]:
    """Kernel name -> the ATen ops it computes, read from the kernel list that ends
    ``Compiled.as_text()`` under ``sg.fuse`` (a kernel called more than once: its first call)."""
    start = text.find("kernels (")
    found: dict[str, str] = {}
    for line in text[start:].splitlines()[1:] if start >= 0 else ():
        match = _LISTED.match(line)
        if match is not None:
            found.setdefault(match.group(1), match.group(2))
    return found


def kernel_table(workload: str, variant: str) -> tuple[float, list[tuple[str, float, float]], dict[str, str]]:
    """GPU ms per step in total; (kernel, ms per step, launches per step), most time first;
    and, under sg.fuse, the ATen ops of each generated kernel."""
    run = VARIANTS[variant][1](workload)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    step = getattr(run, "step", None)  # compiled by the first call: its kernel list is there now
    ops = kernel_ops(step.last_compiled.as_text()) if step is not None else {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            run()
        torch.cuda.synchronize()
    time: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            time[event.name] += event.device_time_total / 1e3 / STEPS
            count[event.name] += 1
    rows = sorted(((k, time[k], count[k] / STEPS) for k in time), key=lambda r: -r[1])
    del run
    torch._dynamo.reset()
    return sum(time.values()), rows, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=["sg-static", "sg-fuse"], choices=list(VARIANTS))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for workload in args.workloads:
        for variant in args.variants:
            total, rows, ops = kernel_table(workload, variant)
            launches = sum(r[2] for r in rows)
            print(f"\n### {workload}, {VARIANTS[variant][0]}: {total:.3f} GPU ms per step, {launches:.0f} kernels\n")
            print("| kernel | ms per step | % | launches per step | ATen ops (generated kernels) |")
            print("|---|---|---|---|---|")
            for name, ms, n in rows[: args.top]:
                computes = ops.get(name, "")[:100]
                print(f"| `{name[:90]}` | {ms:.3f} | {100 * ms / total:.1f} | {n:g} | {computes} |")


if __name__ == "__main__":
    main()
