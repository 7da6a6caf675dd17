"""Optimizer states: torch.save / torch.load(weights_only=True) round trips, and reprs."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import sgraph as sg
from sgraph._src.optim import STATES

OPTIMIZERS = {
    "adamw": lambda: sg.optim.adamw(sg.optim.cosine(1e-2, 10), weight_decay=0.1),
    "adam": lambda: sg.optim.adam(1e-2),
    "sgd": lambda: sg.optim.sgd(0.1),
    "sgd_momentum": lambda: sg.optim.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: sg.optim.lion(1e-3, weight_decay=0.1),
    "clip": lambda: sg.optim.clip_by_global_norm(0.5),
    "identity": lambda: sg.optim.identity(),
    "chain": lambda: sg.optim.chain(sg.optim.clip_by_global_norm(0.5), sg.optim.adamw(1e-3)),
    "nested_chain": lambda: sg.optim.chain(
        sg.optim.chain(sg.optim.identity(), sg.optim.clip_by_global_norm(1.0)), sg.optim.lion(1e-3)
    ),
}


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g), "s": torch.randn((), generator=g)}


def _round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only=True, torch's default


def _steps(opt: sg.optim.GradientTransformation, params: Any, state: Any, seeds: range) -> tuple[Any, Any]:
    for seed in seeds:
        updates, state = opt.update(_params(seed), state, params)
        params = sg.optim.apply_updates(params, updates)
    return params, state


def _assert_same(a: Any, b: Any) -> None:
    assert sg.tree.structure(a) == sg.tree.structure(b)
    for x, y in zip(sg.tree.leaves(a), sg.tree.leaves(b), strict=True):
        assert type(x) is type(y) and x.dtype == y.dtype and x.stride() == y.stride() and torch.equal(x, y)


# ------------------------------------------------------------------- save / load


def test_every_state_class_is_allowlisted_for_weights_only_loading():
    exported = {v for v in vars(sg.optim).values() if isinstance(v, type) and issubclass(v, tuple)}
    state_classes = exported - {sg.optim.GradientTransformation}
    assert state_classes == set(STATES)
    assert set(STATES) <= set(torch.serialization.get_safe_globals())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_round_trips_through_torch_load_and_training_continues_identically(name):
    opt = OPTIMIZERS[name]()
    params, state = _steps(opt, _params(0), opt.init(_params(0)), range(1, 4))
    loaded = _round_trip(state)
    _assert_same(loaded, state)
    assert type(loaded) is type(state) and [type(s) for s in loaded] == [type(s) for s in state]
    _assert_same(_steps(opt, params, loaded, range(4, 7)), _steps(opt, params, state, range(4, 7)))


def test_channels_last_state_keeps_its_layout_through_save_and_load():
    params = {"conv": torch.randn(4, 3, 2, 5).contiguous(memory_format=torch.channels_last)}
    state = sg.optim.adamw(1e-3).init(params)
    assert _round_trip(state).mu["conv"].stride() == params["conv"].stride()


def test_random_keys_round_trip_and_draw_the_same_numbers():
    key = sg.random.key(42)
    keys = sg.random.split(key, 3)
    checkpoint = {"key": key, "keys": keys, "opt_state": sg.optim.adam(1e-3).init(_params(0))}
    loaded = _round_trip(checkpoint)
    assert loaded["key"].dtype == torch.int64 and torch.equal(loaded["key"], key)
    assert torch.equal(loaded["keys"], keys)
    assert torch.equal(sg.random.normal(loaded["keys"][1], (4,)), sg.random.normal(keys[1], (4,)))


def test_namedtuple_behaviour_is_intact():
    state = sg.optim.adam(1e-3).init(_params(0))
    assert state._fields == ("count", "mu", "nu") and state[1] is state.mu
    count, mu, nu = state
    assert count is state.count
    replaced = state._replace(count=torch.tensor(5))
    assert type(replaced) is sg.optim.ScaleByAdamState and int(replaced.count) == 5 and replaced.mu is state.mu
    _assert_same(pickle.loads(pickle.dumps(state)), state)
    assert sg.optim.EmptyState() == () and sg.optim.SgdState(torch.tensor(0), None).momentum is None


# ------------------------------------------------------------------------- reprs


def test_adam_state_repr():
    params = {"w": torch.zeros(7, 5), "b": torch.zeros(5, dtype=torch.bfloat16)}
    state = sg.optim.adamw(1e-3).init(params)._replace(count=torch.tensor(3))
    tree = "<2 tensors, bf16/f32, 40 elements: (5,), (7, 5)>"
    assert repr(state) == f"ScaleByAdamState(count=3, mu={tree}, nu={tree})"


def test_large_trees_show_counts_not_shapes():
    params = {f"w{i}": torch.zeros(100, 1000) for i in range(12)}
    state = sg.optim.lion(1e-3).init(params)
    assert repr(state) == "LionState(count=0, mu=<12 tensors, f32, 1.2M elements>)"


@pytest.mark.parametrize(
    "state,expected",
    [
        (sg.optim.sgd(0.1).init({"w": torch.zeros(2)}), "SgdState(count=0, momentum=None)"),
        (
            sg.optim.sgd(0.1, momentum=0.9).init({"s": torch.zeros(())}),
            "SgdState(count=0, momentum=<1 tensor, f32, 1 element: ()>)",
        ),
        (sg.optim.EmptyState(), "EmptyState()"),
        (sg.optim.lion(1e-3).init({}), "LionState(count=0, mu=<0 tensors>)"),
        (
            sg.optim.adam(1e-3).init({"w": torch.zeros(3, 4, device="meta")}),
            "ScaleByAdamState(count=<i64 on meta>, mu=<1 tensor, f32, 12 elements on meta: (3, 4)>, "
            "nu=<1 tensor, f32, 12 elements on meta: (3, 4)>)",
        ),
    ],
)
def test_state_reprs(state, expected):
    assert repr(state) == expected


def test_chain_state_repr_is_a_tuple_of_summaries():
    state = sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.sgd(0.1)).init({"w": torch.zeros(2)})
    assert repr(state) == "(EmptyState(), SgdState(count=0, momentum=None))"


def test_repr_inside_a_trace_describes_the_count_without_reading_it():
    seen = []

    def step(count):
        seen.append(repr(sg.optim.SgdState(count, None)))
        return count + 1

    make_fx(step)(torch.tensor(3))  # real tensors under a tracing mode: .item() would be recorded
    make_fx(step, tracing_mode="fake")(torch.tensor(3))
    assert seen == ["SgdState(count=<i64 on cpu>, momentum=None)"] * 2


def test_repr_html_folds_a_table_of_tensors():
    state = sg.optim.lion(1e-3).init({"w": torch.zeros(7, 5)})
    assert state._repr_html_() == (
        "<details><summary><code>LionState(count=0, mu=&lt;1 tensor, f32, 35 elements: (7, 5)&gt;)</code></summary>"
        "<table><tr><td><code>state.count</code></td><td>()</td><td>i64</td><td>cpu</td></tr>"
        "<tr><td><code>state.mu[&#x27;w&#x27;]</code></td><td>(7, 5)</td><td>f32</td><td>cpu</td></tr>"
        "</table></details>"
    )
    big = sg.optim.lion(1e-3).init({f"w{i:02}": torch.zeros(1) for i in range(60)})
    assert big._repr_html_().count("<tr>") == 51 and "... 11 more" in big._repr_html_()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_repr_of_a_cuda_state_never_syncs():
    state = sg.optim.adamw(1e-3).init({"w": torch.zeros(7, 5, device="cuda")})
    torch.cuda.set_sync_debug_mode("error")
    try:
        text = repr(state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tree = "<1 tensor, f32, 35 elements on cuda:0: (7, 5)>"
    assert text == f"ScaleByAdamState(count=<i64 on cuda:0>, mu={tree}, nu={tree})"
