"""Where a step's GPU time goes: the top kernels of sg.static with and without sg.fuse.

    python examples/profile_step.py --workloads gpt-med --top 15

Builds the benchmark's workloads (see benchmark.py), replays each compiled step a
few times under torch.profiler and prints, per variant, the kernels that take the
most GPU time per step, with their launches per step and, for generated kernels, the
step's ATen ops each one computes (from ``Compiled.as_text()``). Before each table: the
step's wall time from CUDA events (outside the profiler), the GPU time its kernels
take, the difference (the GPU idle between kernels), and that time by kind of kernel.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict

import torch
from benchmark import ANCHORED, VARIANTS, WORKLOADS, event_times
from torch.profiler import ProfilerActivity, profile

STEPS = 5


_LISTED = re.compile(r"^\s+#\d+ (\S+)(?: \(\d+ kernels\))?: (.*)$")
_IN_BLOCK = re.compile(r"^\s+(\w+)\.(\d+) (\S+)$")


def kernel_ops(text: str) -> dict[str, str]:
    """Kernel name -> the ATen ops it computes, read from the kernel list that ends
    ``Compiled.as_text()`` under ``sg.fuse`` (a kernel called more than once: its first
    call); a kernel of a repeated block's code -> the block and its place there (the
    listing names no ops for those)."""
    start = text.find("kernels (")
    found: dict[str, str] = {}
    for line in text[start:].splitlines()[1:] if start >= 0 else ():
        match = _LISTED.match(line)
        if match is not None:
            found.setdefault(match.group(1), match.group(2))
        elif (inside := _IN_BLOCK.match(line)) is not None:
            found.setdefault(inside.group(3), f"(call {inside.group(2)} of block code {inside.group(1)})")
    return found


KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("attention", re.compile(r"sdpa|flash|fmha|attention|cudnn::fusion")),
    ("convolution", re.compile(r"fprop|dgrad|wgrad|conv|nchwToNhwc|nhwcToNchw|cudnn", re.IGNORECASE)),
    ("matmul", re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|splitK|Kernel2")),
    ("own kernels", re.compile(r"^(adamw_lists|cross_entropy_rows|_?adamw)")),
    ("generated", re.compile(r"^triton_")),
    ("ATen", re.compile(r"at::native|at_cuda_detail|void at::")),
]


LISTINGS: dict[str, str] = {}  # "workload variant" -> Compiled.as_text() of its step


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_table(workload: str, variant: str) -> tuple[float, float, list[tuple[str, float, float]], dict[str, str]]:
    """Wall ms per step; GPU ms per step in total; (kernel, ms per step, launches per
    step), most time first; and, under sg.fuse, the ATen ops of each generated kernel."""
    run = VARIANTS[variant][1](workload)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    wall = statistics.median(event_times(run, 20))  # as benchmark.py times a step
    step = getattr(run, "step", None)  # compiled by the first call: its kernel list is there now
    listing = step.last_compiled.as_text() if step is not None else ""
    ops = kernel_ops(listing)
    LISTINGS[f"{workload} {variant}"] = listing
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
    return wall, sum(time.values()), rows, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=ANCHORED, choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=["sg-static", "sg-fuse"], choices=list(VARIANTS))
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", help="also write every kernel's row, per workload and variant, here")
    parser.add_argument("--listing", help="write each as_text() to LISTING-<workload>-<variant>.txt")
    args = parser.parse_args()
    everything: dict[str, dict] = {}
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for workload in args.workloads:
        for variant in args.variants:
            wall, total, rows, ops = kernel_table(workload, variant)
            launches = sum(r[2] for r in rows)
            print(f"\n### {workload}, {VARIANTS[variant][0]}: {total:.3f} GPU ms per step, {launches:.0f} kernels\n")
            by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for name, ms, n in rows:
                by_kind[kind_of(name)][0] += ms
                by_kind[kind_of(name)][1] += n
            kinds = ", ".join(f"{k} {ms:.3f} ({n:g})" for k, (ms, n) in sorted(by_kind.items(), key=lambda i: -i[1][0]))
            print(f"wall {wall:.3f} ms per step; kernels busy {total:.3f}; idle {wall - total:.3f}")
            print(f"by kind, ms (launches): {kinds}\n")
            everything[f"{workload} {variant}"] = {
                "wall_ms": wall,
                "gpu_ms": total,
                "kernels": [{"name": k, "ms": ms, "launches": n, "ops": ops.get(k, "")} for k, ms, n in rows],
            }
            print("| kernel | ms per step | % | launches per step | ATen ops (generated kernels) |")
            print("|---|---|---|---|---|")
            for name, ms, n in rows[: args.top]:
                computes = ops.get(name, "")[:100]
                print(f"| `{name[:90]}` | {ms:.3f} | {100 * ms / total:.1f} | {n:g} | {computes} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    for key, text in LISTINGS.items() if args.listing else ():
        with open(f"{args.listing}-{key.replace(' ', '-')}.txt", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
