"""Whole-step parity of sg.static + sg.fuse against the same step run eagerly, on the
benchmark's workloads (GPU).

    python examples/fuse_parity.py                      # all three workloads
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
import copy

import torch
from benchmark import LR, WEIGHT_DECAY, WORKLOADS, build

import sgraph as sg

TARGET = {"fp32": 1e-5, "bf16": 1e-2}


def losses(workload: str, precision: str, steps: int) -> tuple[list[float], list[float]]:
    model, batch, loss = build(workload)
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(LR, weight_decay=WEIGHT_DECAY)

    def loss_fn(params, batch):
        x, y = batch
        cast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with cast:
            logits = apply(params, buffers, x)
        return loss(logits, y)

    def step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, value

    fused = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    mine = [{k: v.clone() for k, v in params.items()}, None]
    mine[1] = opt.init(mine[0])
    ref = [copy.deepcopy(mine[0]), None]
    ref[1] = opt.init(ref[0])
    a, b = [], []
    for _ in range(steps):
        batch = fresh(batch)
        mine[0], mine[1], value = fused(mine[0], mine[1], batch)
        ref[0], ref[1], ref_value = step(ref[0], ref[1], batch)
        a.append(value.item())
        b.append(ref_value.item())
    return a, b


def fresh(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A new random batch like ``batch``: same shapes, dtypes and label range."""
    x, y = batch
    high = int(y.max()) + 1
    new_x = torch.randint_like(x, 0, high) if not x.is_floating_point() else torch.randn_like(x)
    return new_x, torch.randint_like(y, 0, high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
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
