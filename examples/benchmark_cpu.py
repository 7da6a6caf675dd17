"""Time one AdamW train step of a small MLP on the CPU: eager PyTorch vs sgraph.

    python examples/benchmark_cpu.py

Workload: 4 x [Linear(256, 256) + GELU] + Linear(256, 10), cross-entropy, batch 64,
fp32. Eager is the usual loop with ``torch.optim.AdamW(foreach=True)``; sgraph runs
the same step as ``sg.static`` (lowered ATen graph, op by op) and as
``sg.static(sg.fuse(step))`` (one generated C++ program). After 20 warm-up steps,
the variants take turns for 5 rounds of 40 steps (so a slow spell of the machine
hits all of them); the median over the 200 timed steps is reported, and the losses
of all three are compared.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from models import mlp

import sgraph as sg

WIDTH, DEPTH, CLASSES, BATCH, STEPS, ROUND, LR = 256, 4, 10, 64, 200, 40, 1e-3


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)
    ]


def eager(data):
    torch.manual_seed(0)
    model = mlp(WIDTH, DEPTH, CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

    def run(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def sgraph_step(data, fuse: bool):
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(mlp(WIDTH, DEPTH, CLASSES))
    opt = sg.optim.adamw(LR, weight_decay=0.01)
    state = [params, opt.init(params)]

    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, buffers, x), y)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    train_step = sg.static(sg.fuse(step) if fuse else step, donate=("params", "opt_state"))

    def run(batch):
        state[0], state[1], loss = train_step(state[0], state[1], batch)
        return loss

    return run


def measure(rows: dict, data) -> dict[str, tuple[float, float, list[float]]]:
    """Per variant: median ms per step, first-call seconds, and the losses of every step."""
    firsts, losses, times = {}, {name: [] for name in rows}, {name: [] for name in rows}
    for name, run in rows.items():
        start = time.perf_counter()
        losses[name].append(run(data[0]).item())
        firsts[name] = time.perf_counter() - start
        losses[name] += [run(batch).item() for batch in data[1:20]]
    for round_start in range(20, len(data), ROUND):
        for name, run in rows.items():
            for batch in data[round_start : round_start + ROUND]:
                start = time.perf_counter()
                loss = run(batch)
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss.item())
    return {name: (statistics.median(times[name]) * 1e3, firsts[name], losses[name]) for name in rows}


def main() -> None:
    data = batches(STEPS + 20)
    rows = {
        "eager, torch.optim.AdamW(foreach=True)": eager(data),
        "sg.static (ATen ops, no graph on CPU)": sgraph_step(data, fuse=False),
        "sg.static(sg.fuse(step)) (generated C++)": sgraph_step(data, fuse=True),
    }
    results = measure(rows, data)
    base_ms, _, base_losses = next(iter(results.values()))
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    print(f"MLP {DEPTH}x{WIDTH}, batch {BATCH}, AdamW, median of {STEPS} steps\n")
    print("| variant | ms per step | speed-up vs eager | first call s | max loss rel. diff vs eager |")
    print("|---|---|---|---|---|")
    for name, (ms, first, losses) in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
        print(f"| {name} | {ms:.3f} | {base_ms / ms:.2f}x | {first:.1f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
