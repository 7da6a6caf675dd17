"""How far resnet-small's training drifts from the plain eager step when only the
convolutions' rounding changes, next to how far sg.static and sg.fuse drift (GPU, fp32).

    python examples/resnet_drift.py

fp32 with TF32 off for matmuls and cuDNN; 50 AdamW steps on 50 fixed random batches.
Every row is compared with the plain eager step (cudnn.benchmark off): the eager step
with cudnn.benchmark on (other convolution algorithms), sg.static, sg.static + sg.fuse.
Prints the relative loss difference at steps 1, 2, 5, 10, 20 and 50, and the largest
param difference after 50 steps relative to the param's largest element.
"""

from __future__ import annotations

import contextlib

import torch
from benchmark import build, functional_step

import sgraph as sg


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, (x, y), loss = build("resnet-small")
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (torch.randn(x.shape, device="cuda", generator=g), torch.randint(0, 10, y.shape, device="cuda", generator=g))
        for _ in range(50)
    ]
    step, state, names = functional_step(model, loss, contextlib.nullcontext)

    def run(f, benchmark: bool = False):
        torch.backends.cudnn.benchmark = benchmark
        s = sg.tree.map(torch.clone, state)
        out = []
        for b in batches:
            *s, m = f(*s, b)
            out.append(m["loss"].item())
        torch.backends.cudnn.benchmark = False
        return out, s

    base, base_state = run(step)
    rows = {
        "eager, cudnn.benchmark": run(step, True),
        "sg.static": run(sg.static(step, donate=names)),
        "sg.static+sg.fuse": run(sg.static(sg.fuse(step), donate=names)),
    }
    for name, (values, s) in rows.items():
        d = [abs(p - q) / abs(q) for p, q in zip(values, base)]
        params = max(
            float((u - v).abs().max() / (v.abs().max() + 1e-12))
            for u, v in zip(sg.tree.leaves(s[0]), sg.tree.leaves(base_state[0]))
        )
        steps = " ".join(f"{d[i]:.1e}" for i in (0, 1, 4, 9, 19, 49))
        print(f"{name}: rel loss diff at steps 1,2,5,10,20,50: {steps}; params after 50 {params:.1e}")


if __name__ == "__main__":
    main()
