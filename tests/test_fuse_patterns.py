"""sg.fuse's pattern matching: ordinary ``F.cross_entropy(x @ W.T, y)`` code runs on the
chunked linear + cross-entropy kernel. The lowered programs run here on eager
kernels (no Inductor compile), against the same step run eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sgraph as sg
from sgraph._src.runtime.eager import EagerExecutable

V, D = 1024, 16


def params_and_batch(seed=0, rows=12):
    g = torch.Generator().manual_seed(seed)
    params = {"w1": 0.3 * torch.randn(D, D, generator=g), "head": 0.3 * torch.randn(V, D, generator=g)}
    y = torch.randint(0, V, (rows,), generator=g)
    y[::5] = -100
    return params, (torch.randn(rows, D, generator=g), y)


def sgd_step(loss_fn):
    def step(params, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        return {k: p - 0.5 * grads[k] for k, p in params.items()}, loss

    return step


def run_lowered(step, params, batch, **fuse):
    lowered = sg.fuse(step, **fuse).lower(params, batch)
    compiled = sg.Compiled(lowered, EagerExecutable(lowered.program))
    return lowered, compiled(params, batch)


def targets(lowered):
    return {str(n.target) for n in lowered.program.ops()}


LOSSES = {
    "matmul_transpose": lambda p, x, y: F.cross_entropy(torch.tanh(x @ p["w1"]) @ p["head"].T, y),
    "linear_upcast_view": lambda p, x, y: F.cross_entropy(
        F.linear(torch.tanh(x @ p["w1"]), p["head"]).float().view(-1, V), y.view(-1)
    ),
    "smoothing_sum": lambda p, x, y: F.cross_entropy(
        torch.tanh(x @ p["w1"]) @ p["head"].t(),
        torch.where(y < 0, 3, y),
        label_smoothing=0.1,
        reduction="sum",
        ignore_index=3,
    ),
    "plain_right_operand": lambda p, x, y: F.cross_entropy(torch.matmul(x, p["head"].T.contiguous()), y),
    "rows_3d": lambda p, x, y: F.cross_entropy((torch.tanh(x @ p["w1"]).view(3, 4, D) @ p["head"].T).reshape(-1, V), y),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_ordinary_cross_entropy_code_runs_on_the_fused_kernel(name):
    params, batch = params_and_batch()
    loss = LOSSES[name]
    step = sgd_step(lambda p, b: loss(p, *b))
    lowered, (new, value) = run_lowered(step, params, batch)
    ops = targets(lowered)
    assert "sgraph.linear_cross_entropy.default" in ops
    assert not ops & {"aten._log_softmax.default", "aten.nll_loss_forward.default"}
    assert not any(
        n.target is torch.ops.aten.mm.default and n.meta["val"].shape[-1] == V for n in lowered.program.ops()
    )
    expected_new, expected = step(params, batch)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    for k in new:
        torch.testing.assert_close(new[k], expected_new[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "loss",
    [
        lambda p, x, y: F.cross_entropy(x @ p["w1"] @ p["head"].T, y, reduction="none").sum(),
        lambda p, x, y: F.cross_entropy(x @ p["w1"] @ p["head"].T, y, weight=torch.ones(V)),
        lambda p, x, y: F.cross_entropy(x @ p["w1"] @ p["head"][:512].T, y.clamp(max=511)),  # too few classes
        lambda p, x, y: F.cross_entropy(torch.relu(x @ p["w1"] @ p["head"].T), y),  # not a linear map
        lambda p, x, y: F.cross_entropy(x @ p["head"].T, y, label_smoothing=-0.1),  # eager ignores it
    ],
    ids=["reduction_none", "class_weights", "few_classes", "nonlinear_logits", "negative_smoothing"],
)
def test_other_cross_entropy_calls_keep_the_ordinary_ops(loss):
    params, batch = params_and_batch()
    step = sgd_step(lambda p, b: loss(p, *b))
    lowered, (new, value) = run_lowered(step, params, batch)
    assert "sgraph.linear_cross_entropy.default" not in targets(lowered)
    torch.testing.assert_close(value, step(params, batch)[1], rtol=1e-6, atol=0)


def test_logits_used_elsewhere_are_still_computed_and_results_agree():
    params, batch = params_and_batch()

    def loss(p, b):
        x, y = b
        logits = x @ p["head"].T
        return F.cross_entropy(logits, y) + 1e-3 * logits.square().mean()

    step = sgd_step(loss)
    lowered, (new, value) = run_lowered(step, params, batch)
    assert "sgraph.linear_cross_entropy.default" in targets(lowered)
    expected_new, expected = step(params, batch)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(new["head"], expected_new["head"], rtol=1e-5, atol=1e-6)


def test_kernels_option_turns_the_pattern_off():
    params, batch = params_and_batch()
    step = sgd_step(lambda p, b: LOSSES["matmul_transpose"](p, *b))
    lowered, _ = run_lowered(step, params, batch, kernels=())
    assert "sgraph.linear_cross_entropy.default" not in targets(lowered)
    assert "aten._log_softmax.default" in targets(lowered)
    assert "sgraph.linear_cross_entropy.default" not in targets(sg.static(step).lower(params, batch))


def test_module_head_under_sg_functional():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V, bias=False))
    apply, params, buffers = sg.functional(model)
    x, y = torch.randn(6, D), torch.randint(0, V, (6,))
    step = sgd_step(lambda p, b: F.cross_entropy(apply(p, buffers, b[0]), b[1]))
    lowered, (new, value) = run_lowered(step, params, (x, y))
    assert "sgraph.linear_cross_entropy.default" in targets(lowered)
    torch.testing.assert_close(value, F.cross_entropy(model(x), y), rtol=1e-6, atol=0)


def _mul_logits_in_place(p, x, y):
    logits = torch.tanh(x @ p["w1"]) @ p["head"].T
    logits.mul_(2)
    return F.cross_entropy(logits, y)


def _write_the_upcast_logits(p, x, y):
    logits = (torch.tanh(x @ p["w1"]) @ p["head"].T).float()
    logits[:, 0] = 5.0
    return F.cross_entropy(logits, y)


def _write_x_after_the_matmul(p, x, y):
    h = (x @ p["w1"]) * 0.5  # neither op saves h for its backward
    logits = h @ p["head"].detach().T  # nor this one, with a frozen head: h may be written afterwards
    h.add_(1.0)
    return F.cross_entropy(logits, y) + h.sum() * 0


@pytest.mark.parametrize("loss", [_mul_logits_in_place, _write_the_upcast_logits, _write_x_after_the_matmul])
def test_logits_or_their_inputs_written_in_place_before_the_loss_are_not_matched(loss):
    """The own kernel computes the logits from ``x`` and ``W`` again: after an in-place
    write on the way, it would not compute what the code did."""
    _assert_unmatched_and_eagers(loss)


def _assert_unmatched_and_eagers(loss):
    """The step with ``loss`` keeps the ordinary ops and gives eager's loss and params."""
    params, batch = params_and_batch()
    step = sgd_step(lambda p, b: loss(p, *b))
    lowered, (new, value) = run_lowered(step, params, batch)
    assert "sgraph.linear_cross_entropy.default" not in targets(lowered)
    expected_new, expected = step(params, batch)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    for k in new:
        torch.testing.assert_close(new[k], expected_new[k], rtol=1e-5, atol=1e-6)


def test_an_outer_grad_over_the_fused_loss_says_what_to_do():
    params, batch = params_and_batch()

    def loss(p, b):
        return F.cross_entropy(torch.tanh(b[0] @ p["w1"]) @ p["head"].T, b[1])

    def penalized(p, b):
        return loss(p, b) + sum(g.pow(2).sum() for g in sg.grad(loss)(p, b).values())

    with pytest.raises(Exception, match="cannot be differentiated twice"):
        run_lowered(sgd_step(penalized), params, batch)
    lowered, (new, value) = run_lowered(sgd_step(penalized), params, batch, kernels=("adamw", "gelu_mlp"))
    expected_new, expected = sgd_step(penalized)(params, batch)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)


HEADS_STORED_TRANSPOSED = {
    "matmul": lambda p, x, y: F.cross_entropy(torch.tanh(x @ p["w1"]) @ p["head_t"], y),
    "linear_of_t": lambda p, x, y: F.cross_entropy(F.linear(torch.tanh(x @ p["w1"]), p["head_t"].t()), y),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEADS_STORED_TRANSPOSED))
def test_a_head_stored_features_by_classes_trains_as_in_eager_through_inductor(name):
    """``logits = h @ E`` with ``E`` of ``[features, classes]``: the fused loss's weight is
    ``E.t()``, a transposed view, and its gradient must reach ``E`` in ``E``'s layout
    through the generated code (its fake once claimed ``E.t()``'s strides, and Inductor
    read the real, row-major gradient transposed: a wrong gradient, the loss right)."""
    params, batch = params_and_batch()
    params = {"w1": params["w1"], "head_t": params["head"].t().contiguous()}
    loss = HEADS_STORED_TRANSPOSED[name]
    step = sgd_step(lambda p, b: loss(p, *b))
    fused = sg.static(sg.fuse(step), donate="params")
    assert "sgraph.linear_cross_entropy.default" in targets(sg.fuse(step).lower(params, batch))
    mine, ref = {k: v.clone() for k, v in params.items()}, params
    for _ in range(3):
        mine, value = fused(mine, batch)
        ref, expected = step(ref, batch)
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        for k in ref:
            torch.testing.assert_close(mine[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    "loss",
    [
        lambda p, x, y: F.cross_entropy((x @ p["head"].T).to(torch.bfloat16).float(), y),  # rounds the logits
        lambda p, x, y: F.cross_entropy((x @ p["head"].T).to(torch.int32).to(torch.float32), y),  # cuts the grad
    ],
    ids=["bf16_round_trip", "int_round_trip"],
)
def test_logits_cast_other_than_up_to_fp32_are_not_matched(loss):
    _assert_unmatched_and_eagers(loss)


def test_the_fused_loss_has_the_dtype_of_the_ordinary_one():
    """bf16 logits not cast up: F.cross_entropy returns a bf16 loss, and so does the fused
    one (computed in fp32 inside)."""
    params, batch = params_and_batch()
    params = {k: v.bfloat16() for k, v in params.items()}
    batch = (batch[0].bfloat16(), batch[1])

    def loss(p, b):
        return F.cross_entropy(b[0] @ p["head"].T, b[1])

    _assert_matched_with_the_loss_dtype(loss, params, batch, torch.bfloat16, rtol=1e-2)


def _assert_matched_with_the_loss_dtype(loss, params, batch, dtype, rtol):
    """The fused loss is used and gives eager's loss, in eager's dtype ``dtype``."""
    lowered, (_, value) = run_lowered(sgd_step(loss), params, batch)
    assert "sgraph.linear_cross_entropy.default" in targets(lowered)
    expected = loss(params, batch)
    assert value.dtype == expected.dtype == dtype
    torch.testing.assert_close(value, expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("transform", [sg.static, sg.fuse], ids=["static", "fuse"])
def test_class_targets_eager_refuses_are_refused_at_the_trace(transform):
    """Eager's nll_loss refuses int32 class targets; its meta kernel does not, so the
    trace checks them (a fused step would otherwise return a loss)."""
    params, (x, y) = params_and_batch()
    y = torch.where(y < 0, 0, y).int()

    def loss(p, b):
        return F.cross_entropy(b[0] @ p["head"].T, b[1])

    with pytest.raises(RuntimeError, match="Long"):
        loss(params, (x, y))
    with pytest.raises(sg.CaptureError, match=r"takes class targets of dtype torch.int32.*\.long\(\)"):
        transform(sgd_step(loss)).lower(params, (x, y))


@pytest.mark.parametrize(
    "loss, error",
    [
        (lambda p, x, y: F.cross_entropy(x @ p["head"].T, y[:1]), "Expected input batch_size"),
        (lambda p, x, y: F.cross_entropy(x @ p["head"].T, y, label_smoothing=1.5), "between 0.0 and 1.0"),
    ],
    ids=["one_target_for_many_rows", "smoothing_above_one"],
)
def test_cross_entropy_calls_eager_refuses_raise_as_eager_does(loss, error):
    """The fused loss would broadcast one target over all rows, or smooth by 1.5."""
    params, batch = params_and_batch()
    step = sgd_step(lambda p, b: loss(p, *b))
    with pytest.raises((ValueError, RuntimeError), match=error):
        step(params, batch)
    with pytest.raises((ValueError, RuntimeError), match=error):
        run_lowered(step, params, batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_loss_under_autocast_is_fp32_as_eager(dtype):
    """Autocast runs F.cross_entropy in fp32 from low-precision logits; so does the fused loss."""
    params, batch = params_and_batch()

    def loss(p, b):
        with torch.autocast("cpu", dtype=dtype):
            return F.cross_entropy(b[0] @ p["head"].T, b[1])

    _assert_matched_with_the_loss_dtype(loss, params, batch, torch.float32, rtol=2e-3)
