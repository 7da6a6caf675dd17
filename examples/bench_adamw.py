"""The AdamW update of a benchmark GPT alone, on one GPU: ATen's fused kernel against
sgraph's own (``sg.fuse``'s ``"adamw"`` kernel, which reads bf16 gradients as they are).

    python examples/bench_adamw.py                 # gpt-med's 149 leaves
    python examples/bench_adamw.py --workload gpt-mini

Params and moments in fp32, the weights' gradients in bf16 (as a bf16 autocast step
makes them), the other leaves' in fp32. Rows: ATen's fused AdamW (it needs fp32
gradients), the casts of the weights' gradients to fp32 that it needs (one copy each),
the own kernel on the bf16 gradients, and the same replayed in a CUDA graph. Mean ms
over 20 calls after one warm-up, CUDA events.
"""

from __future__ import annotations

import argparse

import torch
from benchmark import WORKLOADS

from sgraph._src.kernels.adamw_lists import adamw_lists_


def gpt_shapes(workload: str) -> list[tuple[int, ...]]:
    """The parameter shapes of benchmark.py's GPT ``workload``."""
    cfg = WORKLOADS[workload][1]
    d, v = cfg.d, cfg.vocab
    shapes: list[tuple[int, ...]] = [(v, d), (cfg.seq, d)]
    for _ in range(cfg.layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,), (v, d)]


def timed(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt-med", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw.py times GPU kernels and needs a GPU.")
    shapes = gpt_shapes(args.workload)
    params = [torch.randn(s, device="cuda") for s in shapes]
    mu = [torch.zeros(s, device="cuda") for s in shapes]
    nu = [torch.zeros(s, device="cuda") for s in shapes]
    low = [torch.randn(s, device="cuda").to(torch.bfloat16 if len(s) == 2 else torch.float32) for s in shapes]
    full = [g.float() for g in low]
    step, lr = torch.tensor(1.0, device="cuda"), torch.tensor(1e-4, device="cuda")
    hyper = {"beta1": 0.9, "beta2": 0.95, "weight_decay": 0.01, "eps": 1e-8, "amsgrad": False, "maximize": False}

    def aten() -> None:
        torch._fused_adamw_(params, full, mu, nu, [], [step] * len(params), lr=lr, **hyper)

    def casts() -> None:
        for f, g in zip(full, low):
            if g.dtype != torch.float32:
                f.copy_(g)

    def own() -> None:
        adamw_lists_(params, low, mu, nu, step, lr, 0.9, 0.95, 1e-8, 0.01)

    own()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        own()
    n = sum(p.numel() for p in params)
    weights = sum(p.numel() for p in params if p.dim() == 2)
    moved = 28 * n - 2 * weights  # bytes the own kernel moves: bf16 weight gradients
    rows = [
        ("ATen's fused AdamW, fp32 grads", timed(aten), 28 * n),
        ("casts of the weights' bf16 grads to fp32 (one copy each)", timed(casts), 6 * weights),
        ("own kernel, the weights' grads in bf16", timed(own), moved),
        ("own kernel, replayed in a CUDA graph", timed(graph.replay), moved),
    ]
    print(f"{args.workload}: {len(params)} leaves, {n / 1e6:.1f} M parameters; {torch.cuda.get_device_name()}\n")
    print("| update | ms | TB/s |")
    print("|---|---|---|")
    for name, ms, nbytes in rows:
        print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e9:.2f} |")


if __name__ == "__main__":
    main()
