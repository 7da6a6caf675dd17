"""Which rounding of AdamW's hyperparameters ATen's fused kernel uses on each device, and how
close sgraph's generated update (``kernels/adamw.py``, ``_updated``) comes to it, eagerly and
through Inductor: median relative errors of the new params and moments.

Run: ``python examples/probe_adamw_rounding.py`` (CPU, and CUDA where there is a GPU).
"""

import struct

import torch


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def aten(device, p, g, m, v, t, lr, b1, b2, wd, eps):
    p, g, m, v = (x.to(device).clone() for x in (p, g, m, v))
    torch._fused_adamw_(
        [p],
        [g],
        [m],
        [v],
        [],
        [torch.tensor(float(t), device=device)],
        lr=torch.tensor(lr, device=device),
        beta1=b1,
        beta2=b2,
        weight_decay=wd,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
    return [x.cpu().double() for x in (p, m, v)]


def formula(p, g, m, v, t, lr, b1, b2, wd, eps, betas, powers):
    p, g, m, v = (x.double() for x in (p, g, m, v))
    B1, B2 = (f32(b1), f32(b2)) if betas == "f32" else (b1, b2)
    P1, P2 = (f32(b1), f32(b2)) if powers == "f32" else (b1, b2)
    p = p - lr * wd * p
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    bc1 = 1 - P1**t
    bc2 = 1 - P2**t
    p = p - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
    return p, m, v


def report(label, errs):
    print(f"{label} median rel err p {errs[0]:.2e} m {errs[1]:.2e} v {errs[2]:.2e}")


gen = torch.Generator().manual_seed(0)
n = 1 << 14
p = torch.randn(n, generator=gen) * 1e-3
g = torch.randn(n, generator=gen)
m = torch.randn(n, generator=gen) * 0.1
v = torch.rand(n, generator=gen) * 0.01 + 1e-3
args = dict(t=3, lr=1.0, b1=0.9, b2=0.999, wd=0.1, eps=1e-8)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for dev in devices:
    got = aten(dev, p, g, m, v, **args)
    for betas in ("exact", "f32"):
        for powers in ("exact", "f32"):
            want = formula(p, g, m, v, betas=betas, powers=powers, **args)
            errs = [((a - b).abs() / b.abs().clamp_min(1e-30)).median().item() for a, b in zip(got, want)]
            report(f"{dev:4s} betas={betas:5s} powers={powers:5s}", errs)

from sgraph._src.kernels.adamw import _updated  # noqa: E402


def ours(dev, compiled):
    fn = torch.compile(_updated, fullgraph=True) if compiled else _updated
    leaves = [tuple(x.to(dev).clone() for x in (p, g, m, v))]
    step = torch.tensor(float(args["t"]), device=dev)
    lr = torch.tensor(args["lr"], device=dev)
    ((p2, m2, v2),) = fn(leaves, step, lr, args["b1"], args["b2"], args["eps"], args["wd"])
    return [x.cpu().double() for x in (p2, m2, v2)]


for dev in devices:
    want = aten(dev, p, g, m, v, **args)
    for compiled in (False, True):
        got = ours(dev, compiled)
        errs = [((a - b).abs() / b.abs().clamp_min(1e-30)).median().item() for a, b in zip(got, want)]
        report(f"{dev:4s} _updated {'inductor' if compiled else 'eager   '} vs ATen:", errs)
