"""The GELU epilogues of cuBLASLt (``sgraph._src.kernels.cublaslt``) and the MLP op
over them, against ATen, on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgraph._src.kernels import cublaslt
from sgraph._src.kernels.gelu_mlp import gelu_mlp

pytestmark = pytest.mark.gpu
Aten = torch.ops.aten


def close(got, want, tol):
    scale = want.double().abs().max().clamp_min(1e-6)
    err = ((got.double() - want.double()).abs().max() / scale).item()
    assert err < tol, f"error {err:.2e} over {tol:.0e}"


def inputs(n, k, m, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(n, k, device="cuda", generator=g)
    w = torch.randn(m, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(m, device="cuda", generator=g) * 0.5
    return x.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(256, 64, 128), (200, 72, 40), (8192, 512, 2048)])
def test_gelu_matmul_matches_aten(shape, bias, dtype):
    x, w, b = inputs(*shape, dtype)
    b = b if bias else None
    out, pre = cublaslt.gelu_matmul(x, w, b)  # raises if cuBLASLt did not take it
    want_pre = (x.double() @ w.double().t()) + (b.double() if bias else 0)
    close(pre, want_pre, 1e-2)
    close(out, F.gelu(want_pre, approximate="tanh"), 1e-2)
    # Not looser than the ordinary bf16 code against the same reference.
    ordinary = F.gelu(torch.addmm(b, x, w.t()) if bias else x @ w.t(), approximate="tanh")
    ours = (out.double() - F.gelu(want_pre, approximate="tanh")).abs().max()
    theirs = (ordinary.double() - F.gelu(want_pre, approximate="tanh")).abs().max()
    assert ours <= theirs * 1.5 + 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 64, 128), (200, 72, 40), (8192, 512, 2048)])
def test_dgelu_matmul_matches_aten(shape, dtype):
    n, k, m = shape
    grad, _, _ = inputs(n, k, m, dtype)
    _, w, _ = inputs(k, m, k + 1, dtype)  # [k, m]
    pre = inputs(n, m, 3, dtype)[0]
    dh = cublaslt.dgelu_matmul(grad, w[:k, :m].contiguous(), pre)
    want = Aten.gelu_backward(grad.double() @ w[:k, :m].double(), pre.double(), approximate="tanh")
    close(dh, want, 1e-2)


def test_captured_in_a_cuda_graph_and_replayed_on_new_values():
    x, w, b = inputs(512, 128, 256)
    grad = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) / 16
    cublaslt.gelu_matmul(x, w, b)  # plans made outside the capture
    cublaslt.dgelu_matmul(grad, w2, x.new_empty(512, 256).normal_())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, pre = cublaslt.gelu_matmul(x, w, b)
        dh = cublaslt.dgelu_matmul(grad, w2, pre)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        grad.copy_(torch.randn_like(grad))
        graph.replay()
        want_pre = x.double() @ w.double().t() + b.double()
        close(out, F.gelu(want_pre, approximate="tanh"), 1e-2)
        want = Aten.gelu_backward(grad.double() @ w2.double(), pre.double(), approximate="tanh")
        close(dh, want, 1e-2)


def test_unaligned_or_strided_inputs_fall_back_to_aten():
    x, w, b = inputs(257, 64, 128)
    shifted = x.view(-1)[1 : 1 + 256 * 64].view(256, 64)  # 2 bytes off 16
    with pytest.raises(cublaslt.Unsupported):
        cublaslt.gelu_matmul(shifted, w, b)
    g, h = torch.ops.sgraph.gelu_linear(shifted, w, b)
    close(h, shifted.double() @ w.double().t() + b.double(), 1e-2)
    g, h = torch.ops.sgraph.gelu_linear(x[:, :32], w[:, :32], b)  # strided x
    close(h, x[:, :32].double() @ w[:, :32].double().t() + b.double(), 1e-2)


@pytest.mark.parametrize("biases", [(True, True), (False, True), (True, False)])
def test_gelu_mlp_forward_and_gradients_match_autograd(biases):
    x, w1, b1 = inputs(1024, 256, 1024)
    _, w2, b2 = inputs(7, 1024, 256)
    b1 = b1 if biases[0] else None
    b2 = b2 if biases[1] else None
    leaves = [t for t in (x, w1, b1, w2, b2) if t is not None]
    dy = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)

    def run(fn, dtype):
        args = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x, w1, b1, w2, b2)]
        y = fn(*args)
        grads = torch.autograd.grad(y, [a for a in args if a is not None], dy.to(dtype))
        return [y, *grads]

    def ordinary(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    ours = run(gelu_mlp, torch.bfloat16)
    exact = run(ordinary, torch.float64)
    low = run(ordinary, torch.bfloat16)
    assert len(ours) == len(leaves) + 1
    for a, e, o in zip(ours, exact, low):
        close(a, e, 2e-2)
        assert (a.double() - e).abs().max() <= (o.double() - e).abs().max() * 2 + 1e-3


def test_a_gpt_step_runs_its_mlps_on_cublaslt_inside_the_cuda_graph(monkeypatch):
    """The benchmark GPT's blocks (tanh GELU MLPs) under bf16 autocast: every block's MLP
    on the own ops, their cuBLASLt path taken (not the ATen fallback) on the first call
    and replayed in the graph after it, the losses of the captured, donated step as
    eager's over 20 steps."""
    import copy

    from models_for_tests import bf16_gpt_steps

    model, batches, params, opt, plain, fused = bf16_gpt_steps(20)
    state = opt.init(params)
    ops = [str(n.target) for n in fused.lower(params, state, batches[0]).program.ops()]
    blocks = len(model.blocks)
    assert ops.count("sgraph.gelu_linear.default") == blocks
    assert ops.count("sgraph.gelu_linear_backward.default") == blocks
    assert "aten.gelu.default" not in ops
    calls = []

    def counting(name, real):
        def counted(*args):
            calls.append(name)
            return real(*args)

        return counted

    for name in ("gelu_matmul", "dgelu_matmul"):
        monkeypatch.setattr(cublaslt, name, counting(name, getattr(cublaslt, name)))
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    losses, eager = [], []
    for i, batch in enumerate(batches):
        params, state, metrics = fused(params, state, batch)
        eager_params, eager_state, eager_metrics = plain(eager_params, eager_state, batch)
        losses.append(metrics["loss"])
        eager.append(eager_metrics["loss"])
        if i == 0:  # the first call's run and its capture called cuBLASLt; replays do not call Python
            first = list(calls)
            assert first.count("gelu_matmul") >= blocks and first.count("dgelu_matmul") >= blocks
    assert calls == first
    assert fused.last_compiled.stats.runtime == "inductor+cudagraph"
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-2, atol=0)
