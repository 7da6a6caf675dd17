"""sg.fuse lowers sgraph's AdamW op through Inductor (the update is generated code,
fused with the ops making the gradients): against the same step run eagerly on ATen's
fused kernel, whatever the layouts, donated or not, with a value read from the
updated params in the same step.

Generated code rounds in another order (fused multiply-adds): params within 1e-5
relative after a few steps; a misplaced or doubly applied update is off by O(lr).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_optim_layouts import channels_last, strided, transposed

import sgraph as sg
from sgraph._src.kernels import adamw as kernel

pytestmark = pytest.mark.slow  # compiles with Inductor
OPT = sg.optim.adamw(1e-2, weight_decay=0.1)
SHAPES = {"conv": (4, 3, 2, 5), "w": (6, 5), "b": (5,), "s": ()}


def _values(seed: int, layouts: dict | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return {k: (layouts or {}).get(k, lambda t: t)(v) for k, v in values.items()}


def _loss(params, x):  # type: ignore[no-untyped-def]
    """``sum(p * x)``: each grad is ``x``'s leaf, in that leaf's layout."""
    return sum((params[k] * x[k]).sum() for k in sorted(params))


def step(params, state, x):  # type: ignore[no-untyped-def]
    grads = sg.grad(_loss)(params, x)
    updates, state = OPT.update(grads, state, params)
    params = sg.optim.apply_updates(params, updates)
    # read after the update: must see the new params, not the old ones
    return params, state, {"norm": sum((p * p).sum() for p in params.values())}


def _run(fn, params, xs):  # type: ignore[no-untyped-def]
    state = OPT.init(params)
    norms = []
    for x in xs:
        params, state, metrics = fn(params, state, x)
        norms.append(metrics["norm"])
    return params, state, torch.stack(norms)


def _check(fused, param_layouts: dict, grad_layouts: dict) -> str:
    """Run ``fused`` and the eager step for 3 steps from the same values; return as_text()."""
    xs = [_values(10 + i, grad_layouts) for i in range(3)]
    want = _run(step, _values(0, param_layouts), xs)
    params = _values(0, param_layouts)
    strides = {k: v.stride() for k, v in params.items()}
    got = _run(fused, params, xs)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)
    for k in SHAPES:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(got[1].mu[k], want[1].mu[k], rtol=1e-5, atol=1e-7, msg=k)
        torch.testing.assert_close(got[1].nu[k], want[1].nu[k], rtol=1e-5, atol=1e-8, msg=k)
        assert got[0][k].stride() == strides[k], k  # each param keeps its layout
    return fused.last_compiled.as_text()


def _generated(text: str) -> bool:
    """Whether the update went into generated kernels (not a call of the op)."""
    listed = text.split("kernels (")[1]
    return "torch.ops.sgraph.adamw" not in listed and re.search(r"fused\w*adamw", listed) is not None


def test_donated_update_in_any_layouts_is_generated_in_place():
    fused = sg.static(sg.fuse(step), donate=("params", "state"))
    text = _check(fused, {"conv": channels_last, "w": transposed}, {"conv": transposed, "w": strided})
    assert _generated(text), text
    assert "adamw_" in text  # donated: the in-place form, lowered as a write into each input


def test_update_not_donated_in_one_layout_is_generated():
    fused = sg.static(sg.fuse(step))
    text = _check(fused, {"conv": channels_last}, {"conv": channels_last})
    assert _generated(text), text


def test_update_not_donated_in_mixed_layouts_keeps_the_op():
    # The functional op promises each result in its input's layout; the elementwise
    # ops would follow TensorIterator's choice instead, so the op stays a call.
    fused = sg.static(sg.fuse(step))
    text = _check(fused, {"w": transposed}, {})
    assert "torch.ops.sgraph.adamw.default" in text.split("kernels (")[1], text


def _table(n: int = 1) -> dict:
    """The decompositions for a step with one AdamW update of ``n`` leaves."""
    return kernel.decompositions(_graph_with_updates([n]))


def _graph_with_updates(sizes: list[int]) -> torch.fx.GraphModule:
    """A graph calling ``sgraph::adamw`` once per size, over that many leaves."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def updates(*flat):  # type: ignore[no-untyped-def]
        out, i = [], 0
        for n in sizes:
            p, g, m, v = (list(flat[i + k * n : i + (k + 1) * n]) for k in range(4))
            out += torch.ops.sgraph.adamw(p, g, m, v, torch.tensor(1), torch.tensor(1e-2), 0.9, 0.999, 1e-8, 0.0)
            i += 4 * n
        return out

    return make_fx(updates)(*(torch.rand(3) for _ in range(4 * sum(sizes))))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decomposition_computes_what_the_kernel_does(device):
    # nu from zero is (1 - beta2) * g * g alone: ATen's CUDA kernel takes 1 - beta2 of
    # beta2 rounded to float32 (for 0.999, 1.29e-5 below the CPU kernel's 0.001).
    g = torch.Generator().manual_seed(3)
    leaves = [[torch.randn(s, generator=g).to(device) for s in ((7, 3), (5,))] for _ in range(3)]
    params, grads, mu = leaves
    nu = [torch.zeros_like(t) for t in params]
    args = (torch.tensor(1, device=device), torch.tensor(3e-2, device=device), 0.9, 0.999, 1e-8, 0.1)
    want = torch.ops.sgraph.adamw(params, grads, mu, nu, *args)
    table = _table()
    got = table[torch.ops.sgraph.adamw.default](params, grads, mu, nu, *args)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(got[4:], want[4:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    p, m, v = ([t.clone() for t in ts] for ts in (params, mu, nu))
    table[torch.ops.sgraph.adamw_.default](p, grads, m, v, *args)
    for a, b in zip(p + m + v, got):
        assert torch.equal(a, b)
    unaligned = [transposed(t) for t in params]
    assert table[torch.ops.sgraph.adamw.default](unaligned, grads, mu, nu, *args) is NotImplemented


def test_a_step_whose_updates_have_many_leaves_keeps_the_multi_tensor_kernel():
    # Each generated leaf update is a kernel of its own: past GENERATED_LEAVES leaves
    # ATen's multi-tensor kernel is as fast and compiles in a fraction of the time.
    # Counted over the step: a memory plan splits one update into groups of a few leaves.
    most = kernel.GENERATED_LEAVES
    assert kernel.update_leaves(_graph_with_updates([most // 2, most - most // 2])) == most
    assert _table(most) and not _table(most + 1)
    assert not kernel.decompositions(_graph_with_updates([most // 2, most // 2 + 1]))


def test_a_step_past_the_threshold_runs_the_op_in_place():
    n = kernel.GENERATED_LEAVES + 1
    g = torch.Generator().manual_seed(5)
    params = {f"p{i:02d}": torch.randn(4, generator=g) for i in range(n)}
    xs = [{k: torch.randn(4, generator=g) for k in params} for _ in range(3)]
    want = _run(step, {k: v.clone() for k, v in params.items()}, xs)
    fused = sg.static(sg.fuse(step), donate=("params", "state"))
    got = _run(fused, params, xs)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6, msg=k)
    listed = fused.last_compiled.as_text().split("kernels (")[1]
    assert "torch.ops.sgraph.adamw_.default" in listed, listed


@pytest.mark.parametrize("donate", [("params", "state"), ()], ids=["donated", "not-donated"])
def test_through_compile_fx_too(monkeypatch, donate):
    # Where the step cannot enter below AOTAutograd, compile_fx gets no own
    # decompositions (Inductor refuses one of an op that functionalization leaves a
    # call) and lowers the op as it does for any custom op.
    import sgraph._src.runtime.inductor as runtime

    monkeypatch.setattr(runtime, "compile_direct", lambda *args, **kwargs: None)
    fused = sg.static(sg.fuse(step), donate=donate)
    _check(fused, {"conv": channels_last}, {"conv": channels_last})
    assert fused.last_compiled.stats.inductor_entry == "compile_fx"


def _bf16_step(params, state, x):  # type: ignore[no-untyped-def]
    """A step whose grads come out in bf16 and are cast to fp32 for the update (as a
    weight's under autocast): ``sum(bf16(p) * bf16(x))``."""
    grads = sg.grad(lambda ps: sum((ps[k].bfloat16() * x[k].bfloat16()).float().sum() for k in sorted(ps)))(params)
    updates, state = OPT.update(grads, state, params)
    params = sg.optim.apply_updates(params, updates)
    return params, state, {"norm": sum((p * p).sum() for p in params.values())}


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 values, so each grad (``bf16(x)``) is the same whether or not
    the generated code keeps the round trip through bf16 (torch 2.11's Inductor drops it
    on the CPU: a difference of eager rounding, not of the update)."""
    return t.bfloat16().float()


def _update_grad_dtypes(program) -> list[torch.dtype]:  # type: ignore[no-untyped-def]
    ops = (torch.ops.sgraph.adamw.default, torch.ops.sgraph.adamw_.default)
    return [g.meta["val"].dtype for n in program.graph.nodes if n.target in ops for g in n.args[1]]


@pytest.mark.parametrize("leaves", [2, kernel.GENERATED_LEAVES + 1], ids=["generated", "op"])
def test_bf16_grads_reach_the_update_without_their_fp32_copies(leaves):
    g = torch.Generator().manual_seed(7)
    params = {f"p{i:02d}": torch.randn(3, 4, generator=g) for i in range(leaves)}
    xs = [{k: _bf16_exact(torch.randn(3, 4, generator=g)) for k in params} for _ in range(3)]
    fused = sg.static(sg.fuse(_bf16_step), donate=("params", "state"))
    kept = sg.static(sg.fuse(kernels=())(_bf16_step), donate=("params", "state"))
    state = OPT.init(params)
    assert set(_update_grad_dtypes(fused.lower(params, state, xs[0]).program)) == {torch.bfloat16}
    assert set(_update_grad_dtypes(kept.lower(params, state, xs[0]).program)) == {torch.float32}
    want = _run(_bf16_step, {k: v.clone() for k, v in params.items()}, xs)
    got = _run(fused, params, xs)
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(got[1].nu[k], want[1].nu[k], rtol=1e-5, atol=1e-8, msg=k)


@pytest.mark.parametrize("how", ["compile_fx", "plan_memory"])
def test_bf16_grads_reach_the_update_through_compile_fx_and_under_a_memory_plan(monkeypatch, how):
    import sgraph._src.runtime.inductor as runtime

    g = torch.Generator().manual_seed(8)
    params = {f"p{i:02d}": torch.randn(2, 3, generator=g) for i in range(kernel.GENERATED_LEAVES + 1)}
    xs = [{k: _bf16_exact(torch.randn(2, 3, generator=g)) for k in params} for _ in range(3)]
    if how == "compile_fx":
        monkeypatch.setattr(runtime, "compile_direct", lambda *args, **kwargs: None)
        fused = sg.static(sg.fuse(_bf16_step), donate=("params", "state"))
    else:
        fused = sg.static(sg.plan_memory()(sg.fuse(_bf16_step)), donate=("params", "state"))
    want = _run(_bf16_step, {k: v.clone() for k, v in params.items()}, xs)
    got = _run(fused, params, xs)
    assert torch.bfloat16 in _update_grad_dtypes(fused.last_compiled.program)
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(got[1].mu[k], want[1].mu[k], rtol=1e-5, atol=1e-7, msg=k)


def step_reading_the_old_values(params, state, x):  # type: ignore[no-untyped-def]
    """``step`` that also reads the params and moments it overwrites: norms of the old
    values beside the update, which must run before the update writes in place."""
    old = {
        "params": sum((p * p).sum() for p in params.values()),
        "mu": sum(m.abs().sum() for m in state.mu.values()),
        "nu": torch.stack([v.max() for v in state.nu.values()]).max(),
    }
    params, state, metrics = step(params, state, x)
    return params, state, {**metrics, **old}


@pytest.mark.parametrize("leaves", [2, kernel.GENERATED_LEAVES + 1], ids=["generated", "op"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_values_read_before_an_in_place_update_are_the_old_ones(device, leaves):
    g = torch.Generator().manual_seed(6)
    params = {f"p{i:02d}": torch.randn(4, 3, generator=g).to(device) for i in range(leaves)}
    xs = [{k: torch.randn(4, 3, generator=g).to(device) for k in params} for _ in range(4)]
    fused = sg.static(sg.fuse(step_reading_the_old_values), donate=("params", "state"))
    got, want = (params, OPT.init(params)), ({k: v.clone() for k, v in params.items()}, OPT.init(params))
    for x in xs:
        got = fused(*got[:2], x)
        want = step_reading_the_old_values(*want[:2], x)
        for name in ("params", "mu", "nu", "norm"):
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=0, msg=name)
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6, msg=k)
    op = "torch.ops.sgraph.adamw_.default" in fused.last_compiled.as_text().split("kernels (")[1]
    assert op == (leaves > kernel.GENERATED_LEAVES)
