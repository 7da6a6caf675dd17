"""Writes a compiled step could lose or misplace, against the same step run eagerly over
several calls: BatchNorm's running statistics (which its ops update without saying so),
writes into tensors the step closes over, inputs written in place and returned, and
closed-over tensors sharing memory with a donated input. On the CPU, and on a GPU (where
the trace holds cuDNN's batch norm and the step replays in a CUDA graph)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sgraph as sg

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]

# sg.fuse compiles C++ on the CPU (slow): it runs on the smallest cases only.
MODES = ["static", "fuse", "static+fuse"]


def compiled(step, mode, **static):
    if mode == "static":
        return sg.static(step, **static)
    if mode == "fuse":
        return sg.fuse(step)
    return sg.static(sg.fuse(step), **static)


def bn_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).to(device)


def batches(device, n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 4, generator=g).to(device) for _ in range(n)]


def clones(tree):
    return sg.tree.map(torch.clone, tree)


# --------------------------------------------------------------------------- BatchNorm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_running_stats_of_a_forward_whose_output_is_unused(device, mode):
    """``torch.optim.swa_utils.update_bn``'s pattern: forward in train mode, keep only the
    new statistics (the batch norm's output feeds nothing)."""
    apply, params, buffers = sg.functional(bn_model(device))

    def step(params, buffers, x):
        _, new = apply(params, buffers, x)
        return new

    f = compiled(step, mode)
    got, want = clones(buffers), clones(buffers)
    for x in batches(device):
        got, want = f(params, got, x), step(params, want, x)
    assert int(got["1.num_batches_tracked"]) == 3
    assert not torch.equal(want["1.running_mean"], buffers["1.running_mean"])
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def train_step(apply):
    def step(params, buffers, x):
        def loss_fn(p):
            out, new = apply(p, buffers, x)
            return out.square().mean(), new

        (loss, new), g = sg.value_and_grad(loss_fn, has_aux=True)(params)
        params = {k: params[k] - 0.1 * g[k] for k in params}
        metrics = {"loss": loss, "mean": new["1.running_mean"], "old_mean": buffers["1.running_mean"]}
        return params, new, metrics

    return step


@pytest.mark.parametrize("device", DEVICES)
def test_donated_buffers_and_their_statistics_in_the_metrics(device):
    """The new and the old running mean returned as metrics, buffers donated: each metric
    holds the value eager gives, call after call."""
    apply, params, buffers = sg.functional(bn_model(device))
    step = train_step(apply)
    f = sg.static(step, donate=("params", "buffers"))
    mine, ref = [clones(params), clones(buffers)], [clones(params), clones(buffers)]
    for call, x in enumerate(batches(device)):
        *mine, got = f(*mine, x)
        *ref, want = step(*ref, x)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"call {call}: {key}")
    for key in ref[1]:
        torch.testing.assert_close(mine[1][key], ref[1][key], rtol=1e-5, atol=1e-6, msg=key)


def test_running_stats_under_fuse_with_donation():
    apply, params, buffers = sg.functional(bn_model("cpu"))
    step = train_step(apply)
    f = sg.static(sg.fuse(step), donate=("params", "buffers"))
    mine, ref = [clones(params), clones(buffers)], [clones(params), clones(buffers)]
    for x in batches("cpu"):
        *mine, got = f(*mine, x)
        *ref, want = step(*ref, x)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_buffers_read_through_a_closure():
    """``sg.functional``'s buffers closed over, not passed: every call starts from them, as in eager."""
    apply, params, buffers = sg.functional(bn_model("cpu"))
    original = clones(buffers)

    def step(params, x):
        out, new = apply(params, buffers, x)
        return out.sum(), new

    f = sg.static(step)
    for x in batches("cpu"):
        (got, got_new), (want, want_new) = f(params, x), step(params, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for key in want_new:
            torch.testing.assert_close(got_new[key], want_new[key], rtol=1e-5, atol=1e-6)
    for key in buffers:
        assert torch.equal(buffers[key], original[key]), key


def test_batch_norm_on_inputs_writes_only_donated_ones():
    def step(mean, var, x):
        return F.batch_norm(x, mean, var, training=True).sum()

    mean, var = torch.zeros(4), torch.ones(4)
    with pytest.raises(sg.CaptureError, match=r"writes in place into input mean .*F\.batch_norm"):
        sg.static(step)(mean, var, torch.randn(8, 4))
    assert torch.equal(mean, torch.zeros(4)) and torch.equal(var, torch.ones(4))
    f = sg.static(step, donate=("mean", "var"))
    want = [torch.zeros(4), torch.ones(4)]
    for x in batches("cpu"):
        x = x[:, :4]
        f(mean, var, x)
        step(*want, x)
    torch.testing.assert_close(mean, want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(var, want[1], rtol=1e-6, atol=1e-7)


def test_the_graph_holds_no_hidden_write():
    """After the trace no batch norm that writes in place without saying so is left."""
    apply, params, buffers = sg.functional(bn_model("cpu"))
    text = sg.static(train_step(apply)).trace(params, buffers, batches("cpu")[0]).as_text()
    assert "_native_batch_norm_legit_functional" in text
    assert "aten.native_batch_norm(" not in text


# --------------------------------------------------------------------------- closed-over tensors


@pytest.mark.parametrize("mode", ["static", "fuse"])
def test_a_write_into_a_closed_over_counter_raises_before_it_happens(mode):
    counter = torch.zeros(())

    def step(x):
        counter.add_(1)
        return x * counter

    with pytest.raises(sg.CaptureError, match=r"closes over .*counter\.add_\(1\).*Pass it in as an argument"):
        compiled(step, mode)(torch.ones(2))
    assert counter.item() == 0  # the trace did not apply the write


def test_a_write_into_a_view_of_a_closed_over_tensor_raises():
    hist = torch.zeros(3)

    def step(x):
        hist[1] = x.sum()
        return x * 2

    with pytest.raises(sg.CaptureError, match=r"closes over .*hist\[1\] = x\.sum\(\)"):
        sg.static(step)(torch.ones(2))
    assert torch.equal(hist, torch.zeros(3))


def test_a_closed_over_modules_batch_norm_in_train_mode_raises():
    model = bn_model("cpu").requires_grad_(False)
    before = model[1].running_mean.clone()

    def step(x):
        return model(x).sum()

    with pytest.raises(sg.CaptureError, match=r"closes over .*sg\.functional"):
        sg.static(step)(batches("cpu")[0])
    assert torch.equal(model[1].running_mean, before)


def test_the_same_counter_passed_and_donated_works():
    def step(counter, x):
        counter.add_(1)
        return x * counter

    counter, want = torch.zeros(()), torch.zeros(())
    f = sg.static(step, donate="counter")
    for _ in range(3):
        torch.testing.assert_close(f(counter, torch.ones(2)), step(want, torch.ones(2)))
    assert counter.item() == 3


@pytest.mark.parametrize("mode", ["static", "static+fuse"])
def test_a_closed_over_alias_of_a_donated_input_raises(mode):
    """The step reads ``w0``, a detached view of the donated ``params['w']``: the donated
    memory receives the new value while the step may still read it."""
    params = {"w": torch.ones(3)}
    w0 = params["w"].detach()

    def step(params, x):
        new = {"w": params["w"] - 0.1 * x}
        return new, (w0 * x).sum() + new["w"].sum()

    with pytest.raises(sg.ArgumentError, match=r"closes over a tensor f32\[3\] at .*w0 \* x.* params\['w'\]"):
        compiled(step, mode, donate="params")(params, torch.ones(3))
    assert torch.equal(params["w"], torch.ones(3))
    # a clone closed over is fine, and reads the value it holds
    w0 = params["w"].clone()
    f = sg.static(step, donate="params")
    want = copy.deepcopy(params)
    for _ in range(3):
        params, got = f(params, torch.ones(3))
        want, expected = step(want, torch.ones(3))
        torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- in-place and returned


@pytest.mark.parametrize("mode", ["static", "static+fuse"])
def test_params_updated_in_place_and_returned_are_the_same_tensors(mode):
    """``p.sub_(lr * g); return params``: eager returns the very tensors passed in, so a
    module bound through sg.functional keeps training; so must the compiled step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    apply, params, buffers = sg.functional(model)
    twin = copy.deepcopy(model)
    _, ref, _ = sg.functional(twin)

    def step(params, x):
        g = sg.grad(lambda p: apply(p, buffers, x).square().mean())(params)
        for k in params:
            params[k].sub_(0.1 * g[k])
        return params, {"weight": params["weight"]}

    f = compiled(step, mode, donate="params")
    for x in batches("cpu"):
        x = x[:, :3]
        new, metrics = f(params, x)
        step(ref, x)
        assert all(new[k] is params[k] for k in params)
        torch.testing.assert_close(metrics["weight"], ref["weight"])
    torch.testing.assert_close(model.weight.detach(), twin.weight.detach())
    torch.testing.assert_close(model.bias.detach(), twin.bias.detach())


def test_an_input_written_in_place_and_returned_without_donation_raises():
    def step(p, x):
        p.add_(x)
        return p

    p = torch.ones(3)
    with pytest.raises(sg.CaptureError, match="which is not donated"):
        sg.static(step)(p, torch.ones(3))
    assert torch.equal(p, torch.ones(3))


def test_under_fuse_alone_the_error_says_where_donation_lives():
    def step(p, x):
        p.add_(x)
        return p.sum()

    with pytest.raises(sg.CaptureError, match=r"sg\.static\(step, donate=\(\.\.\.\)\) names it \(sg\.fuse alone"):
        sg.fuse(step)(torch.ones(3), torch.ones(3))


# --------------------------------------------------------------------------- old values as metrics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["static", "static+fuse"])
def test_the_old_value_of_a_donated_input_as_a_metric_keeps_addresses(device, mode):
    """``return p, new_s, {"old": s}`` with ``s`` donated: the new state goes into ``s``'s
    memory (the old value comes back as a copy), so passing the returned state back keeps
    the addresses the graph was captured with (no recapture, no RetraceWarning) and every
    metric holds what eager gives."""

    def step(p, s, x):
        new = s * 0.9 + x
        return p * 2, new, {"old": s, "new": new}

    f = compiled(step, mode, donate=(0, 1))
    mine = [torch.ones(4, device=device), torch.zeros(4, device=device)]
    ref = [t.clone() for t in mine]
    addresses = [t.data_ptr() for t in mine]
    for call, x in enumerate(batches(device)):
        x = x[0]
        *mine, got = f(*mine, x)
        *ref, want = step(*ref, x)
        assert [t.data_ptr() for t in mine] == addresses, f"call {call}"
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=f"call {call}: {key}")
        torch.testing.assert_close(mine, ref)
    assert got["old"].data_ptr() not in addresses


def test_a_donated_input_returned_only_as_a_metric_keeps_its_place():
    """With no output to take its place, the input returned unchanged is that output (no
    copy, no DonationWarning), as before."""

    def step(s, x):
        return {"old": s, "sum": (s + x).sum()}

    s = torch.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sg.DonationWarning)
        got = sg.static(step, donate="s")(s, torch.ones(4))
    assert got["old"] is s
    assert float(got["sum"]) == 8.0
