"""A benchmark GPT's MLP (``linear -> tanh GELU -> linear``), forward and backward, on
one GPU: Inductor's code for the ordinary ops against ``sg.fuse``'s ``"gelu_mlp"``
kernel (the GELU and its gradient in cuBLASLt's matmul epilogues).

    python examples/bench_gelu_mlp.py                 # gpt-mini and gpt-med shapes

bf16 tensors as under autocast. Rows: the ordinary ops compiled by Inductor (matmuls on
cuBLAS, GELU, GELU backward and bias-gradient sums generated) and the same with the own
ops, the forward alone and forward + backward; then the two matmuls alone, with and
without their GELU epilogue, and the generated GELU backward the epilogue replaces.
Every row is captured in a CUDA graph of 10 calls and replayed; median ms per call over
20 replays. The last columns give each output's largest error against the same in
float64, relative to that output's largest element.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from sgraph._src.kernels import (
    cublaslt,
    gelu_mlp,  # noqa: F401  (registers the ops)
)

SHAPES = {"gpt-mini": (32 * 256, 512, 2048), "gpt-med": (16 * 1024, 1024, 4096)}
Aten = torch.ops.aten


def ordinary(x, w1, b1, w2, b2, dy):  # type: ignore[no-untyped-def]
    """The MLP's forward and backward as the traced step has them."""
    h = torch.addmm(b1, x, w1.t())
    g = F.gelu(h, approximate="tanh")
    y = torch.addmm(b2, g, w2.t())
    dh = Aten.gelu_backward(torch.mm(dy, w2), h, approximate="tanh")
    return y, torch.mm(dh, w1), torch.mm(dh.t(), x), dh.sum(0), torch.mm(dy.t(), g), dy.sum(0)


def own(x, w1, b1, w2, b2, dy):  # type: ignore[no-untyped-def]
    """The same with the own ops, as the traced step has them under sg.fuse."""
    g, h = torch.ops.sgraph.gelu_linear(x, w1, b1)
    y = torch.addmm(b2, g, w2.t())
    dh = torch.ops.sgraph.gelu_linear_backward(dy, w2, h)
    return y, torch.mm(dh, w1), torch.mm(dh.t(), x), dh.sum(0), torch.mm(dy.t(), g), dy.sum(0)


def ordinary_forward(x, w1, b1, w2, b2, dy):  # type: ignore[no-untyped-def]
    return (torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1.t()), approximate="tanh"), w2.t()),)


def own_forward(x, w1, b1, w2, b2, dy):  # type: ignore[no-untyped-def]
    return (torch.addmm(b2, torch.ops.sgraph.gelu_linear(x, w1, b1)[0], w2.t()),)


def pieces(x, w1, b1, w2, b2, dy):  # type: ignore[no-untyped-def]
    """The matmuls alone, with and without the epilogue, and the kernel it replaces."""
    h = torch.addmm(b1, x, w1.t())
    generated = torch.compile(lambda dg, h: Aten.gelu_backward(dg, h, approximate="tanh"))
    return [
        ("  addmm: x @ W1.T + b1", lambda: torch.addmm(b1, x, w1.t())),
        ("  the same with GELU_AUX_BIAS", lambda: cublaslt.gelu_matmul(x, w1, b1)),
        ("  mm: dy @ W2", lambda: torch.mm(dy, w2)),
        ("  the same with DGELU", lambda: cublaslt.dgelu_matmul(dy, w2, h)),
        ("  Inductor's gelu_backward after the mm", lambda: generated(torch.mm(dy, w2), h)),
    ]


def graphed_ms(fn, args, calls: int = 10, replays: int = 20) -> tuple[float, tuple]:  # type: ignore[no-untyped-def]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn(*args)
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    return statistics.median(times), out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gelu_mlp.py times GPU kernels and needs a GPU.")
    torch.manual_seed(0)
    names = ("y", "dx", "dW1", "db1", "dW2", "db2")
    print(f"{'shape':>9} {'variant':<34} {'ms':>7}  max error / max |value| per output ({', '.join(names)})")
    for workload, (n, k, m) in SHAPES.items():
        args = [
            torch.randn(n, k),
            torch.randn(m, k) / k**0.5,
            torch.randn(m) * 0.1,
            torch.randn(k, m) / m**0.5,
            torch.randn(k) * 0.1,
            torch.randn(n, k) / n**0.5,
        ]
        exact = ordinary(*(a.cuda().double() for a in args))
        low = [a.cuda().bfloat16() for a in args]
        for label, fn in (
            ("Inductor, forward", ordinary_forward),
            ("own kernel, forward", own_forward),
            ("Inductor, forward + backward", ordinary),
            ("own kernel, forward + backward", own),
        ):
            ms, out = graphed_ms(torch.compile(fn, fullgraph=True), low)
            errors = [((o.double() - e).abs().max() / e.abs().max()).item() for o, e in zip(out, exact)]
            print(f"{workload:>9} {label:<42} {ms:7.3f}  " + " ".join(f"{x:.1e}" for x in errors), flush=True)
        for label, fn in pieces(*low):
            ms, _ = graphed_ms(fn, [])
            print(f"{workload:>9} {label:<42} {ms:7.3f}", flush=True)


if __name__ == "__main__":
    main()
