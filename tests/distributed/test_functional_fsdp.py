"""sg.functional on an FSDP2 (``fully_shard``) module: 2 CPU processes over gloo.

Both processes run every check once (one spawn for the file, since starting a
process costs seconds); each check's result per rank is then one pytest test.
Reference numbers come from the same model unsharded, on the global batch: rank r
gets rows [3r, 3r + 3) of it, so the mean of the ranks' local-mean gradients is the
global-mean gradient (fp32, rtol 1e-5 for reduction order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from gloo_workers import assert_passed, spawn_checks
from torch import nn

import sgraph as sg

WORLD = 2
ROWS = 3  # per rank

_CHECKS: dict[str, Callable[..., None]] = {}


def _check(fn: Callable[..., None]) -> Callable[..., None]:
    _CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- models


def _reference() -> nn.Module:
    """An MLP whose last layer (5 rows) shards unevenly over 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 5))


def _sharded(reference: nn.Module, mesh, **options) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(reference)
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def _batch() -> torch.Tensor:
    return torch.randn(WORLD * ROWS, 4, generator=torch.Generator().manual_seed(1))


def _local(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * ROWS : (rank + 1) * ROWS]


def _with_user_hooks(model: nn.Module) -> list[str]:
    """Hooks registered after FSDP2's, on its modules: they must keep running, and keep their places."""
    calls: list[str] = []
    for name in ("0", "3"):
        layer = model.get_submodule(name)
        layer.register_forward_pre_hook(lambda module, args, name=name: calls.append(f"pre {name}"))
        layer.register_forward_hook(lambda module, args, out, name=name: calls.append(f"post {name}"))
    return calls


def _hooks(model: nn.Module) -> list[list[tuple[int, object]]]:
    """Every forward hook dict of every submodule, as ordered (id, hook) pairs."""
    names = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_always_called")
    return [list(getattr(m, n).items()) for m in model.modules() for n in names]


def _leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().requires_grad_() for k, v in params.items()}


# --------------------------------------------------------------------------- checks


@_check
def params_are_the_sharded_dtensors(rank: int, mesh) -> None:
    from torch.distributed.tensor import DTensor, Shard

    model = _sharded(_reference(), mesh)
    _, params, buffers = sg.functional(model)
    assert list(params) == [k for k, _ in _reference().named_parameters()] and buffers == {}
    for k, p in params.items():
        own = model.get_parameter(k)
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), k
        assert p is not own and not p.requires_grad, k
        assert p.to_local().data_ptr() == own.to_local().data_ptr(), k


@_check
def output_matches_the_unsharded_model(rank: int, mesh) -> None:
    reference = _reference()
    apply, params, buffers = sg.functional(_sharded(reference, mesh))
    x = _local(_batch(), rank)
    assert torch.equal(apply(params, buffers, x), reference(x))


@_check
def apply_uses_the_params_passed_in(rank: int, mesh) -> None:
    reference = _reference()
    apply, params, buffers = sg.functional(_sharded(reference, mesh))
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(-0.5)
    x = _local(_batch(), rank)
    out = apply({k: -0.5 * p for k, p in params.items()}, buffers, x)
    assert torch.allclose(out, reference(x), rtol=1e-5, atol=1e-6)


@_check
def grads_are_sharded_and_averaged_over_ranks(rank: int, mesh) -> None:
    from torch.distributed.tensor import DTensor, Shard

    reference = _reference()
    model = _sharded(reference, mesh)
    apply, params, buffers = sg.functional(model)
    x = _batch()
    leaves = _leaves(params)
    loss = apply(leaves, buffers, _local(x, rank)).square().mean()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    reference(x).square().mean().backward()
    for k, g in zip(leaves, grads):
        assert isinstance(g, DTensor) and g.placements == (Shard(0),), k
        torch.testing.assert_close(g.full_tensor(), reference.get_parameter(k).grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def _fsdp2_eager_losses(reference: nn.Module, mesh, batches: list[torch.Tensor], rank: int):
    """The FSDP2 training loop itself: forward, backward, torch.optim.SGD."""
    model = _sharded(reference, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = model(_local(x, rank)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: p.full_tensor() for k, p in model.named_parameters()}


def _sgd_step(apply, buffers, opt):
    def step(params, opt_state, x):
        loss, grads = sg.value_and_grad(lambda p: apply(p, buffers, x).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    return step


@_check
def static_step_over_fsdp2_model_matches_fsdp2_training(rank: int, mesh) -> None:
    """No spec: placements come from the DTensor params; hooks are not run; with donation
    the model's own parameters are trained in place, so its state_dict follows."""
    from torch.distributed.tensor import DTensor, Shard

    batches = [torch.randn(WORLD * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want_losses, want = _fsdp2_eager_losses(_reference(), mesh, batches, rank)
    opt = sg.optim.sgd(0.1)
    for donate in ((), ("params", "opt_state")):
        model = _sharded(_reference(), mesh)
        calls = _with_user_hooks(model)
        apply, params, buffers = sg.functional(model)
        before = {k: v.full_tensor() for k, v in model.state_dict().items()}

        step = sg.static(_sgd_step(apply, buffers, opt), donate=donate)
        state = opt.init(params)
        for x, want_loss in zip(batches, want_losses):
            params, state, loss = step(params, state, _local(x, rank))
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
        assert step.trace_count == 1 and calls == ["pre 0", "post 0", "pre 3", "post 3"], (step.trace_count, calls)
        for k, v in want.items():
            assert isinstance(params[k], DTensor) and params[k].placements == (Shard(0),), k
            torch.testing.assert_close(params[k].full_tensor(), v, rtol=1e-5, atol=1e-6)
        trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
        for k in want:
            expected = want[k] if donate else before[k]
            torch.testing.assert_close(trained[k], expected, rtol=1e-5, atol=1e-6)
        out = model(_local(batches[0], rank))  # FSDP2's own forward still works on the model
        assert out.shape == (ROWS, 5)


def _partly_frozen() -> nn.Module:
    """Four frozen tensors, two of each shape: ranks gathering them in different orders
    would swap them silently (same shapes) or fail (different ones)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5))
    for layer in (model[0], model[1]):
        layer.requires_grad_(False)
    return model


@_check
def frozen_params_are_gathered_in_the_same_order_on_every_rank(rank: int, mesh) -> None:
    """Each spawned process draws its own string-hash seed: the frozen tensors' order
    must come from the module, not from a set of their names."""
    from torch.distributed.fsdp import fully_shard

    batches = [torch.randn(WORLD * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    reference = _partly_frozen()
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    want = []
    for x in batches:
        loss = reference(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.detach())
    model = _partly_frozen()
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply, params, buffers = sg.functional(model)
    sgd = sg.optim.sgd(0.1)
    step = sg.static(_sgd_step(apply, buffers, sgd))
    state = sgd.init(params)
    for x, want_loss in zip(batches, want):
        params, state, loss = step(params, state, _local(x, rank))
        got = loss.detach().clone()  # this rank's rows: the mean over ranks is the global loss
        torch.distributed.all_reduce(got)
        torch.testing.assert_close(got / WORLD, want_loss, rtol=1e-5, atol=1e-7)
    for k, v in reference.state_dict().items():
        got = params[k] if k in params else buffers[k]
        torch.testing.assert_close(got.full_tensor(), v, rtol=1e-5, atol=1e-6)


@_check
def an_fsdp2_model_inside_sg_shard_is_refused_clearly(rank: int, mesh) -> None:
    """sg.shard makes the batch a DTensor; FSDP2's forward takes each rank's plain batch."""
    import pytest

    named = sg.mesh(dp=WORLD)
    apply, params, buffers = sg.functional(_sharded(_reference(), named))
    step = sg.static(sg.shard(named, batch=sg.P("dp"))(lambda p, batch: apply(p, buffers, batch).sum()))
    with pytest.raises(sg.UnsupportedError, match=r"FSDP2 \(fully_shard\) module .* got a DTensor input at args\[0\]"):
        step(params, _batch())


@_check
def fsdp_still_works_after_apply(rank: int, mesh) -> None:
    reference = _reference()
    model = _sharded(reference, mesh)
    calls = _with_user_hooks(model)
    hooks = _hooks(model)
    apply, params, buffers = sg.functional(model)
    x = _batch()
    leaves = _leaves(params)
    torch.autograd.grad(apply(leaves, buffers, _local(x, rank)).sum(), list(leaves.values()))
    assert calls == ["pre 0", "post 0", "pre 3", "post 3"]
    assert _hooks(model) == hooks
    out = model(_local(x, rank))
    assert torch.equal(out, reference(_local(x, rank)))
    out.square().mean().backward()
    reference(x).square().mean().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), reference.get_parameter(k).grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(apply(params, buffers, _local(x, rank)), model(_local(x, rank)))


@_check
def hooks_come_back_when_forward_raises(rank: int, mesh) -> None:
    reference = _reference()
    model = _sharded(reference, mesh)
    _with_user_hooks(model)
    hooks = _hooks(model)
    apply, params, buffers = sg.functional(model)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        apply(params, buffers, torch.randn(ROWS, 7))
    assert _hooks(model) == hooks
    x = _local(_batch(), rank)
    assert torch.equal(model(x), reference(x))


@_check
def unsharded_params_are_refused(rank: int, mesh) -> None:
    reference = _reference()
    model = _sharded(reference, mesh)
    x = _local(_batch(), rank)
    model(x)  # FSDP2 keeps the root's parameters unsharded until backward
    with pytest.raises(sg.SgraphError, match=r"sg\.functional: parameter '1\.weight' of an FSDP2 module is unsharded"):
        sg.functional(model)
    model.reshard()
    apply, params, buffers = sg.functional(model)
    assert torch.equal(apply(params, buffers, x), reference(x))


@_check
def mixed_precision_is_refused(rank: int, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _sharded(_reference(), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(sg.SgraphError, match=r"sg\.functional: an FSDP2 module has a MixedPrecisionPolicy"):
        sg.functional(model)


# --------------------------------------------------------------------------- processes


def _mesh(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, str]]:
    return spawn_checks(_CHECKS, WORLD, tmp_path_factory.mktemp("fsdp"), _mesh, seconds=180)


@pytest.mark.parametrize("check", list(_CHECKS))
def test_fsdp(results: list[dict[str, str]], check: str) -> None:
    assert_passed(results, check)
