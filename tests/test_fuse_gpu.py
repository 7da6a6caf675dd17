"""sg.fuse on a GPU: generated Triton kernels, captured by sg.static as one CUDA graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from models_for_tests import (
    GPT,
    GPTConfig,
    bf16_gpt_steps,
    cuda_bf16_autocast,
    gpt_loss,
    small_model_and_batches,
    train_step_fn,
)

import sgraph as sg

pytestmark = pytest.mark.gpu


def run_both(kind, steps, bf16, reuse_blocks=False):
    model, batches, loss = small_model_and_batches(kind, steps)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    plain = train_step_fn(apply, loss, opt, autocast=cuda_bf16_autocast(bf16))
    fused = sg.static(sg.fuse(reuse_blocks=reuse_blocks)(plain), donate=("params", "opt_state"))
    state = opt.init(params)
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    addresses = {k: (v.data_ptr(), id(v)) for k, v in params.items()}
    losses, eager_losses = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        params, state, metrics = fused(params, state, batch)
        eager_params, eager_state, eager_metrics = plain(eager_params, eager_state, batch)
        losses.append(metrics["loss"])
        eager_losses.append(eager_metrics["loss"])
    assert all((v.data_ptr(), id(v)) == addresses[k] for k, v in params.items())
    return fused, torch.stack(losses), torch.stack(eager_losses)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fp32_losses_match_eager_over_50_steps_in_one_capture(kind):
    fused, losses, eager = run_both(kind, 50, bf16=False)
    torch.testing.assert_close(losses, eager, rtol=1e-5, atol=0)
    stats = fused.last_compiled.stats
    assert stats.runtime == "inductor+cudagraph" and stats.traces == 1
    assert fused.last_compiled.executable.captures == 1 and stats.calls == 50
    assert stats.kernel_launches and stats.kernels_fused and stats.compile_seconds
    assert stats.inductor_entry == "direct"  # below AOTAutograd


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_bf16_autocast_losses_within_1e_2_over_100_steps(kind):
    _, losses, eager = run_both(kind, 100, bf16=True)
    torch.testing.assert_close(losses, eager, rtol=1e-2, atol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_reused_blocks_match_eager_in_one_capture(bf16):
    """The small GPT's two blocks, forward and backward, compiled once and called twice:
    fp32 over 50 steps within 1e-5, bf16 autocast over 100 steps within 1e-2."""
    fused, losses, eager = run_both("gpt", 100 if bf16 else 50, bf16=bf16, reuse_blocks=True)
    torch.testing.assert_close(losses, eager, rtol=1e-2 if bf16 else 1e-5, atol=0)
    stats = fused.last_compiled.stats
    assert (stats.block_calls, stats.block_subgraphs) == (4, 2)
    assert fused.last_compiled.executable.captures == 1 and stats.kernel_launches
    assert stats.inductor_entry == "direct"


def test_fused_graph_launches_fewer_kernels_than_the_eager_kernel_graph():
    model, batches, loss = small_model_and_batches("gpt")
    apply, params, _ = sg.functional(model)
    opt = sg.optim.adamw(1e-3)
    plain = train_step_fn(apply, loss, opt, autocast=cuda_bf16_autocast(True))
    counts = {}
    for name, step in (("static", sg.static(plain)), ("fuse", sg.static(sg.fuse(plain)))):
        p = {k: v.clone() for k, v in params.items()}
        step(p, opt.init(p), batches[0])
        step(p, opt.init(p), batches[0])
        counts[name] = step.last_compiled.stats.kernel_launches
    assert counts["fuse"] < counts["static"], counts
    text = step.last_compiled.as_text()
    assert "triton_" in text and "kernels (" in text


def test_dropout_masks_differ_between_replays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).cuda()
    apply, params, buffers = sg.functional(model)

    @sg.static
    @sg.fuse
    def forward(params, x):
        return apply(params, buffers, x)

    x = torch.randn(8, 64, device="cuda")
    outs = [forward(params, x) for _ in range(4)]
    zeros = [(o == 0) for o in outs]
    assert all(not torch.equal(zeros[0], z) for z in zeros[1:])
    assert 0.3 < zeros[-1].float().mean().item() < 0.7
    assert forward.last_compiled.executable.captures == 1


def test_fuse_alone_runs_generated_kernels_without_a_graph():
    model, batches, loss = small_model_and_batches("mlp")
    apply, params, _ = sg.functional(model)
    opt = sg.optim.sgd(0.1)
    plain = train_step_fn(apply, loss, opt, autocast=cuda_bf16_autocast(False))
    fused = sg.fuse(plain)
    state = opt.init(params)
    before = {k: v.clone() for k, v in params.items()}
    new, state2, metrics = fused(params, state, batches[0])
    ref = plain(before, opt.init(before), batches[0])
    torch.testing.assert_close(metrics["loss"], ref[2]["loss"], rtol=1e-5, atol=0)
    assert all(torch.equal(params[k], before[k]) for k in params)  # nothing donated: inputs untouched
    assert fused.last_compiled.stats.runtime == "inductor"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_fused_cross_entropy_inside_the_cuda_graph_matches_eager(bf16):
    """A vocabulary large enough for the own linear + cross-entropy kernel (Triton rows
    kernel, chunked matmuls) inside the captured graph, against the same step eagerly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=2048, d=64, layers=1, heads=2, seq=32)).cuda()
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    plain = train_step_fn(apply, gpt_loss, opt, autocast=cuda_bf16_autocast(bf16))
    fused = sg.static(sg.fuse(plain), donate=("params", "opt_state"))
    state = opt.init(params)
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    for _ in range(20):
        batch = (torch.randint(0, 2048, (4, 32), device="cuda"), torch.randint(0, 2048, (4, 32), device="cuda"))
        params, state, metrics = fused(params, state, batch)
        eager_params, eager_state, eager_metrics = plain(eager_params, eager_state, batch)
        torch.testing.assert_close(metrics["loss"], eager_metrics["loss"], rtol=1e-2 if bf16 else 1e-5, atol=0)
    ops = {str(n.target) for n in fused.last_compiled.program.ops()}
    assert "sgraph.linear_cross_entropy.default" in ops
    assert fused.last_compiled.executable.captures == 1


def test_compile_workers_are_asked_to_start_before_the_step_is_traced(monkeypatch):
    import torch._inductor.async_compile as async_compile

    events = []
    warm = async_compile.maybe_warm_pool
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: (events.append("workers"), warm()))

    def step(x):
        events.append("traced")
        return (x * 3).sum()

    x = torch.randn(8, device="cuda")
    torch.testing.assert_close(sg.fuse(step)(x), (x * 3).sum())
    assert events[:2] == ["workers", "traced"]


def test_the_update_reads_bf16_weight_grads_with_the_own_kernel_in_the_graph():
    """Under bf16 autocast the weights' grads reach the AdamW update in bf16, without
    fp32 copies, and the own multi-tensor kernel runs inside the captured graph, the
    losses as eager's. (Own kernel on and off are not compared param by param: the two
    graphs fuse the backward differently, and Adam turns a last-bit difference of a
    near-zero bf16 gradient into one of O(lr).)"""
    _, batches, params, opt, plain, fused = bf16_gpt_steps(20)
    off = sg.static(sg.fuse(kernels=("linear_cross_entropy",))(plain), donate=("params", "opt_state"))
    state = opt.init(params)
    update = torch.ops.sgraph.adamw_.default
    for step, dtypes in ((fused, {torch.bfloat16, torch.float32}), (off, {torch.float32})):
        nodes = step.lower(params, state, batches[0]).program.graph.nodes
        assert {g.meta["val"].dtype for n in nodes if n.target is update for g in n.args[1]} == dtypes
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    losses, eager = [], []
    for batch in batches:
        params, state, metrics = fused(params, state, batch)
        eager_params, eager_state, eager_metrics = plain(eager_params, eager_state, batch)
        losses.append(metrics["loss"])
        eager.append(eager_metrics["loss"])
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-2, atol=0)
    # the kernel's tables (one launch per grad dtype: bf16, fp32), copied into the graph
    # from pinned memory, live with the graph: pinned and device copy of each
    assert len(fused.last_compiled.executable.kept_alive) == 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused(params, state, batches[0])
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert any("adamw_lists" in n for n in names), sorted(names)


def test_an_update_of_inputs_not_donated_writes_new_tensors_from_the_own_kernel():
    """Nothing donated under bf16 autocast: the functional update (``sgraph::adamw``) runs
    the own kernel out of place, writing the new params and moments without first
    cloning the old ones; every call leaves the params and state it was given as they
    were, and the losses follow eager's. (Copies are counted on ``sg.fuse`` alone: a
    CUDA graph's runtime copies inputs it does not own in and its outputs out.)"""
    _, batches, params, opt, plain, _ = bf16_gpt_steps(12)
    kept = sg.static(sg.fuse(plain))
    state = opt.init(params)
    nodes = kept.lower(params, state, batches[0]).program.graph.nodes
    assert any(n.target is torch.ops.sgraph.adamw.default for n in nodes)
    assert not any(n.target is torch.ops.sgraph.adamw_.default for n in nodes)
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    losses, eager = [], []
    for batch in batches:
        before = copy.deepcopy((params, state))
        new_params, new_state, metrics = kept(params, state, batch)
        assert all(torch.equal(a, b) for a, b in zip(sg.tree.leaves((params, state)), sg.tree.leaves(before)))
        params, state = new_params, new_state
        eager_params, eager_state, eager_metrics = plain(eager_params, eager_state, batch)
        losses.append(metrics["loss"])
        eager.append(eager_metrics["loss"])
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-2, atol=0)
    fused = sg.fuse(plain)
    fused(params, state, batches[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused(params, state, batches[0])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("adamw_lists" in n for n in names), sorted(set(names))
    leaves = len(sg.tree.leaves(params))
    copies = [n for n in names if "Memcpy DtoD" in n or "direct_copy_kernel" in n]  # what a clone runs
    assert len(copies) < leaves, (len(copies), leaves)  # not 3 per leaf (param and moments cloned)


@pytest.mark.parametrize("donate", [(), ("params", "opt_state")], ids=["kept", "donated"])
def test_inputs_with_gaps_transposed_or_expanded_match_eager_under_the_graph(donate):
    """Against eager over three calls, with a transposed, a gapped, an expanded and an
    overlapping input (the graph's buffers for them were laid out otherwise than the
    generated code reads them, and the losses went wrong from the second call on)."""
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    params = {"w": (torch.randn(16, 24, generator=g) * 0.2).cuda(), "b": torch.zeros(16, device="cuda")}
    opt = sg.optim.sgd(0.1)

    def step(params, opt_state, batch):
        x, y, scale, shift = batch

        def loss_fn(p):
            return F.smooth_l1_loss(F.linear(x, p["w"], p["b"]) * scale + shift, y)

        loss, grads = sg.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    batches = [
        (
            torch.randn(24, 10, generator=g).cuda().t(),  # transposed
            torch.randn(10, 32, generator=g).cuda()[:, ::2],  # gaps
            torch.rand(16, generator=g).cuda().expand(10, 16),  # elements sharing memory
            torch.rand(40, generator=g).cuda().as_strided((10, 16), (2, 1)),  # overlapping rows
        )
        for _ in range(3)
    ]
    fused = sg.static(sg.fuse(step), donate=donate)
    mine = ({k: v.clone() for k, v in params.items()}, opt.init(params))
    want = ({k: v.clone() for k, v in params.items()}, opt.init(params))
    for batch in batches:
        *want, want_loss = step(*want, batch)
        *mine, loss = fused(*mine, batch)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(mine[0][k], want[0][k], rtol=1e-5, atol=1e-6)
    assert fused.trace_count == 1
