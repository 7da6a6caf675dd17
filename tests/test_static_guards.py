"""Python state a trace reads is part of the signature: a change retraces or raises, never reuses."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import torch.nn as nn

import sgraph as sg


def dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))


def test_eval_after_train_retraces_naming_the_module_and_matches_eager():
    model = dropout_model()
    apply, params, _ = sg.functional(model)
    step = sg.static(lambda p, x: apply(p, {}, x))
    x = torch.ones(64, 4)
    step(params, x)
    model.eval()
    text = "training mode of the root module (Sequential) changed: train -> eval (and of 2 more modules)"
    with pytest.warns(sg.RetraceWarning, match=re.escape(text)):
        out = step(params, x)
    assert torch.equal(out, model(x))
    model.train()
    step(params, x)  # the train-mode program is still cached
    assert step.trace_count == 2


def test_mode_switch_under_retrace_error_raises():
    model = dropout_model()
    apply, params, _ = sg.functional(model)
    step = sg.static(lambda p, x: apply(p, {}, x), retrace="error")
    step(params, torch.ones(2, 4))
    model.eval()
    with pytest.raises(sg.RetraceError, match="training mode of"):
        step(params, torch.ones(2, 4))


@pytest.mark.parametrize(
    "context, text",
    [
        (torch.no_grad, "grad mode changed: on -> off"),
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16), "autocast (cpu) changed: off -> bfloat16"),
    ],
)
def test_a_global_mode_at_call_time_retraces_and_gives_the_eager_result(context, text):
    def f(a, b):
        return a @ b

    step = sg.static(f)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    step(a, b)
    with context(), pytest.warns(sg.RetraceWarning, match=re.escape(text)):
        out = step(a, b)
    with context():
        expected = f(a, b)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_default_dtype_is_part_of_the_signature():
    step = sg.static(lambda x: x + torch.ones(2), retrace="allow")
    assert step(torch.zeros(2, dtype=torch.float64)).dtype == torch.float64
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert step(torch.zeros(2, dtype=torch.float64)).dtype == torch.float64
        assert step.trace_count == 2
    finally:
        torch.set_default_dtype(previous)


def test_grad_under_an_outer_no_grad_computes_gradients():
    def loss(w):
        return (w * w).sum()

    with torch.no_grad():
        g = sg.grad(loss)(torch.arange(3.0))
        value, g2 = sg.value_and_grad(loss)(torch.arange(3.0))
        traced = sg.static(sg.grad(loss))(torch.arange(3.0))
    assert torch.equal(g, torch.tensor([0.0, 2.0, 4.0])) and torch.equal(g2, g) and torch.equal(traced, g)
    assert float(value) == 5.0


def test_dict_key_order_is_part_of_the_signature():
    step = sg.static(lambda p: torch.cat(list(p.values())))
    w, b = torch.zeros(1), torch.ones(1)
    assert torch.equal(step({"w": w, "b": b}), torch.tensor([0.0, 1.0]))
    with pytest.warns(sg.RetraceWarning, match=re.escape("the key order of p changed: ['w', 'b'] -> ['b', 'w']")):
        assert torch.equal(step({"b": b, "w": w}), torch.tensor([1.0, 0.0]))
    assert torch.equal(step({"w": w, "b": b}), torch.tensor([0.0, 1.0]))
    assert step.trace_count == 2


def test_outputs_keep_the_key_order_eager_gives():
    step = sg.static(lambda p: {k: v * 2 for k, v in p.items()}, retrace="allow")
    for keys in (["w", "b", "a"], ["b", "a", "w"]):
        out = step({k: torch.ones(1) for k in keys})
        assert list(out) == keys


def test_negative_zero_is_not_zero_and_nan_does_not_retrace():
    step = sg.static(lambda x, s: x / s, retrace="allow")
    assert torch.equal(step(torch.ones(1), 0.0), torch.tensor([float("inf")]))
    assert torch.equal(step(torch.ones(1), -0.0), torch.tensor([float("-inf")]))
    nan = sg.static(lambda x, s: x * s, retrace="error")
    nan(torch.ones(1), float("nan"))
    assert torch.isnan(nan(torch.ones(1), float("nan"))).all()


def test_static_int_bool_and_float_of_equal_value_are_different_signatures():
    step = sg.static(lambda x, s: x * s, retrace="allow")
    x = torch.ones(2, dtype=torch.int64)
    assert step(x, True).dtype == (x * True).dtype
    assert step(x, 1).dtype == (x * 1).dtype
    assert step(x, 1.0).dtype == (x * 1.0).dtype
    assert step.trace_count == 3


def test_a_step_that_changes_the_global_rng_state_raises():
    def step(x):
        torch.manual_seed(0)
        return x + torch.rand(2)

    state = torch.get_rng_state()
    with pytest.raises(sg.CaptureError, match="global RNG state"):
        sg.static(step)(torch.ones(2))
    assert torch.equal(torch.get_rng_state(), state)  # restored, as before the call


def test_batchnorm_train_and_eval_each_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    apply, params, buffers = sg.functional(model)
    step = sg.static(lambda p, b, x: apply(p, b, x), retrace="allow")
    x = torch.randn(8, 3)
    out, new_buffers = step(params, {k: v.clone() for k, v in buffers.items()}, x)
    assert torch.equal(out, model(x))  # train mode: batch statistics; updates the model's own buffers
    model.eval()
    out, _ = step(params, new_buffers, x)
    assert torch.equal(out, model(x))  # eval mode: the running statistics


_HELD = {}  # a module the step reads as a global


class _Holder:
    def __init__(self, module):
        self.module = module


def _via_global(d):
    _HELD["drop"] = d
    return lambda x: _HELD["drop"](x)


def _via_helper(d):
    def helper(x):
        return d(x)

    return lambda x: helper(x)


def _via_nested_static(d):
    inner = sg.static(lambda x: d(x), retrace="allow")
    return lambda x: inner(x) + 0


REACHED = {
    "global": _via_global,
    "helper_closure": _via_helper,
    "closed_over_list": lambda d: (lambda mods: lambda x: mods[0](x))([d]),
    "plain_object_attribute": lambda d: (lambda h: lambda x: h.module(x))(_Holder(d)),
    "partial": lambda d: functools.partial(lambda m, x: m(x), d),
    "the_module_itself": lambda d: d,
    "nested_sg_static": _via_nested_static,
}


@pytest.mark.parametrize("how", list(REACHED))
def test_a_module_reached_any_way_retraces_on_its_mode_switch(how):
    """A parameter-free module (Dropout) the step calls however it reaches it: after
    ``eval()`` the call traces again and gives eager's result, not the traced dropout."""
    drop = nn.Dropout(0.5)
    step = sg.static(REACHED[how](drop), retrace="allow")
    x = torch.ones(4, 16)
    assert not torch.equal(step(x), x)
    drop.eval()
    assert torch.equal(step(x), x)
    assert step.trace_count == 2
    drop.train()
    assert not torch.equal(step(x), x)


@pytest.mark.slow
def test_under_fuse_a_global_modules_mode_switch_retraces():
    drop = nn.Dropout(0.5)
    step = sg.fuse(_via_global(drop))
    x = torch.ones(4, 16)
    assert not torch.equal(step(x), x)
    drop.eval()
    with pytest.warns(sg.RetraceWarning, match=r"training mode of the root module \(Dropout\) changed"):
        assert torch.equal(step(x), x)


def test_numpy_floats_are_keyed_by_their_sign_like_python_floats():
    np = pytest.importorskip("numpy")
    step = sg.static(lambda x, s: x / s)
    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sg.RetraceWarning)
        for s in (np.float64(0.0), np.float64(-0.0), np.float32(-0.0), np.float32(0.0)):
            torch.testing.assert_close(step(x, s), x / s)
    assert step.trace_count == 4


def test_conjugated_and_negated_views_are_part_of_the_signature():
    z = torch.tensor([1 + 2j, 3 - 1j])
    step = sg.static(lambda x: x.imag * 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sg.RetraceWarning)
        for value in (z, z.conj(), z._neg_view(), z):
            torch.testing.assert_close(step(value), value.imag * 1)
    assert step.trace_count == 3


def test_a_donated_inference_tensor_is_refused_before_anything_is_written():
    with torch.inference_mode():
        params = {"a": torch.ones(3), "b": torch.zeros(2)}
    step = sg.static(lambda p, x: {"a": p["a"] * 0.5 + x, "b": p["b"] + 1}, donate="p")
    with pytest.raises(sg.ArgumentError, match=r"p\['a'\] is donated, but it is an inference tensor"):
        step(params, torch.ones(3))
    assert params["a"].tolist() == [1.0, 1.0, 1.0] and params["b"].tolist() == [0.0, 0.0]
    with torch.inference_mode():  # where it may be written, it is
        out = step(params, torch.ones(3))
    assert out["a"] is params["a"] and out["a"].tolist() == [1.5, 1.5, 1.5]


def test_the_default_device_is_guarded():
    step = sg.static(lambda x: (x * 2, torch.zeros(2)))
    assert step(torch.ones(2))[1].device.type == "cpu"
    torch.set_default_device("meta")
    try:
        with pytest.warns(sg.RetraceWarning, match="default device changed"):
            _, made = step(torch.ones(2, device="cpu"))
    finally:
        torch.set_default_device(None)
    assert made.device.type == "meta" and step.trace_count == 2  # as eager makes it


def _fp32_inside(a, b):
    with torch.autocast("cpu", enabled=False):  # this matmul stays fp32 under any outer autocast
        return a @ b


def _fp16_inside(a, b):
    with torch.autocast("cpu", dtype=torch.float16):
        return a @ b


@pytest.mark.parametrize("fn", [_fp32_inside, _fp16_inside], ids=["disabled", "fp16"])
def test_an_autocast_region_of_the_step_holds_under_the_callers_autocast(fn):
    """The graph holds the trace's casts; running it under the caller's autocast cast again."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    step = sg.static(fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(a, b)
        for _ in range(2):
            out = step(a, b)
            assert out.dtype == expected.dtype and torch.equal(out, expected)
        lowered = sg.static(fn).lower(a, b)  # the stages, called under autocast themselves
        out = lowered.compile()(a, b)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def _closed_over_changes():
    """Ways to change a closed-over tensor in place that eager follows."""
    return {
        "resize": lambda s: s.resize_(8).fill_(0.5),
        "new storage of another dtype": lambda s: setattr(s, "data", torch.arange(4, dtype=torch.float64)),
        "new storage of the same metadata": lambda s: setattr(s, "data", torch.full((4,), 3.0)),
        "set_ to one element": lambda s: s.set_(torch.full((1,), 3.0)),
        "strides": lambda s: s.as_strided_((4,), (2,)) if s.untyped_storage().nbytes() >= 32 else None,
    }


@pytest.mark.parametrize("change", list(_closed_over_changes()))
def test_a_closed_over_tensor_changed_in_place_retraces_and_matches_eager(change):
    s = torch.arange(8.0)[:4].clone()
    if change == "strides":
        s = torch.arange(8.0)
        s.as_strided_((4,), (1,))

    def f(x):
        return x * s.sum() / s.numel() + s[:1]

    step = sg.static(f)
    x = torch.randn(4)
    torch.testing.assert_close(step(x), f(x))
    _closed_over_changes()[change](s)
    with pytest.warns(sg.RetraceWarning, match="closed over by the step"):
        out = step(x)
    torch.testing.assert_close(out, f(x))
    assert out.dtype == f(x).dtype
    torch.testing.assert_close(step(x), f(x))


def test_a_compiled_stage_refuses_a_closed_over_tensor_changed_since():
    s = torch.ones(4)
    compiled = sg.static(lambda x: x * s).lower(torch.ones(4)).compile()
    s.resize_(1)
    with pytest.raises(sg.ArgumentTypeError, match=re.escape("closed over by the step, changed: f32[4] -> f32[1]")):
        compiled(torch.ones(4))


def test_a_frozen_module_closed_over_and_converted_to_double_retraces():
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    step = sg.static(lambda x: frozen(x).sum(), retrace="error")
    x = torch.randn(2, 4)
    step(x)
    frozen.double()
    with pytest.raises(sg.RetraceError, match=re.escape("closed over by the step, changed: f32[4, 4] -> f64[4, 4]")):
        step(x)
    assert sg.static(lambda x: frozen(x).sum())(x.double()).dtype == torch.float64
