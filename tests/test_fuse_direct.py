"""sg.fuse compiles below AOTAutograd: one plain retrace with Inductor's
decompositions, then ``compile_fx_inner``; an index in Inductor's cache directory lets
another compile of the same step load the generated code without the retrace.

Each test compiles tiny graphs into a cache directory of its own, so "cold" is cold.
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import mlp

import sgraph as sg
import sgraph._src.runtime.inductor_direct as direct

pytestmark = pytest.mark.slow  # compiles with Inductor


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def retraces(monkeypatch):
    """Counts the retraces with Inductor's decompositions (one per compile that is not
    loaded through the index)."""
    count = [0]
    original = direct._decomposed

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(direct, "_decomposed", counted)
    return count


def _fx_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def step(x, w):
    return torch.relu(x @ w).sum(0) * 0.5


def test_a_second_compile_of_the_same_step_loads_through_the_index(cache_dir, retraces):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    first = sg.fuse(step)
    torch.testing.assert_close(first(x, w), step(x, w))
    assert first.last_compiled.stats.inductor_entry == "direct" and retraces[0] == 1
    assert len(list((cache_dir / "sgraph-direct").iterdir())) == 1

    hits = _fx_cache_hits()
    second = sg.fuse(step)  # a new transform: nothing shared with the first but the caches
    torch.testing.assert_close(second(x, w), step(x, w))
    assert second.last_compiled.stats.inductor_entry == "direct"
    assert retraces[0] == 1 and _fx_cache_hits() == hits + 1
    assert second.last_compiled.stats.kernels_fused == first.last_compiled.stats.kernels_fused


def test_another_shape_is_another_index_entry(cache_dir, retraces):
    for n in (4, 6):
        x, w = torch.randn(n, 3), torch.randn(3, 5)
        torch.testing.assert_close(sg.fuse(step)(x, w), step(x, w))
    assert retraces[0] == 2 and len(list((cache_dir / "sgraph-direct").iterdir())) == 2


def test_an_index_entry_whose_code_is_gone_compiles_again(cache_dir, retraces):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    sg.fuse(step)(x, w)
    (entry,) = (cache_dir / "sgraph-direct").iterdir()
    entry.write_text("no-such-fx-graph-key")
    torch.testing.assert_close(sg.fuse(step)(x, w), step(x, w))
    assert retraces[0] == 2 and entry.read_text() != "no-such-fx-graph-key"


def test_with_inductors_caches_off_the_index_is_neither_read_nor_written(cache_dir, retraces):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    with torch._inductor.config.patch(force_disable_caches=True):
        for _ in range(2):
            torch.testing.assert_close(sg.fuse(step)(x, w), step(x, w))
    assert retraces[0] == 2 and not (cache_dir / "sgraph-direct").exists()
    sg.fuse(step)(x, w)  # caches on: an entry is written
    assert retraces[0] == 3 and (cache_dir / "sgraph-direct").exists()
    with torch._inductor.config.patch(force_disable_caches=True):
        torch.testing.assert_close(sg.fuse(step)(x, w), step(x, w))
    assert retraces[0] == 4


def test_a_donated_adamw_step_writes_in_place_below_aotautograd(cache_dir):
    """The in-place forms the reinplace pass gives donated outputs (the fused AdamW,
    the step counter's add) reach Inductor as they are: same results as eager over
    several steps, same tensor objects."""
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(mlp(8, 1, 3))
    opt = sg.optim.adamw(1e-2, weight_decay=0.01)

    def train(params, opt_state, x):
        loss, grads = sg.value_and_grad(lambda p: apply(p, buffers, x).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    fused = sg.static(sg.fuse(train), donate=("params", "opt_state"))
    state = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in params.items()}
    state_opt, ref_opt = opt.init(state), opt.init(ref)
    ids = [id(v) for v in state.values()]
    for i in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        state, state_opt, loss = fused(state, state_opt, x)
        ref, ref_opt, ref_loss = train(ref, ref_opt, x)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert fused.last_compiled.stats.inductor_entry == "direct"
    assert [id(v) for v in state.values()] == ids
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(state_opt.count) == 3


def test_a_step_with_a_tensor_constant_and_a_view_output(cache_dir):
    def f(x):
        scale = torch.tensor([1.0, 2.0, 3.0])
        y = x * scale
        return y, y.t(), x.sum()

    x = torch.randn(2, 3)
    fused = sg.fuse(f)
    for got, want in zip(fused(x), f(x)):
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride()
    assert fused.last_compiled.stats.inductor_entry == "direct"


def test_a_step_closing_over_tensors_compiles_below_aotautograd_and_reads_them_live(cache_dir, caplog):
    """A step that closes over tensors (a model's buffers, a mask) has them as constants
    in its graph. They become inputs of the compiled code, which reads the very
    tensors: an in-place change between calls is seen, as eagerly."""
    table = torch.arange(12.0).reshape(4, 3)
    mask = torch.tensor([1.0, 0.0, 1.0])

    def f(x):
        return (x * table[:2] * mask).sum(0) + table.sum()

    x = torch.randn(2, 3)
    fused = sg.static(sg.fuse(f))
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(fused(x), f(x))
    assert fused.last_compiled.stats.inductor_entry == "direct"
    assert "compiling through compile_fx" not in caplog.text
    table.mul_(2)
    mask[1] = 3.0
    torch.testing.assert_close(fused(x), f(x))
    assert fused.last_compiled.stats.traces == 1


def test_the_compile_runs_without_the_callers_autocast_and_grad_mode(cache_dir):
    """A step first called inside ``torch.autocast`` still compiles the traced graph
    as it is (its casts are in it); nothing records autograd history."""

    def f(x, w):
        return (x @ w).float().sum()

    x, w = torch.randn(4, 8), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = f(x, w)
        got = sg.fuse(f)(x, w)
    assert got.dtype == want.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("setting", [{"freezing": True}, {"pre_grad_custom_pass": lambda graph: None}])
def test_settings_only_compile_fx_applies_go_through_compile_fx(cache_dir, retraces, setting):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    with torch._inductor.config.patch(setting):
        fused = sg.fuse(step)
        torch.testing.assert_close(fused(x, w), step(x, w))
    assert fused.last_compiled.stats.inductor_entry == "compile_fx" and retraces[0] == 0


def test_a_graph_writing_an_intermediate_in_place_goes_through_compile_fx():
    """An in-place ATen op on an intermediate would reach Inductor unfunctionalized
    (it dropped a ``clamp_`` so, in a fuzzed step): only writes into inputs pass."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.sub.Tensor, (x, 0.25))
    z = graph.call_function(torch.ops.aten.clamp_.default, (y, -1, 1))
    graph.call_function(torch.ops.aten.copy_.default, (x, z))
    graph.output([z])
    assert not direct._writes_only_inputs(torch.fx.GraphModule({}, graph))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.clamp.default, (x, -1, 1))
    graph.call_function(torch.ops.aten.copy_.default, (x, y))
    graph.output([y])
    assert direct._writes_only_inputs(torch.fx.GraphModule({}, graph))
