"""sg.fuse's ``"gelu_mlp"`` pattern: an ordinary ``linear -> tanh GELU -> linear`` MLP in
bf16 runs on the own ops (the GELU in cuBLASLt's matmul epilogues on a GPU). Matched on
CUDA tensors only; here the pattern is let match CPU tensors too, where the own ops are
their ATen fallback, and the lowered programs run on eager kernels (no Inductor
compile) against the same step run eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sgraph as sg
from sgraph._src import patterns
from sgraph._src.runtime.eager import EagerExecutable

D, H = 16, 32


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(patterns, "GELU_MLP_DEVICES", ("cpu",))


def mlp_params(dtype, seed=0, bias1=True, bias2=True):
    g = torch.Generator().manual_seed(seed)
    p = {
        "w1": torch.randn(H, D, generator=g) / D**0.5,
        "b1": 0.1 * torch.randn(H, generator=g),
        "w2": torch.randn(D, H, generator=g) / H**0.5,
        "b2": 0.1 * torch.randn(D, generator=g),
    }
    if not bias1:
        del p["b1"]
    if not bias2:
        del p["b2"]
    return {k: v.to(dtype) for k, v in p.items()}


def batch(seed=1, shape=(3, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, D, generator=g), torch.randn(*shape, D, generator=g)


def mlp(p, x, approximate="tanh"):
    h = F.linear(x, p["w1"], p.get("b1"))
    return F.linear(F.gelu(h, approximate=approximate), p["w2"], p.get("b2"))


def sgd_step(loss_fn, autocast=False):
    def step(params, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        return {k: p - 0.1 * grads[k].to(p.dtype) for k, p in params.items()}, loss

    return step


def residual_loss(p, b, **kw):
    x, y = b
    return ((x + mlp(p, x, **kw)).float() - y).pow(2).mean()


def lowered_and_run(step, *args, **fuse):
    lowered = sg.fuse(step, **fuse).lower(*args)
    return lowered, sg.Compiled(lowered, EagerExecutable(lowered.program))(*args)


def targets(lowered):
    return [str(n.target) for n in lowered.program.ops()]


def check_matches_eager(step, params, b, rtol):
    lowered, (new, loss) = lowered_and_run(step, params, b)
    want_new, want_loss = step(params, b)
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=1e-6)
    for k in want_new:
        torch.testing.assert_close(new[k], want_new[k], rtol=rtol, atol=rtol, msg=k)
    return lowered


@pytest.mark.parametrize("biases", [(True, True), (False, True), (True, False), (False, False)])
def test_a_bf16_mlp_runs_on_the_own_ops_and_matches_eager(on_cpu, biases):
    params, b = mlp_params(torch.bfloat16, bias1=biases[0], bias2=biases[1]), batch()
    b = tuple(t.bfloat16() for t in b)
    lowered = check_matches_eager(sgd_step(residual_loss), params, b, rtol=2e-2)
    ops = targets(lowered)
    assert ops.count("sgraph.gelu_linear.default") == 1
    assert ops.count("sgraph.gelu_linear_backward.default") == 1
    assert not {"aten.gelu.default", "aten.gelu_backward.default"} & set(ops)


def test_under_autocast_with_fp32_params_and_several_steps(on_cpu):
    params, b = mlp_params(torch.float32), batch(shape=(2, 8))
    step = sgd_step(residual_loss, autocast=True)
    fused = sg.fuse(step)
    assert "sgraph.gelu_linear.default" in targets(fused.lower(params, b))
    ours, theirs = params, params
    for i in range(3):
        b = batch(seed=10 + i, shape=(2, 8))
        ours, loss = fused(ours, b)
        theirs, want = step(theirs, b)
        torch.testing.assert_close(loss, want, rtol=2e-2, atol=1e-4)
    for k in theirs:
        assert ours[k].dtype == torch.float32
        torch.testing.assert_close(ours[k], theirs[k], rtol=2e-2, atol=2e-3, msg=k)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, H)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(H, D)

    def forward(self, x):
        return x + self.out(self.act(self.fc(self.ln(x))))


def test_an_nn_module_mlp_through_sg_functional_is_matched(on_cpu):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    apply, params, _ = sg.functional(model)

    def loss_fn(p, b):
        return (apply(p, {}, b[0]).float() - b[1]).pow(2).mean()

    lowered = check_matches_eager(sgd_step(loss_fn, autocast=True), dict(params), batch(), rtol=2e-2)
    assert targets(lowered).count("sgraph.gelu_linear.default") == 2


def test_uses_of_the_hidden_activations_elsewhere_keep_their_ops(on_cpu):
    params, b = mlp_params(torch.bfloat16), tuple(t.bfloat16() for t in batch())

    def loss_fn(p, b):
        h = F.linear(b[0], p["w1"], p["b1"])
        g = F.gelu(h, approximate="tanh")
        y = F.linear(g, p["w2"], p["b2"])
        return (y.float() - b[1]).pow(2).mean() + 0.1 * h.float().pow(2).mean() + 0.1 * g.float().mean()

    lowered = check_matches_eager(sgd_step(loss_fn), params, b, rtol=2e-2)
    ops = targets(lowered)
    assert "sgraph.gelu_linear.default" in ops and "aten.gelu.default" in ops


@pytest.mark.parametrize(
    "why",
    ["exact GELU", "fp32", "kernels off", "not a CUDA tensor", "memory plan", "width not a multiple of 8"],
)
def test_left_as_written(monkeypatch, why):
    if why != "not a CUDA tensor":
        monkeypatch.setattr(patterns, "GELU_MLP_DEVICES", ("cpu",))
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    params, b = mlp_params(dtype), tuple(t.to(dtype) for t in batch())
    loss_fn = residual_loss
    if why == "exact GELU":

        def loss_fn(p, b):
            return residual_loss(p, b, approximate="none")

    if why == "width not a multiple of 8":
        params = {"w1": params["w1"][:12], "b1": params["b1"][:12], "w2": params["w2"][:, :12]}
    step = sgd_step(loss_fn)
    fuse = {"kernels": ("adamw",)} if why == "kernels off" else {}
    fused = sg.fuse(step, **fuse)
    if why == "memory plan":
        fused = sg.plan_memory(fused)
    lowered = fused.lower(params, b)
    assert "sgraph.gelu_linear.default" not in targets(lowered)
    assert "aten.gelu.default" in targets(lowered)


def _write_h(p, x):
    h = F.linear(x, p["w1"], p["b1"]).mul_(2)
    return F.linear(F.gelu(h, approximate="tanh"), p["w2"], p["b2"])


def _write_g(p, x):
    g = F.gelu(F.linear(x, p["w1"], p["b1"]), approximate="tanh")
    g.mul_(3)
    return F.linear(g, p["w2"], p["b2"])


def _write_b1_after_the_first_linear(p, x):
    b1 = p["b1"].clone()
    g = F.gelu(F.linear(x, p["w1"], b1), approximate="tanh")
    b1.add_(5)
    return F.linear(g, p["w2"], p["b2"])


@pytest.mark.parametrize("mlp_fn", [_write_h, _write_g, _write_b1_after_the_first_linear])
def test_an_mlp_written_in_place_on_the_way_is_not_matched(on_cpu, mlp_fn):
    """The own kernel computes ``h`` and ``g`` from ``x`` and the weights again: after an
    in-place write on the way, it would not compute what the code did."""
    params, b = mlp_params(torch.bfloat16), tuple(t.bfloat16() for t in batch())

    def loss_fn(p, b):
        return ((b[0] + mlp_fn(p, b[0])).float() - b[1]).pow(2).mean()

    lowered = check_matches_eager(sgd_step(loss_fn), params, b, rtol=2e-2)
    assert "sgraph.gelu_linear.default" not in targets(lowered)


def test_one_hidden_activation_feeding_two_linears_matches_eager(on_cpu):
    params, b = mlp_params(torch.bfloat16), tuple(t.bfloat16() for t in batch())
    w3 = params["w2"].flip(0).contiguous()

    def loss_fn(p, b):
        g = F.gelu(F.linear(b[0], p["w1"], p["b1"]), approximate="tanh")
        y = F.linear(g, p["w2"], p["b2"]) + F.linear(g, w3)
        return (y.float() - b[1]).pow(2).mean()

    lowered = check_matches_eager(sgd_step(loss_fn), params, b, rtol=2e-2)
    assert targets(lowered).count("sgraph.gelu_linear.default") == 2


def test_a_gradient_penalty_differentiates_through_the_matched_mlp(on_cpu):
    """An outer sg.grad over an inner one (a gradient penalty): the own ops have no
    derivatives, so the differentiated backward takes the ordinary ops' gradients."""
    params, b = mlp_params(torch.bfloat16), tuple(t.bfloat16() for t in batch())

    def penalized(p, b):
        grads = sg.grad(residual_loss)(p, b)
        return residual_loss(p, b) + sum(g.float().pow(2).sum() for g in grads.values())

    lowered = check_matches_eager(sgd_step(penalized), params, b, rtol=3e-2)
    assert "sgraph.gelu_linear.default" in targets(lowered)


def test_the_own_ops_compile_through_inductor(on_cpu):
    """The lowered step compiled by Inductor (its C++ backend here), the own ops called
    from the generated code, a missing bias passed as None."""
    params = mlp_params(torch.bfloat16, bias1=False)
    b = tuple(t.bfloat16() for t in batch())
    step = sgd_step(residual_loss)
    fused = sg.fuse(step)
    (new, loss), (want_new, want) = fused(params, b), step(params, b)
    assert fused.last_compiled.stats.runtime == "inductor"
    assert "sgraph.gelu_linear.default" in targets(fused.last_compiled.lowered)
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=1e-6)
    for k in want_new:
        torch.testing.assert_close(new[k], want_new[k], rtol=2e-2, atol=2e-2, msg=k)


def test_the_memory_analysis_counts_a_cublaslt_workspace_on_a_gpu_only():
    from types import SimpleNamespace

    from sgraph._src.kernels import cublaslt, scratch_bytes

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    for op in ("sgraph::gelu_linear", "sgraph::gelu_linear_backward"):
        assert scratch_bytes(op, [on_gpu]) == [(cublaslt.WORKSPACE_BYTES, "cuBLASLt workspace")]
        assert scratch_bytes(op, [torch.empty(2, 2)]) == []
