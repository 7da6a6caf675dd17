"""AdamW over whole lists of tensors in one fused kernel, as two custom ops.

``sgraph::adamw`` is the functional form the optimizer calls: it returns new params
and moments and leaves its inputs alone, so a traced step stays functional.
``sgraph::adamw_`` updates params and moments in place; the reinplace pass swaps it
in when those inputs are donated, so the whole update is one pass over memory.
Both run ATen's fused AdamW kernel (``torch._fused_adamw_``), on CPU and CUDA; under
``sg.fuse`` both are lowered by Inductor instead, through :func:`decompositions`, or
(more leaves) take low-precision gradients as they are: fp32 params with bf16 / fp16
grads run sgraph's own multi-tensor Triton kernel on CUDA (:mod:`.adamw_lists`), and
ATen's after casting the grads elsewhere.

That kernel pairs the k-th element of each leaf's param, grad and moments by
position in memory, which is the same element only when the four tensors have one
size and one stride and cover their memory densely. A leaf where they do not (a
channels-last grad of a contiguous conv weight, a transposed or sliced param, a
state in another layout than its param) is copied into its param's layout (a dense
one, for a param that is a strided view) before the kernel and written back after.
The check runs on the real tensors at every call, so it holds whatever strides a
traced graph's intermediates turn out to have; leaves already in one layout (the
common case: moments from ``init``, grads laid out like the params) are not copied.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import cast

import torch
import torch.fx
from torch import Tensor

from ..errors import ArgumentError
from . import adamw_lists

__all__ = [
    "GENERATED_LEAVES",
    "INPLACE_FORMS",
    "adamw",
    "adamw_",
    "decompositions",
    "fusable",
    "leaves_updated",
    "update_leaves",
    "written_lists",
]

_DTYPES = (torch.float32,)
_NAMES = ("params", "grads", "mu", "nu")

Leaf = tuple[Tensor, Tensor, Tensor, Tensor]
"""One leaf's ``(param, grad, mu, nu)``."""


def fusable(tensors: list[Tensor]) -> bool:
    """Whether the fused path suits these leaves: float32 tensors on one CPU or CUDA
    device. Low-precision params keep the foreach path: an update returned as
    ``new_p - p`` in bf16 would lose what the fused kernel gained. DTensors keep it too."""
    if not tensors:
        return False
    device = tensors[0].device
    return device.type in ("cpu", "cuda") and all(
        t.device == device and t.dtype in _DTYPES and type(t).__name__ != "DTensor" for t in tensors
    )


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its memory, each once (contiguous checked first: it is cheap)."""
    return t.is_contiguous() or bool(torch.ops.aten.is_non_overlapping_and_dense.default(t))


def _aligned(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> bool:
    """Whether the fused kernel pairs this leaf's elements correctly as they are."""
    same_shape = p.shape == g.shape == m.shape == v.shape
    return same_shape and p.stride() == g.stride() == m.stride() == v.stride() and _dense(p)


def _check_shapes(index: int, leaf: Leaf) -> None:
    p = leaf[0]
    for name, t in zip(_NAMES[1:], leaf[1:]):
        if t.shape != p.shape:
            raise ArgumentError(
                f"sgraph::adamw: {name}[{index}] has shape {tuple(t.shape)}, but params[{index}] has shape "
                f"{tuple(p.shape)}. Pass one grad and one pair of moments per param, each of the param's shape."
            )


def _in_one_layout(leaf: Leaf) -> tuple[Leaf, list[tuple[Tensor, Tensor]]]:
    """The leaf's tensors in its param's layout (a dense one for a strided view), and the
    ``(tensor, copy)`` pairs of param and moments to copy back after the update."""
    p = leaf[0]
    like = p if _dense(p) else torch.empty_like(p)
    p2, g2, m2, v2 = (t if t.stride() == like.stride() else torch.empty_like(like).copy_(t) for t in leaf)
    written = [(t, c) for t, c in ((p, p2), (leaf[2], m2), (leaf[3], v2)) if c is not t]
    return (p2, g2, m2, v2), written


def _paired(
    params: list[Tensor], grads: list[Tensor], mu: list[Tensor], nu: list[Tensor]
) -> tuple[list[list[Tensor]], list[tuple[Tensor, Tensor]]]:
    """The four lists, every leaf in one dense layout, and ``(tensor, copy)`` pairs to write back."""
    lists: list[list[Tensor]] = [[], [], [], []]
    written: list[tuple[Tensor, Tensor]] = []
    for i, leaf in enumerate(zip(params, grads, mu, nu)):
        if not _aligned(*leaf):
            _check_shapes(i, leaf)
            leaf, copies = _in_one_layout(leaf)
            written += copies
        for out, t in zip(lists, leaf):
            out.append(t)
    return lists, written


@torch.library.custom_op("sgraph::adamw_", mutates_args=("params", "mu", "nu"))
def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    step: Tensor,
    lr: Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place, for any layouts of the four lists' tensors. ``step``
    is the update number t (1, 2, ...), ``lr`` a 0-dim tensor; both may change between
    calls without recompiling."""
    (p, g, m, v), written = _paired(params, grads, mu, nu)
    if _takes_own_kernel(p, g, m, v):
        adamw_lists.adamw_lists_(p, g, m, v, step, lr, b1, b2, eps, weight_decay)
        _write_back(written)
        return
    if any(gi.dtype != pi.dtype for gi, pi in zip(g, p)):
        g = [gi.to(pi.dtype) for gi, pi in zip(g, p)]  # ATen's kernel takes one dtype
    torch._fused_adamw_(
        p,
        g,
        m,
        v,
        [],
        [step.to(torch.float32)] * len(p),
        lr=lr.to(p[0].device, torch.float32),
        beta1=b1,
        beta2=b2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
    _write_back(written)


def _takes_own_kernel(params: list[Tensor], grads: list[Tensor], mu: list[Tensor], nu: list[Tensor]) -> bool:
    """Whether the update goes to the own multi-tensor kernel: some grad in another dtype
    than its param (ATen's kernel takes one), on leaves the kernel runs on here (each
    leaf's four tensors already in one dense layout)."""
    return any(g.dtype != p.dtype for p, g in zip(params, grads)) and adamw_lists.runs_here(params, grads, mu, nu)


def _write_back(written: list[tuple[Tensor, Tensor]]) -> None:
    if written:
        torch._foreach_copy_([t for t, _ in written], [c for _, c in written])


@torch.library.custom_op("sgraph::adamw", mutates_args=())
def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    step: Tensor,
    lr: Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> list[Tensor]:
    """The functional AdamW update: returns ``new_params + new_mu + new_nu`` as one
    list, each new tensor in the layout of the one it replaces (dense for a view).

    Where the own kernel takes the leaves as they are, it writes the new tensors
    directly (one pass, reading the inputs once); otherwise the inputs are cloned and
    updated in place."""
    if _takes_own_kernel(params, grads, mu, nu) and all(_aligned(*leaf) for leaf in zip(params, grads, mu, nu)):
        new_p, new_m, new_v = ([torch.empty_like(t) for t in ts] for ts in (params, mu, nu))
        out = (new_p, new_m, new_v)
        adamw_lists.adamw_lists_(params, grads, mu, nu, step, lr, b1, b2, eps, weight_decay, out=out)
        return new_p + new_m + new_v
    p, m, v = ([t.clone() for t in ts] for ts in (params, mu, nu))
    adamw_(p, grads, m, v, step, lr, b1, b2, eps, weight_decay)
    return p + m + v


@adamw.register_fake
def _(params, grads, mu, nu, step, lr, b1, b2, eps, weight_decay):  # type: ignore[no-untyped-def]
    for i, leaf in enumerate(zip(params, grads, mu, nu)):
        _check_shapes(i, leaf)
    return [torch.empty_like(t) for t in (*params, *mu, *nu)]


INPLACE_FORMS = {torch.ops.sgraph.adamw.default: torch.ops.sgraph.adamw_.default}
"""Functional op -> in-place op, for the reinplace pass."""


def written_lists(args: tuple) -> list:
    """The tensors ``sgraph::adamw_`` writes, in the order ``sgraph::adamw`` returns them."""
    params, _, mu, nu = args[:4]
    return [*params, *mu, *nu]


def _updated(
    leaves: list[Leaf], step: Tensor, lr: Tensor, b1: float, b2: float, eps: float, wd: float
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Each leaf's new ``(param, mu, nu)``, written in ATen elementwise ops as ATen's fused
    kernel computes them (in the params' dtype; ``param -= lr * wd * param`` first, then
    the moments, then ``param -= step_size * mu / (sqrt(nu) / sqrt(bc2) + eps)``).

    Rounded as the kernel rounds on each device: on CUDA it works in float32 from the
    betas rounded to float32 (``1 - beta2`` for 0.999 is then 1.29e-5 below 0.001); on
    CPU it takes ``1 - beta`` of the betas as given, and the bias corrections and the
    step size in float64."""
    dtype = leaves[0][0].dtype
    scalars = torch.float64
    if leaves[0][0].device.type == "cuda" and dtype == torch.float32:
        b1, b2, scalars = _float32(b1), _float32(b2), dtype
    t = step.to(scalars)
    step_size = (lr.to(scalars) / (1 - torch.pow(b1, t))).to(dtype)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, t)).to(dtype)
    lr = lr.to(dtype)
    out = []
    for p, g, m, v in leaves:
        g = g.to(dtype)
        if wd:
            p = p - lr * wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - step_size * m / (torch.sqrt(v) / bc2_sqrt + eps)
        out.append((p, m, v))
    return out


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _adamw_decomposed(params, grads, mu, nu, step, lr, b1, b2, eps, weight_decay):  # type: ignore[no-untyped-def]
    """``sgraph::adamw`` in ATen ops, where every leaf's four tensors share one dense
    layout (each result then has its input's, as the op promises); otherwise the op is
    kept (NotImplemented)."""
    leaves = list(zip(params, grads, mu, nu))
    if not leaves or not all(_aligned(*leaf) for leaf in leaves):
        return NotImplemented
    new_p, new_m, new_v = zip(*_updated(leaves, step, lr, b1, b2, eps, weight_decay))
    return [*new_p, *new_m, *new_v]


def _adamw_inplace_decomposed(params, grads, mu, nu, step, lr, b1, b2, eps, weight_decay):  # type: ignore[no-untyped-def]
    """``sgraph::adamw_`` in ATen ops: the new values, then a ``copy_`` into each param
    and moment (in its own layout, whatever the others' are)."""
    leaves = list(zip(params, grads, mu, nu))
    for i, leaf in enumerate(leaves):
        _check_shapes(i, leaf)
    if not leaves:
        return None
    new = _updated(leaves, step, lr, b1, b2, eps, weight_decay)
    for (p, _, m, v), (p2, m2, v2) in zip(leaves, new):
        p.copy_(p2)
        m.copy_(m2)
        v.copy_(v2)
    return None


GENERATED_LEAVES = 16
"""The most leaves a step's AdamW updates may have in all for ``sg.fuse`` to generate
them (see :func:`decompositions`)."""


def decompositions(gm: torch.fx.GraphModule) -> dict:
    """Both ops as ATen elementwise ops, for ``gm`` compiled by Inductor, if its AdamW
    updates have at most ``GENERATED_LEAVES`` leaves in all (else empty). Inductor then
    fuses each leaf's update with the ops making its gradient (the cast of a bf16
    matmul's result, a bias gradient's sum) and writes params and moments in place in
    one pass.

    Counted over the whole step, not per op: a memory plan splits one update into
    groups of a few leaves each. Measured on the H200 (``sg.static(sg.fuse(step))``,
    bf16 autocast, 2026-12-02): the MLP of 10 leaves went from 0.161 to 0.137 ms per
    step, while GPTs of 77 and 149 leaves ran at the same speed as on ATen's
    multi-tensor kernel (4.09 / 4.12 and 45.0 / 44.9 ms) but took 14.3 and 34.0 s in
    Inductor against 4.8 and 7.1 s, each leaf's update being a kernel of its own (fused
    with a different producer)."""
    if update_leaves(gm) > GENERATED_LEAVES:
        return {}
    return {
        torch.ops.sgraph.adamw.default: _adamw_decomposed,
        torch.ops.sgraph.adamw_.default: _adamw_inplace_decomposed,
    }


def update_leaves(gm: torch.fx.GraphModule) -> int:
    """The leaves of all of ``gm``'s AdamW updates (its subgraphs' included)."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(leaves_updated(graph.nodes) for graph in graphs)


def leaves_updated(nodes: Iterable[torch.fx.Node]) -> int:
    """The leaves of the AdamW updates among ``nodes`` (what :func:`decompositions`
    compares with ``GENERATED_LEAVES``, over a whole step)."""
    ops = (torch.ops.sgraph.adamw.default, torch.ops.sgraph.adamw_.default)
    return sum(len(cast("list", node.args[0])) for node in nodes if node.target in ops)
