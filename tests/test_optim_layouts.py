"""sg.optim whatever the memory layouts of params, grads and state, eager and under sg.static.

Every optimizer path (AdamW's fused kernel, the foreach ops, apply_updates) is run
for a few steps on params, grads and state laid out contiguous, channels-last,
transposed, as strided views, or each in another layout, and compared with eager
``torch.optim`` (foreach=False) or a per-tensor reference on the same layouts.
The tree holds a 4-d, a 2-d, a 1-d, a 0-dim and an empty leaf.

Tolerance: bitwise where the path runs the reference's own ATen ops (Adam's foreach
path, Lion, clipping). ``torch.optim.SGD`` applies ``p.add_(g, alpha=-lr)``, which
rounds once (its CPU loop is a fused multiply-add), while a functional update rounds
``-lr * g`` first; ATen's fused AdamW kernel rounds in another order than the
single-tensor path. Those are checked to 1e-6 of each leaf's largest magnitude (what
``tests/test_optim.py`` allows after 100 steps; the differences seen are 1-2e-7),
and, bitwise, against the same optimizer on contiguous tensors: a layout changes no
bit of the result, except through a global norm, which sums in memory order. On
CUDA every comparison allows 3e-5 (see the CUDA test). A misplaced update is off by
O(lr) = 1e-2, hundreds of times more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import sgraph as sg
from sgraph._src.kernels import adamw as kernel

SHAPES = {"conv": (4, 3, 2, 5), "w": (6, 5), "b": (5,), "s": (), "e": (0, 3)}
STEPS = 4
RTOL = 1e-6
CUDA_RTOL = 3e-5

Layout = Callable[[torch.Tensor], torch.Tensor]
Tree = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- layouts


def contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.channels_last) if t.dim() == 4 else contiguous(t)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Dims reversed in memory: the first dim varies fastest (``.t()`` for a matrix)."""
    order = list(reversed(range(t.dim())))
    return t.permute(order).clone(memory_format=torch.contiguous_format).permute(order)


def _view_of_wider(t: torch.Tensor, step: int, pad: int) -> torch.Tensor:
    """``t``'s values in a view of a NaN-filled buffer wider in the last dim (NaN: a
    kernel that reads or writes outside the view shows in the results)."""
    if t.dim() == 0:
        return contiguous(t)
    n = t.shape[-1]
    buffer = torch.full((*t.shape[:-1], step * n + pad), float("nan"), device=t.device)
    view = buffer[..., 1 : 1 + step * n : step]
    view.copy_(t)
    return view


def strided(t: torch.Tensor) -> torch.Tensor:
    """A view taking every other element of the last dim (``x[..., ::2]``)."""
    return _view_of_wider(t, 2, 1)


def column_slice(t: torch.Tensor) -> torch.Tensor:
    """A slice of columns of a wider tensor (``x[..., 1:-2]``): rows dense, gaps between them."""
    return _view_of_wider(t, 1, 3)


# name: (params, grads, state or None for the state init builds)
LAYOUTS: dict[str, tuple[Layout, Layout, Layout | None]] = {
    "contiguous": (contiguous, contiguous, None),
    "grads_channels_last": (contiguous, channels_last, None),
    "params_channels_last": (channels_last, contiguous, None),
    "all_channels_last": (channels_last, channels_last, None),
    "params_transposed": (transposed, contiguous, None),
    "grads_transposed": (contiguous, transposed, None),
    "all_transposed": (transposed, transposed, None),
    "params_strided": (strided, contiguous, None),
    "grads_strided": (contiguous, strided, None),
    "all_strided": (strided, strided, strided),
    "params_column_slice_grads_transposed": (column_slice, transposed, None),
    "params_channels_last_state_contiguous": (channels_last, channels_last, contiguous),
    "state_transposed": (contiguous, contiguous, transposed),
    "grads_transposed_state_channels_last": (contiguous, transposed, channels_last),
}


def test_layout_cases_give_the_layouts_they_name():
    x = torch.randn(4, 3, 2, 5)
    assert channels_last(x).is_contiguous(memory_format=torch.channels_last) and not channels_last(x).is_contiguous()
    assert transposed(x).stride() == (1, 4, 12, 24) and transposed(x[0, 0]).stride() == (1, 2)
    assert strided(x).stride() == (66, 22, 11, 2) and column_slice(x).stride() == (48, 16, 8, 1)
    for layout in (contiguous, channels_last, transposed, strided, column_slice):
        for t in (x, x[0, 0, 0], x[0, 0, 0, 0]):
            assert torch.equal(layout(t), t) and layout(t).untyped_storage().data_ptr() != t.data_ptr()


# ----------------------------------------------------------------------- references


def _values(seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _laid_out(values: Tree, layout: Layout) -> Tree:
    return {k: layout(v) for k, v in values.items()}


def _torch_reference(make: Callable[[list], torch.optim.Optimizer], moments: dict[str, str], clip: float | None = None):
    """Run ``torch.optim`` over params and grads in the given layouts (it updates in place)."""

    def run(params: Tree, grads_seq: list[Tree]) -> tuple[Tree, dict[str, Tree]]:
        tp = {k: v.requires_grad_() for k, v in params.items()}
        opt = make([tp[k] for k in sorted(tp)])  # sg.tree's leaf order, for the clip norm
        for grads in grads_seq:
            for k, p in tp.items():
                p.grad = grads[k]
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([tp[k] for k in sorted(tp)], clip, foreach=False)
            opt.step()
        state = {ours: {k: opt.state[p][theirs] for k, p in tp.items()} for ours, theirs in moments.items()}
        return {k: v.detach() for k, v in tp.items()}, state

    return run


def _lion_reference(lr: float, b1: float, b2: float, wd: float):
    """Lion leaf by leaf, with the ops its docstring states."""

    def run(params: Tree, grads_seq: list[Tree]) -> tuple[Tree, dict[str, Tree]]:
        mu = {k: torch.zeros_like(p) for k, p in params.items()}
        for grads in grads_seq:
            for k, g in grads.items():
                direction = torch.add(torch.sign(torch.lerp(mu[k], g, 1 - b1)), params[k], alpha=wd)
                params[k] = params[k] + direction * -lr
                mu[k] = torch.lerp(mu[k], g, 1 - b2)
        return params, {"mu": mu}

    return run


def _clip_reference(max_norm: float):
    """``p + g * min(max_norm / (||g|| + 1e-6), 1)``, norms leaf by leaf in sg.tree's order."""

    def run(params: Tree, grads_seq: list[Tree]) -> tuple[Tree, dict[str, Tree]]:
        for grads in grads_seq:
            norms = [torch.linalg.vector_norm(grads[k], 2.0) for k in sorted(grads)]
            coef = torch.clamp(max_norm / (torch.linalg.vector_norm(torch.stack(norms), 2.0) + 1e-6), max=1.0)
            params = {k: p + grads[k] * coef for k, p in params.items()}
        return params, {}

    return run


def _sgd_moments(state: Any) -> dict[str, Any]:
    return {} if state.momentum is None else {"momentum": state.momentum}


def _adam_moments(state: Any) -> dict[str, Any]:
    return {"mu": state.mu, "nu": state.nu}


@dataclass(frozen=True)
class Spec:
    """An optimizer, its reference, and how to read its moments."""

    make: Callable[[], sg.optim.GradientTransformation]
    reference: Callable[[Tree, list[Tree]], tuple[Tree, dict[str, Tree]]]
    moments: Callable[[Any], dict[str, Any]]
    exact: bool = False  # bitwise equal to the reference
    with_params: bool = True  # False: update(grads, state) without params
    norm: bool = False  # takes a global norm, so rounds differently in each layout


ADAM_MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}


def _sgd(**kw: Any) -> Spec:
    moments = {"momentum": "momentum_buffer"} if kw.get("momentum") else {}
    ref = _torch_reference(lambda ps: torch.optim.SGD(ps, foreach=False, **kw), moments)
    return Spec(lambda: sg.optim.sgd(**kw), ref, _sgd_moments)


OPTIMIZERS: dict[str, Spec] = {
    "sgd": _sgd(lr=0.1),
    "sgd_momentum": _sgd(lr=0.1, momentum=0.9),
    "sgd_nesterov": _sgd(lr=0.1, momentum=0.9, nesterov=True),
    "sgd_weight_decay": _sgd(lr=0.1, momentum=0.9, weight_decay=0.1),
    "adam_foreach": Spec(
        lambda: sg.optim.adam(1e-2),
        _torch_reference(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False), ADAM_MOMENTS),
        _adam_moments,
        exact=True,
        with_params=False,
    ),
    "adam_fused": Spec(
        lambda: sg.optim.adam(1e-2),
        _torch_reference(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False), ADAM_MOMENTS),
        _adam_moments,
    ),
    "adamw_fused": Spec(
        lambda: sg.optim.adamw(1e-2, weight_decay=0.1),
        _torch_reference(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), ADAM_MOMENTS),
        _adam_moments,
    ),
    "lion": Spec(
        lambda: sg.optim.lion(1e-2, b1=0.8, b2=0.95, weight_decay=0.1),
        _lion_reference(1e-2, 0.8, 0.95, 0.1),
        lambda state: {"mu": state.mu},
        exact=True,
    ),
    "clip": Spec(lambda: sg.optim.clip_by_global_norm(0.5), _clip_reference(0.5), lambda state: {}, True, norm=True),
    "chain_clip_adamw": Spec(
        lambda: sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.adamw(1e-2, weight_decay=0.1)),
        _torch_reference(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), ADAM_MOMENTS, 1.0),
        lambda state: _adam_moments(state[1]),
        norm=True,
    ),
}


# ------------------------------------------------------------------------ checks


def _tolerance(spec: Spec, device: str) -> float:
    """0.0 for bitwise; else the largest difference allowed, relative to the leaf's largest magnitude."""
    if device == "cuda":
        return CUDA_RTOL
    return 0.0 if spec.exact else RTOL


def _assert_matches(ours: Tree, ref: Tree, rtol: float, what: str) -> None:
    for k in ref:
        if not rtol:
            assert torch.equal(ours[k], ref[k]), f"{what}[{k!r}] differs from the reference"
        elif ref[k].numel():
            diff = float((ours[k] - ref[k]).abs().max() / ref[k].abs().max())
            assert diff <= rtol, f"{what}[{k!r}]: max relative difference {diff:.2e} > {rtol:.0e}"


def _assert_layouts_kept(old: Any, new: Any, what: str) -> None:
    """Each new leaf has the strides ``empty_like`` gives its old one: the very same for a
    dense tensor (contiguous, channels-last, transposed), a dense layout for a view."""
    for i, (o, n) in enumerate(zip(sg.tree.leaves(old), sg.tree.leaves(new))):
        if o.numel() == 0:
            continue  # no element, no layout: an empty result's strides are arbitrary
        assert n.stride() == torch.empty_like(o).stride(), f"{what} leaf {i}: strides {o.stride()} -> {n.stride()}"


def _assert_state_matches(spec: Spec, state: Any, ref_moments: dict[str, Tree], rtol: float) -> None:
    moments = spec.moments(state)
    assert moments.keys() == ref_moments.keys()
    for name, ref in ref_moments.items():
        _assert_matches(moments[name], ref, rtol, f"state.{name}")


def _case(layout_name: str, device: str = "cpu") -> tuple[Tree, list[Tree], Tree, list[Tree]]:
    """Params and grads for sgraph, and separate copies (same layouts) for the reference."""
    params_layout, grads_layout, _ = LAYOUTS[layout_name]
    values = [{k: v.to(device) for k, v in _values(seed).items()} for seed in range(STEPS + 1)]
    ours = (_laid_out(values[0], params_layout), [_laid_out(g, grads_layout) for g in values[1:]])
    ref = (_laid_out(values[0], params_layout), [_laid_out(g, grads_layout) for g in values[1:]])
    return (*ours, *ref)


def _init(spec: Spec, opt: sg.optim.GradientTransformation, params: Tree, layout_name: str) -> Any:
    state = opt.init(params)
    state_layout = LAYOUTS[layout_name][2]
    return state if state_layout is None else sg.tree.map(state_layout, state)


# ----------------------------------------------------------------------------- eager


def _run_eager(spec: Spec, params: Tree, grads_seq: list[Tree], layout_name: str) -> tuple[Tree, Any]:
    opt = spec.make()
    state = _init(spec, opt, params, layout_name)
    for grads in grads_seq:
        updates, new_state = opt.update(grads, state, params if spec.with_params else None)
        new_params = sg.optim.apply_updates(params, updates)
        _assert_layouts_kept(params, new_params, "params")
        _assert_layouts_kept(state, new_state, "state")
        params, state = new_params, new_state
    return params, state


def _check_eager(name: str, layout: str, device: str) -> tuple[Tree, Any]:
    spec = OPTIMIZERS[name]
    params, grads_seq, ref_params, ref_grads = _case(layout, device)
    got_params, state = _run_eager(spec, params, grads_seq, layout)
    want_params, want_moments = spec.reference(ref_params, ref_grads)
    _assert_matches(got_params, want_params, _tolerance(spec, device), "params")
    _assert_state_matches(spec, state, want_moments, _tolerance(spec, device))
    return got_params, state


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_eager_matches_reference_whatever_the_layouts(name, layout):
    got_params, state = _check_eager(name, layout, "cpu")
    spec = OPTIMIZERS[name]
    if not spec.norm:
        params, grads_seq, _, _ = _case("contiguous")
        contiguous_params, contiguous_state = _run_eager(spec, params, grads_seq, "contiguous")
        _assert_matches(got_params, contiguous_params, 0.0, "params (vs contiguous)")
        for name, moment in spec.moments(contiguous_state).items():
            _assert_matches(spec.moments(state)[name], moment, 0.0, f"state.{name} (vs contiguous)")


# ------------------------------------------------------------------------- sg.static


def _static_step(spec: Spec, opt: sg.optim.GradientTransformation) -> sg.Transformed:
    @sg.static(donate=("params", "state"))
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params if spec.with_params else None)
        return sg.optim.apply_updates(params, updates), state

    return step


def _check_static(name: str, layout: str, device: str) -> None:
    spec = OPTIMIZERS[name]
    params, grads_seq, ref_params, ref_grads = _case(layout, device)
    opt = spec.make()
    state = _init(spec, opt, params, layout)
    step = _static_step(spec, opt)
    donated = sg.tree.leaves((params, state))
    for grads in grads_seq:
        params, state = step(params, state, grads)
        # Donation returns the donated tensors themselves, views included: layouts kept.
        assert all(a is b for a, b in zip(sg.tree.leaves((params, state)), donated, strict=True))
    assert step.trace_count == 1
    want_params, want_moments = spec.reference(ref_params, ref_grads)
    _assert_matches(params, want_params, _tolerance(spec, device), "params")
    _assert_state_matches(spec, state, want_moments, _tolerance(spec, device))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_static_with_donation_matches_reference_whatever_the_layouts(name, layout):
    _check_static(name, layout, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_eager_and_static_match_reference_whatever_the_layouts(name, layout):
    # Not bitwise: CUDA's multi-tensor kernels contract multiply-adds where the
    # single-tensor ones may not, and its fused AdamW evaluates 1 - b2 in float32
    # (1 - 0.999f is 1.3e-5 off 0.001), which moves nu by that much relative.
    _check_eager(name, layout, "cuda")
    _check_static(name, layout, "cuda")


def _loss(params: Tree, inputs: Tree) -> torch.Tensor:
    """``sum(p * x)``: the grad of each param is its input, in the input's layout."""
    return sum((params[k] * inputs[k]).sum() for k in sorted(params))


GRAD_LAYOUTS = {"channels_last": channels_last, "transposed": transposed}


@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("name", ["adamw_fused", "sgd_weight_decay", "lion", "chain_clip_adamw"])
def test_static_value_and_grad_with_grads_in_another_layout(name, grad_layout):
    spec, layout = OPTIMIZERS[name], GRAD_LAYOUTS[grad_layout]
    params, inputs = _values(0), [_laid_out(_values(1 + i), layout) for i in range(STEPS)]
    assert sg.grad(_loss)(params, inputs[0])["conv"].stride() == inputs[0]["conv"].stride()
    opt = spec.make()

    @sg.static(donate=("params", "state"))
    def step(params, state, inputs):
        grads = sg.grad(_loss)(params, inputs)
        updates, state = opt.update(grads, state, params)
        return sg.optim.apply_updates(params, updates), state

    ref_params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    for x in inputs:
        params, state = step(params, state, x)
    want_params, want_moments = spec.reference(ref_params, [_laid_out(x, layout) for x in inputs])
    _assert_matches(params, want_params, _tolerance(spec, "cpu"), "params")
    _assert_state_matches(spec, state, want_moments, _tolerance(spec, "cpu"))


# ---------------------------------------------------------------------- the kernel


def _adamw_args(p, g, m, v):  # type: ignore[no-untyped-def]
    return [p], [g], [m], [v], torch.tensor(3), torch.tensor(1e-2), 0.9, 0.999, 1e-8, 0.1


def test_fused_adamw_with_channels_last_grad_of_contiguous_param_matches_torch():
    # The bug this file guards against: the fused kernel paired elements by memory position.
    p = torch.randn(4, 3, 2, 5)
    g = torch.randn(4, 3, 2, 5).contiguous(memory_format=torch.channels_last)
    opt = sg.optim.adamw(0.1)
    updates, state = opt.update({"p": g}, opt.init({"p": p}), {"p": p})
    tp = p.clone().requires_grad_()
    tp.grad = g.clone()
    ref = torch.optim.AdamW([tp], lr=0.1, foreach=False)
    ref.step()
    _assert_matches(sg.optim.apply_updates({"p": p}, updates), {"p": tp.detach()}, RTOL, "params")
    _assert_matches(state.mu, {"p": ref.state[tp]["exp_avg"]}, RTOL, "mu")


@pytest.mark.parametrize("layout", [channels_last, transposed, strided, column_slice])
def test_fused_kernel_gives_the_same_bits_as_for_contiguous_tensors(layout):
    values = [torch.randn(4, 3, 2, 5), torch.randn(4, 3, 2, 5), torch.randn(4, 3, 2, 5), torch.rand(4, 3, 2, 5)]
    want = torch.ops.sgraph.adamw(*_adamw_args(*values))
    for i in range(4):  # each of param, grad, mu, nu in the other layout, the rest contiguous
        args = [layout(t) if j == i else t for j, t in enumerate(values)]
        got = torch.ops.sgraph.adamw(*_adamw_args(*args))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"tensor {i} in another layout"


def test_fused_kernel_in_place_writes_only_into_the_views():
    values = [torch.randn(6, 5), torch.randn(6, 5), torch.randn(6, 5), torch.rand(6, 5)]
    p, m, v = (strided(t) for t in (values[0], values[2], values[3]))
    torch.ops.sgraph.adamw_(*_adamw_args(p, values[1], m, v))
    want = torch.ops.sgraph.adamw(*_adamw_args(*values))
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), want))
    for t in (p, m, v):
        assert t._base.isnan().sum() == t._base.numel() - t.numel()


@pytest.mark.parametrize("layout", [contiguous, channels_last, transposed])
def test_fused_kernel_copies_only_the_tensors_in_another_layout(layout, monkeypatch):
    seen: list[tuple[torch.Tensor, ...]] = []
    real = torch._fused_adamw_

    def spy(p, g, m, v, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((p[0], g[0], m[0], v[0]))
        return real(p, g, m, v, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    p, g, m, v = (layout(torch.randn(4, 3, 2, 5)) for _ in range(4))
    torch.ops.sgraph.adamw_(*_adamw_args(p, g, m, v))
    assert all(a is b for a, b in zip(seen[0], (p, g, m, v)))  # the common case: no copy
    other = strided(g)
    torch.ops.sgraph.adamw_(*_adamw_args(p, other, m, v))
    (p1, g1, m1, v1) = seen[1]
    assert p1 is p and m1 is m and v1 is v and g1 is not other and g1.stride() == p.stride()


def test_fused_kernel_rejects_a_grad_of_another_shape():
    p, g = torch.zeros(6, 5), torch.zeros(5, 6)
    match = r"sgraph::adamw: grads\[0\] has shape \(5, 6\), but params\[0\] has shape \(6, 5\)\. Pass one grad"
    with pytest.raises(sg.ArgumentError, match=match):
        torch.ops.sgraph.adamw(*_adamw_args(p, g, torch.zeros(6, 5), torch.zeros(6, 5)))
    with pytest.raises(sg.ArgumentError, match=match):
        sg.optim.adamw(1e-3).update({"w": g}, sg.optim.adamw(1e-3).init({"w": p}), {"w": p})


def test_aligned_and_dense_checks():
    x = torch.randn(4, 3, 2, 5)
    assert kernel._dense(x) and kernel._dense(transposed(x)) and kernel._dense(torch.zeros(0, 3).t())
    assert not kernel._dense(strided(x)) and not kernel._dense(column_slice(x))
    assert not kernel._dense(torch.zeros(3).expand(4, 3))
    assert kernel._aligned(x, x, x, x) and not kernel._aligned(x, channels_last(x), x, x)
    assert not kernel._aligned(*(strided(x),) * 4) and not kernel._aligned(x, x, x, x[:, :, :, :4])
