"""sg.functional: a module as a pure function, checked against eager PyTorch.

Numerics are bitwise: ``apply`` runs the module's own forward on the same tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import sgraph as sg


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


class _Tied(nn.Module):
    """An embedding and an output head sharing one Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


class _Counter(nn.Module):
    """Writes one buffer in place and reassigns another in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("last_mean", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.last_mean = x.mean(0)
        return self.lin(x)


def _leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().requires_grad_() for k, v in params.items()}


def _snapshot(module: nn.Module) -> dict[str, tuple[object, int, torch.Tensor]]:
    """Identity, version counter and value of every parameter and buffer."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {k: (t, t._version, t.detach().clone()) for k, t in named}


def _assert_unchanged(module: nn.Module, before: dict[str, tuple[object, int, torch.Tensor]]) -> None:
    after = _snapshot(module)
    assert after.keys() == before.keys()
    for k, (t, version, value) in before.items():
        assert after[k][0] is t, k
        assert after[k][1] == version, k
        assert torch.equal(after[k][2], value), k


# --------------------------------------------------------------------------- plain modules


def test_params_and_buffers_share_storage_with_the_module():
    model = _bn_net()
    _, params, buffers = sg.functional(model)
    assert list(params) == [k for k, _ in model.named_parameters()]
    assert list(buffers) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    for k, p in params.items():
        assert p is not model.get_parameter(k) and not p.requires_grad
        assert p.data_ptr() == model.get_parameter(k).data_ptr()
    assert buffers["1.running_var"].data_ptr() == model[1].running_var.data_ptr()


def test_mlp_output_is_bitwise_eager():
    model = _mlp()
    apply, params, buffers = sg.functional(model)
    x = torch.randn(5, 4)
    out = apply(params, buffers, x)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, model(x))


def test_apply_uses_the_tensors_passed_in():
    model = _mlp()
    apply, params, buffers = sg.functional(model)
    doubled = {k: 2 * v for k, v in params.items()}
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2)
    x = torch.randn(5, 4)
    assert torch.equal(apply(doubled, buffers, x), reference(x))


def test_grads_through_apply_equal_backward():
    model = _mlp()
    apply, params, buffers = sg.functional(model)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    leaves = _leaves(params)
    loss = (apply(leaves, buffers, x) - y).square().mean()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    (model(x) - y).square().mean().backward()
    for k, g in zip(leaves, grads):
        assert torch.equal(g, model.get_parameter(k).grad), k


def test_apply_never_writes_the_module():
    model = _bn_net()
    hook_ids = list(model._forward_hooks)
    apply, params, buffers = sg.functional(model)
    before = _snapshot(model)
    leaves = _leaves(params)
    out, _ = apply(leaves, buffers, torch.randn(5, 4))
    torch.autograd.grad(out.sum(), list(leaves.values()))
    _assert_unchanged(model, before)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert list(model._forward_hooks) == hook_ids


def test_apply_never_writes_the_dicts_passed_in():
    model = _Counter()
    apply, params, buffers = sg.functional(model, return_buffers=True)
    params_in, buffers_in = dict(params), dict(buffers)
    versions = {k: b._version for k, b in buffers.items()}
    apply(params, buffers, torch.randn(4, 3))
    assert params == params_in and buffers == buffers_in
    assert {k: b._version for k, b in buffers.items()} == versions
    assert int(buffers["calls"]) == 0


def test_user_forward_hooks_still_run():
    model = _mlp()
    model.register_forward_hook(lambda module, args, out: out * 3)
    apply, params, buffers = sg.functional(model)
    x = torch.randn(2, 4)
    assert torch.equal(apply(params, buffers, x), model(x))


# --------------------------------------------------------------------------- buffers


def test_batchnorm_running_stats_match_eager_after_three_steps():
    model = _bn_net()
    reference = copy.deepcopy(model)
    apply, params, buffers = sg.functional(model)
    initial = {k: (b.clone(), b._version) for k, b in buffers.items()}
    state = buffers
    for step in range(3):
        x = torch.randn(7, 4, generator=torch.Generator().manual_seed(step))
        out, new_state = apply(params, state, x)
        assert torch.equal(out, reference(x))
        assert all(new_state[k] is not state[k] for k in state)  # every BatchNorm buffer was updated
        state = new_state
    for k, b in state.items():
        assert torch.equal(b, reference.get_buffer(k)), k
    assert int(state["1.num_batches_tracked"]) == 3
    for k, (value, version) in initial.items():
        assert torch.equal(buffers[k], value) and buffers[k]._version == version, k


def test_eval_mode_keeps_the_output_type_and_buffers():
    model = _bn_net()
    apply, params, buffers = sg.functional(model)
    model.eval()
    x = torch.randn(3, 4)
    result = apply(params, buffers, x)
    assert isinstance(result, tuple) and len(result) == 2
    out, new_buffers = result
    assert torch.equal(out, model(x))
    assert all(new_buffers[k] is buffers[k] for k in buffers)


def test_return_buffers_is_automatic():
    assert sg.functional(_mlp())[0].return_buffers is False
    assert sg.functional(_bn_net())[0].return_buffers is True
    assert sg.functional(nn.BatchNorm1d(3, track_running_stats=False))[0].return_buffers is False
    apply, params, buffers = sg.functional(_mlp(), return_buffers=True)
    out, new_buffers = apply(params, buffers, torch.randn(2, 4))
    assert out.shape == (2, 3) and new_buffers == {}


def test_return_buffers_false_on_batchnorm_raises():
    model = _bn_net()
    apply, params, buffers = sg.functional(model, return_buffers=False)
    before = {k: b.clone() for k, b in buffers.items()}
    with pytest.raises(ValueError, match=r"wrote buffer\(s\) '1\.running_mean'.*return_buffers=True"):
        apply(params, buffers, torch.randn(5, 4))
    assert all(torch.equal(buffers[k], v) for k, v in before.items())
    model.eval()  # nothing is written in eval mode, so the same apply runs
    assert isinstance(apply(params, buffers, torch.randn(5, 4)), torch.Tensor)


class _Branches(nn.Module):
    """Two BatchNorm layers in train mode, of which forward runs only the one asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor, *, branch: str) -> torch.Tensor:
        return getattr(self, branch)(x)


def test_only_the_batchnorm_layers_that_ran_are_written():
    model = _Branches()
    apply, params, buffers = sg.functional(model)
    x = torch.randn(4, 3)
    out, new_buffers = apply(params, buffers, x, branch="b")
    assert torch.equal(out, copy.deepcopy(model).b(x))
    assert all(new_buffers[k] is buffers[k] for k in buffers if k.startswith("a."))
    assert all(new_buffers[k] is not buffers[k] for k in buffers if k.startswith("b."))
    strict, params, buffers = sg.functional(model, return_buffers=False)
    with pytest.raises(
        ValueError, match=r"wrote buffer\(s\) 'a\.running_mean', 'a\.running_var', 'a\.num_batches_tracked' in"
    ):
        strict(params, buffers, x, branch="a")


def test_buffers_written_by_a_custom_module():
    x = torch.randn(4, 3)
    apply, params, buffers = sg.functional(_Counter())  # automatic: no BatchNorm, so no buffers returned
    with pytest.raises(
        sg.SgraphError,
        match=r"wrote buffer\(s\) 'calls', 'last_mean' in forward \(the tensors passed as buffers 'calls' have been "
        r"written too\), but this apply was made with return_buffers=False.*sg\.functional\(module, return_buffers=True\)",  # noqa: E501
    ):
        apply(params, buffers, x)
    model = _Counter()
    apply, params, buffers = sg.functional(model, return_buffers=True)
    out, new_buffers = apply(params, buffers, x)
    assert torch.equal(out, model.lin(x))
    assert int(new_buffers["calls"]) == 1 and int(buffers["calls"]) == 0
    assert torch.equal(new_buffers["last_mean"], x.mean(0)) and not buffers["last_mean"].any()


# --------------------------------------------------------------------------- tied weights


def test_tied_weights_are_one_leaf():
    model = _Tied()
    apply, params, _ = sg.functional(model)
    assert list(params) == ["emb.weight"]
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    leaves = _leaves(params)
    out = apply(leaves, {}, ids)
    assert torch.equal(out, model(ids))
    (grad,) = torch.autograd.grad(out.square().sum(), [leaves["emb.weight"]])
    model(ids).square().sum().backward()
    assert torch.equal(grad, model.emb.weight.grad)  # the sum of both uses


def test_tied_leaf_reaches_both_uses():
    model = _Tied()
    apply, params, _ = sg.functional(model)
    ids = torch.tensor([[0, 7]])
    replaced = torch.randn(10, 8)
    emb = torch.tanh(replaced[ids])
    assert torch.equal(apply({"emb.weight": replaced}, {}, ids), emb @ replaced.T)


@pytest.mark.parametrize("static", [False, True])
def test_a_submodule_under_two_names_is_left_as_it_was(static):
    torch.manual_seed(0)
    lin, norm = nn.Linear(3, 3), nn.BatchNorm1d(3)
    model = nn.Sequential(lin, norm, nn.Tanh(), lin, norm)
    x = torch.randn(4, 3)
    model(x).sum().backward()  # the module's own grads must survive too
    before, grads = _snapshot(model), [p.grad.clone() for p in model.parameters()]
    apply, params, buffers = sg.functional(model)
    assert list(params) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    new = {k: torch.randn_like(v) for k, v in params.items()}
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for k, v in new.items():
            reference.get_parameter(k).copy_(v)
    expected, expected_grads = reference(x), torch.autograd.grad(reference(x).sum(), list(reference.parameters()))

    def loss(params, buffers, x):
        out, _ = apply(params, buffers, x)
        return out.sum(), out

    def step(params, buffers, x):
        (_, out), grads = sg.value_and_grad(loss, has_aux=True)(params, buffers, x)
        return out, grads

    run = sg.static(step) if static else step
    for _ in range(2):
        out, got = run(new, buffers, x)
        _assert_unchanged(model, before)
        assert all(type(p) is nn.Parameter and p.requires_grad for p in model.parameters())
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        torch.testing.assert_close(out, expected.detach())
        for k, g in zip(params, expected_grads):
            torch.testing.assert_close(got[k], g)  # the sum of both uses


@pytest.mark.parametrize("static", [False, True])
def test_frozen_parameters_are_passed_as_buffers_and_stay_as_they_are(static):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    frozen = model[0].weight.detach().clone()
    apply, params, buffers = sg.functional(model)
    assert list(params) == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert list(buffers)[:2] == ["0.weight", "0.bias"] and "1.running_mean" in buffers
    opt = sg.optim.adamw(0.1, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)

    def step(params, buffers, opt_state, x, y):
        def loss_fn(params):
            out, new_buffers = apply(params, buffers, x)
            return nn.functional.mse_loss(out, y), new_buffers

        (loss, buffers), grads = sg.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), buffers, opt_state, loss

    run = sg.static(step, donate=("params", "buffers", "opt_state")) if static else step
    opt_state = opt.init(params)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        params, buffers, opt_state, loss = run(params, buffers, opt_state, x, y)
        torch_opt.zero_grad()
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        torch_opt.step()
        torch.testing.assert_close(loss, expected.detach())
    assert torch.equal(model[0].weight, frozen) and torch.equal(buffers["0.weight"], frozen)
    for name, p in reference.named_parameters():
        torch.testing.assert_close({**params, **buffers}[name], p.detach())


# --------------------------------------------------------------------------- errors


def test_missing_key_names_it():
    apply, params, buffers = sg.functional(_mlp())
    del params["0.weight"]
    with pytest.raises(
        ValueError, match=r"apply: params is missing '0\.weight'; pass the dict returned by sg\.functional"
    ):
        apply(params, buffers, torch.randn(1, 4))


def test_unexpected_key_names_it():
    apply, params, buffers = sg.functional(_bn_net())
    with pytest.raises(sg.TreeStructureError, match=r"apply: buffers has unexpected key\(s\) 'extra'"):
        apply(params, {**buffers, "extra": torch.zeros(1)}, torch.randn(2, 4))


def test_wrong_shape_names_the_path():
    apply, params, buffers = sg.functional(_mlp())
    params["2.bias"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"apply: params\['2\.bias'\] has shape \(4,\), expected \(3,\)"):
        apply(params, buffers, torch.randn(1, 4))


def test_wrong_types_are_named():
    apply, params, buffers = sg.functional(_mlp())
    with pytest.raises(sg.TreeStructureError, match=r"apply: params must be a dict .* found list"):
        apply(list(params.values()), buffers, torch.randn(1, 4))
    with pytest.raises(
        TypeError, match=r"apply: params\['0\.bias'\] must be a torch\.Tensor of shape \(8,\), found float"
    ):
        apply({**params, "0.bias": 0.0}, buffers, torch.randn(1, 4))
    with pytest.raises(TypeError, match=r"sg\.functional: module must be a torch\.nn\.Module, found function"):
        sg.functional(lambda x: x)
    with pytest.raises(TypeError, match=r"sg\.functional: return_buffers must be True, False or None"):
        sg.functional(_mlp(), return_buffers="auto")


# --------------------------------------------------------------------------- tracing


def test_make_fx_traces_apply_and_autograd_grad():
    model = _bn_net()
    reference = copy.deepcopy(model)
    apply, params, buffers = sg.functional(model)
    before = _snapshot(model)

    def step(params, buffers, x):
        out, new_buffers = apply(params, buffers, x)
        grads = torch.autograd.grad(out.square().mean(), list(params.values()))
        return grads, new_buffers

    x = torch.randn(6, 4)
    gm = make_fx(step, tracing_mode="fake")(_leaves(params), buffers, x)
    assert any("native_batch_norm" in str(n.target) for n in gm.graph.nodes)
    _assert_unchanged(model, before)
    grads, new_buffers = gm(_leaves(params), buffers, x)
    reference(x).square().mean().backward()
    for g, (k, p) in zip(grads, reference.named_parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7), k
    for k, b in new_buffers.items():
        assert torch.equal(b, reference.get_buffer(k)), k
    _assert_unchanged(model, before)
