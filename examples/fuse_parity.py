"""Whole-step parity of sg.static + sg.fuse against the same step run eagerly, on the
benchmark's workloads (GPU).

    python examples/fuse_parity.py                      # the three anchored workloads
    python examples/fuse_parity.py --workloads llama-mini resnet-small
    python examples/fuse_parity.py --workloads gpt-mini

For each workload: fp32 (no autocast) over 50 steps, and bf16 autocast over 100
steps, both with AdamW, each step on a fresh random batch of the benchmark's shapes
(so the loss stays away from zero, where relative differences mean nothing). The eager run calls the very
step function sg.fuse compiles, op by op. Prints the largest relative difference of
the losses per run, against the targets 1e-5 (fp32) and 1e-2 (bf16).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from benchmark import ANCHORED, WORKLOADS, build, functional_step

import sgraph as sg

TARGET = {"fp32": 1e-5, "bf16": 1e-2}


def losses(workload: str, precision: str, steps: int) -> tuple[list[float], list[float]]:
    model, batch, loss = build(workload)
    cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    step, state, names = functional_step(model, loss, cast)
    fused = sg.static(sg.fuse(step), donate=names)
    mine = sg.tree.map(torch.clone, state)
    ref = sg.tree.map(torch.clone, state)
    a, b = [], []
    for _ in range(steps):
        batch = fresh(batch)
        *mine, metrics = fused(*mine, batch)
        *ref, ref_metrics = step(*ref, batch)
        a.append(metrics["loss"].item())
        b.append(ref_metrics["loss"].item())
    return a, b


def fresh(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A new random batch like ``batch``: same shapes, dtypes and label range."""
    x, y = batch
    high = int(y.max()) + 1
    new_x = torch.randint_like(x, 0, high) if not x.is_floating_point() else torch.randn_like(x)
    return new_x, torch.randint_like(y, 0, high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=ANCHORED, choices=list(WORKLOADS))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here, convolutions included
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for workload in args.workloads:
        for precision, steps in (("fp32", 50), ("bf16", 100)):
            a, b = losses(workload, precision, steps)
            worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
            rows.append((workload, precision, steps, b[0], b[-1], worst))
            print(rows[-1], flush=True)
            torch._dynamo.reset()
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}\n")
    print("| workload | precision | steps | eager loss first -> last | max rel. diff of losses | target | met |")
    print("|---|---|---|---|---|---|---|")
    for workload, precision, steps, first, last, worst in rows:
        met = "yes" if worst <= TARGET[precision] else "no"
        print(
            f"| {workload} | {precision} | {steps} | {first:.4f} -> {last:.4f} | {worst:.1e} | "
            f"{TARGET[precision]:g} | {met} |"
        )


if __name__ == "__main__":
    main()
