"""Donation and aliasing never change a result: sg.static against the same step run eagerly."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import sgraph as sg


def eager_then_static(step, args, donate, calls=3):
    """Run ``step`` eagerly on deep copies and under sg.static, ``calls`` times, feeding
    each call's donated outputs back; return both result lists."""
    static = sg.static(step, donate=donate)
    eager_args, static_args = copy.deepcopy(args), args
    eager_out, static_out = [], []
    for _ in range(calls):
        eager_out.append(copy.deepcopy(step(*eager_args)))
        static_out.append(static(*static_args))
    return eager_out, static_out, static


def assert_trees_equal(a, b):
    la, sa = sg.tree.flatten(a)
    lb, sb = sg.tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (x, y)


def test_a_donated_input_returned_unchanged_keeps_its_value():
    @sg.static(donate="params")
    def step(params, x):
        g = sg.grad(lambda p: (p["w"] * x).sum())(params)
        return g, params

    params = {"w": torch.ones(3)}
    g, p = step(params, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(g["w"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(p["w"], torch.ones(3)) and p["w"] is params["w"]


def test_an_input_that_is_also_a_donated_input_reads_its_old_value():
    def step(params, ema):
        new = {"w": params["w"] - 0.1}
        return new, {"w": 0.9 * ema["w"] + 0.1 * new["w"]}

    params = {"w": torch.ones(3)}
    expected = step(copy.deepcopy(params), copy.deepcopy(params))
    new, ema = sg.static(step, donate="params")(params, dict(params))
    assert_trees_equal((new, ema), expected)
    assert torch.allclose(ema["w"], torch.full((3,), 0.99))


@pytest.mark.parametrize(
    "other",
    [
        lambda w: w[1:],  # an overlapping slice
        lambda w: w.view(2, 2),  # a view of the whole
        lambda w: w[::2],  # a strided view
        lambda w: w.t() if w.dim() == 2 else w.unsqueeze(0).t(),  # a transposed view
    ],
)
def test_a_view_of_a_donated_input_passed_as_another_argument_gives_the_eager_result(other):
    def step(params, extra):
        return {"w": params["w"] * 2}, extra.sum() + extra.reshape(-1)[0]

    w = torch.arange(4.0)
    eager = step({"w": w.clone()}, other(w.clone()))
    out = sg.static(step, donate="params")({"w": w}, other(w))
    assert_trees_equal(out, eager)


def test_one_tensor_under_two_donated_keys_raises_naming_both_paths():
    w = torch.ones(3)
    step = sg.static(lambda p: {k: v + 1 for k, v in p.items()}, donate=0)
    with pytest.raises(sg.ArgumentError, match=re.escape("donated inputs p['a'] and p['b'] share memory")):
        step({"a": w, "b": w})


def test_overlapping_donated_slices_raise_naming_both_paths():
    base = torch.zeros(6)
    step = sg.static(lambda p: {k: v + 1 for k, v in p.items()}, donate="p")
    with pytest.raises(sg.ArgumentError, match=re.escape("p['x'] and p['y'] share memory")):
        step({"x": base[:4], "y": base[2:]})
    step({"x": base[:3], "y": base[3:]})  # disjoint slices of one tensor are fine
    assert torch.equal(base, torch.ones(6))


def test_an_alias_of_a_donated_input_the_step_writes_in_place_raises():
    @sg.static(donate="state")
    def step(state, view):
        state["n"].add_(1)
        return view * 2

    n = torch.zeros(2)
    with pytest.raises(sg.ArgumentError, match=re.escape("input view shares memory with donated input state['n']")):
        step({"n": n}, n)


def test_a_donated_result_also_returned_as_a_metric_is_not_overwritten_later():
    @sg.static(donate="params")
    def step(params):
        new = {"w": params["w"] + 1}
        return new, {"w_after": new["w"], "row": new["w"][:2]}

    params = {"w": torch.zeros(3)}
    params, first = step(params)
    params, second = step(params)
    assert torch.equal(first["w_after"], torch.ones(3)) and torch.equal(first["row"], torch.ones(2))
    assert torch.equal(second["w_after"], torch.full((3,), 2.0))
    assert torch.equal(params["w"], torch.full((3,), 2.0))


def test_donated_buffers_go_to_the_output_at_the_same_path():
    @sg.static(donate="params")
    def step(params):
        new = {"a": params["a"] + 1, "b": params["b"] + 2}
        return {"metric": new["b"] * 10}, new  # the metric comes first in flattening order

    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    a, b = params["a"], params["b"]
    metrics, params = step(params)
    assert params["a"] is a and params["b"] is b
    assert torch.equal(metrics["metric"], torch.full((2,), 20.0))


def test_the_same_tensor_passed_twice_undonated_gives_the_eager_result_every_call():
    def step(a, b):
        return a * 2 + b

    x = torch.arange(3.0)
    eager, static, transformed = eager_then_static(step, (x, x), donate=())
    for e, s in zip(eager, static):
        assert torch.equal(e, s)
    assert transformed.trace_count == 1  # one object twice is still the same signature


def test_aliasing_checks_follow_each_call():
    def step(params, other):
        return {"w": params["w"] + 1}, other * 1

    static = sg.static(step, donate="params")
    params = {"w": torch.zeros(2)}
    params, _ = static(params, torch.ones(2))  # no aliasing: remembered as safe
    held = params["w"]
    params, out = static(params, held)  # now the other input is the donated tensor itself
    assert torch.equal(out, torch.ones(2)) and torch.equal(params["w"], torch.full((2,), 2.0))


def test_a_train_step_updates_donated_params_in_place_with_no_copies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    apply, params, _ = sg.functional(model)
    opt = sg.optim.adamw(1e-3)

    @sg.static(donate=("params", "opt_state"))
    def step(params, opt_state, x):
        loss, grads = sg.value_and_grad(lambda p: apply(p, {}, x).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    targets = [str(n.target) for n in step.lower(params, opt.init(params), torch.ones(2, 4)).program.ops()]
    assert targets.count("sgraph.adamw_.default") == 1 and "sgraph.adamw.default" not in targets
    assert "aten.clone.default" not in targets  # the fused update's outputs are distinct tensors


def test_a_value_returned_twice_is_copied_once_views_of_it_too():
    @sg.static(donate="params")
    def step(params):
        new = params["w"] * 2
        return {"w": new}, {"again": new, "view": new[:1], "pair": torch.split(new, 2)}

    targets = [str(n.target) for n in step.lower({"w": torch.ones(4)}).program.ops()]
    assert targets.count("aten.clone.default") == 4  # again, view, and both split halves


@pytest.mark.parametrize("fuse", [False, True], ids=["static", "static+fuse"])
def test_an_undonated_input_returned_twice_is_passed_back_donated_without_changing_the_other(fuse):
    """Eager returns ``x`` at both places; the step keeps the first (the very tensor) and
    copies the second, so donating the first on the next call leaves the second as it was."""

    def step(p, x):
        return p + x, x, {"x": x, "row": x[:2]}

    run = sg.static(sg.fuse(step) if fuse else step, donate="p")
    x = torch.arange(4.0)
    first = run(torch.ones(4), x)
    assert first[1] is x and first[2]["x"] is not x
    second = run(first[1], torch.full((4,), 10.0))  # x given back as donated memory
    assert torch.equal(second[0], torch.arange(4.0) + 10)
    assert torch.equal(first[2]["x"], torch.arange(4.0)) and torch.equal(first[2]["row"], torch.arange(2.0))


@pytest.mark.parametrize("fuse", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["static", "static+fuse"])
def test_two_undonated_inputs_that_are_one_tensor_come_back_apart_when_the_step_donates(fuse):
    """``step(p, x, x)`` returning both ``x`` and ``y``: one tensor at two places, as in
    eager, where passing one back donated overwrote the other the user held (the fuzz,
    seed 2415). The graph cannot know the two inputs are one; the call does."""

    def step(p, x, y):
        return p + x, x, {"y": y, "row": y[:2]}

    run = sg.static(sg.fuse(step) if fuse else step, donate="p")
    x = torch.arange(4.0)
    first = run(torch.ones(4), x, x)
    assert first[1] is x and first[2]["y"] is not x
    second = run(first[1], torch.full((4,), 10.0), torch.zeros(4))  # x given back as donated memory
    assert torch.equal(second[0], torch.arange(4.0) + 10)
    assert torch.equal(first[2]["y"], torch.arange(4.0)) and torch.equal(first[2]["row"], torch.arange(2.0))
    z = torch.arange(4.0)
    apart = run(torch.ones(4), z, torch.zeros(4))  # two tensors on this call: x comes back as itself
    assert apart[1] is z and torch.equal(apart[2]["row"], torch.zeros(2))


def test_an_output_computed_from_a_view_of_an_undonated_input_never_writes_into_it():
    @sg.static(donate="params")
    def step(params, x):
        return {"w": x.reshape(3) - params["w"]}  # the new params["w"] starts from a view of x

    x = torch.tensor([[1.0, 2.0, 3.0]])
    out = step({"w": torch.ones(3)}, x)
    assert torch.equal(x, torch.tensor([[1.0, 2.0, 3.0]]))
    assert torch.equal(out["w"], torch.tensor([0.0, 1.0, 2.0]))


def test_a_compiled_stage_called_directly_checks_aliasing_too():
    def step(params, ema):
        return {"w": params["w"] - 0.1}, ema["w"] * 1

    params = {"w": torch.ones(3)}
    compiled = sg.static(step, donate="params").lower(params, {"w": torch.zeros(3)}).compile()
    new, old = compiled(params, dict(params))  # ema shares params' tensor
    assert torch.equal(old, torch.ones(3)) and torch.allclose(new["w"], torch.full((3,), 0.9))
