"""The benchmark GPTs' chunked linear + cross-entropy on one GPU: each of its two
choices against the other way.

    python examples/bench_cross_entropy.py             # gpt-mini and gpt-med shapes

bf16 tensors as under autocast. For each workload's shape (rows = batch x sequence,
width, vocabulary):

- the rows kernel on one chunk of logits, at the launch shape sgraph picks and at the
  others of the sweep it was picked from (columns per step, warps per row);
- the whole ``sgraph::linear_cross_entropy`` op (loss, ``grad_x`` and ``grad_W``),
  with each chunk's ``grad_W`` product added into the fp32 sum by the matmul
  (``addmm(..., out_dtype=float32)``), against a bf16 product added by a second kernel.

Each row is captured in a CUDA graph of 5 calls and replayed; median ms per call over
10 replays. Errors are the largest against float64, relative to the largest element.
"""

from __future__ import annotations

import functools

import torch
from bench_gelu_mlp import graphed_ms

from sgraph._src.kernels import cross_entropy_rows as rows_module
from sgraph._src.kernels import linear_cross_entropy as lce

SHAPES = {"gpt-mini": (32 * 256, 512, 8192), "gpt-med": (16 * 1024, 1024, 32768)}


def per_call_ms(fn) -> float:  # type: ignore[no-untyped-def]
    return graphed_ms(fn, (), calls=5, replays=10)[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def rows_kernel(z: torch.Tensor, y: torch.Tensor) -> None:
    """The rows kernel on one chunk of logits ``z`` (targets ``y``) at the launch shape
    sgraph picks, and at each other shape of the sweep that picked it."""
    from sgraph._src.kernels._cross_entropy_triton import cross_entropy_rows

    exact = torch.softmax(z.double(), 1)
    exact[torch.arange(z.shape[0]), y] -= 1
    scale = torch.ones(1, device="cuda")
    work, losses = torch.empty_like(z), torch.empty(z.shape[0], device="cuda")
    rows, classes = z.shape
    chosen = rows_module.launch(classes)

    def call(block: int, warps: int) -> None:
        work.copy_(z)
        cross_entropy_rows[(rows,)](work, classes, y, losses, scale, classes, -100, 0.0, BLOCK=block, num_warps=warps)

    copy_ms = per_call_ms(lambda: work.copy_(z))
    rows_module.cross_entropy_rows_(work.copy_(z), y, scale, -100, 0.0)
    print(
        f"| rows kernel at {chosen} (columns, warps), less the copy it works on | "
        f"{per_call_ms(lambda: call(*chosen)) - copy_ms:.3f} | {relative(work, exact):.2e} |"
    )
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if (block, warps) != chosen and block <= classes:
                ms = per_call_ms(functools.partial(call, block, warps)) - copy_ms
                print(f"| ... at ({block}, {warps}) | {ms:.3f} | |")


def whole_op(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """The op with each chunk's ``grad_W`` summed by the matmul and by an add."""
    logits = x.double() @ w.double().t()
    p = torch.softmax(logits, -1)
    p[torch.arange(x.shape[0]), y] -= 1
    exact_gw = (p / x.shape[0]).t() @ x.double()
    del logits, p

    def call():  # type: ignore[no-untyped-def]
        return torch.ops.sgraph.linear_cross_entropy(x, w, y, -100, 0.0, True)

    setting = lce._ADDMM_OUT_DTYPE
    for label, into_fp32 in (("op, grad_W summed by the matmul", True), ("op, grad_W summed by an add", False)):
        lce._ADDMM_OUT_DTYPE = setting and into_fp32
        error = relative(call()[2], exact_gw)
        print(f"| {label} | {per_call_ms(call):.3f} | {error:.2e} (grad_W) |")
    lce._ADDMM_OUT_DTYPE = setting


def main() -> None:
    for name, (rows, width, vocab) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
        w = (torch.randn(vocab, width, device="cuda", generator=g) / width**0.5).bfloat16()
        y = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        chunk = lce.chunk_rows(rows, vocab)
        print(f"\n### {name}: {rows} rows, width {width}, {vocab} classes, chunks of {chunk} rows\n")
        print("| | ms per call | largest error |")
        print("|---|---|---|")
        rows_kernel((x[:chunk] @ w.t()).contiguous(), y[:chunk])
        whole_op(x, w, y)


if __name__ == "__main__":
    main()
