"""sg.static on a GPU: one CUDA graph for the whole step (skipped without CUDA)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import GPT, GPTConfig, gpt_loss, mlp

import sgraph as sg
from sgraph._src.runtime.eager import EagerExecutable

pytestmark = pytest.mark.gpu
SMALL_GPT = GPTConfig(vocab=512, d=128, layers=2, heads=4, seq=64)


def build(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model = mlp(256, 3, 10).cuda()
        batches = [(torch.randn(32, 256, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(8)]
        return model, batches, F.cross_entropy
    model = GPT(SMALL_GPT).cuda()
    batches = [
        (torch.randint(0, 512, (4, 64), device="cuda"), torch.randint(0, 512, (4, 64), device="cuda")) for _ in range(8)
    ]
    return model, batches, gpt_loss


def train_step_for(apply, loss, opt, bf16=False, **options):
    def loss_fn(params, batch):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            return loss(apply(params, {}, x), y)

    def train_step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    return sg.static(train_step, donate=("params", "opt_state"), **options)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fp32_parity_one_capture_and_stable_addresses_over_50_steps(kind):
    model, batches, loss = build(kind)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = train_step_for(apply, loss, opt)
    state = opt.init(params)
    eager_params, eager_state = copy.deepcopy(params), copy.deepcopy(state)
    addresses = {k: v.data_ptr() for k, v in params.items()}
    objects = {k: id(v) for k, v in params.items()}
    for i in range(50):
        batch = batches[i % len(batches)]
        params, state, metrics = step(params, state, batch)
        eager_params, eager_state, eager_metrics = step.fn(eager_params, eager_state, batch)
        # Not bitwise: the static step folds apply_updates' p + (new_p - p) into new_p
        # (one rounding less); everything else runs the same kernels.
        torch.testing.assert_close(metrics["loss"], eager_metrics["loss"], rtol=1e-6, atol=0)
    for k in params:
        assert params[k].data_ptr() == addresses[k] and id(params[k]) == objects[k]
        if k.endswith("qkv.bias"):
            continue  # zero true gradient on the key bias: Adam amplifies rounding noise
        torch.testing.assert_close(params[k], eager_params[k], rtol=1e-5, atol=1e-7)
    stats = step.last_compiled.stats
    assert stats.runtime == "cudagraph" and stats.traces == 1 and step.last_compiled.executable.captures == 1
    assert stats.calls == 50 and stats.kernel_launches and stats.kernel_launches > 10


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_graph_replay_is_bitwise_equal_to_the_same_program_on_eager_kernels(kind):
    model, batches, loss = build(kind)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    lowered = train_step_for(apply, loss, opt).lower(params, state, batches[0])
    graph, eager = lowered.compile(), sg.Compiled(lowered, EagerExecutable(lowered.program))
    assert graph.stats.runtime == "cudagraph" and eager.stats.runtime == "eager"
    other_params, other_state = copy.deepcopy(params), copy.deepcopy(state)
    for i in range(50):
        params, state, metrics = graph(params, state, batches[i % len(batches)])
        other_params, other_state, other_metrics = eager(other_params, other_state, batches[i % len(batches)])
        # Bitwise: the graph replays exactly the ATen kernels the eager run launches.
        assert torch.equal(metrics["loss"], other_metrics["loss"]), i
    for a, b in zip(sg.tree.leaves((params, state)), sg.tree.leaves((other_params, other_state))):
        assert torch.equal(a, b)
    assert graph.executable.captures == 1 and graph.stats.calls == 50


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_matches_a_torch_adamw_loop(kind):
    model, batches, loss = build(kind)
    reference = copy.deepcopy(model)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = train_step_for(apply, loss, opt)
    state = opt.init(params)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for i in range(20):
        x, y = batches[i % len(batches)]
        params, state, metrics = step(params, state, (x, y))
        torch_opt.zero_grad()
        expected = loss(reference(x), y)
        expected.backward()
        torch_opt.step()
        # Not bitwise: torch.optim.AdamW rounds its update in another order.
        torch.testing.assert_close(metrics["loss"], expected.detach(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_bf16_autocast_losses_within_1e2_of_eager_over_100_steps(kind):
    model, batches, loss = build(kind)
    reference = copy.deepcopy(model)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = train_step_for(apply, loss, opt, bf16=True)
    state = opt.init(params)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    ours, theirs = [], []
    for i in range(100):
        x, y = batches[i % len(batches)]
        params, state, metrics = step(params, state, (x, y))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = loss(reference(x), y)
        expected.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        ours.append(metrics["loss"])
        theirs.append(expected.detach())
    torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), rtol=1e-2, atol=0)
    assert step.last_compiled.executable.captures == 1


def test_dropout_masks_differ_between_replays():
    step = sg.static(lambda x: F.dropout(x, 0.5, training=True))
    x = torch.ones(4096, device="cuda")
    masks = [step(x) == 0 for _ in range(3)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert all(0.45 < m.float().mean() < 0.55 for m in masks)
    assert step.last_compiled.executable.captures == 1


def test_sg_random_keys_under_replay_match_eager():
    def step(key, x):
        key, sub = sg.random.split(key)
        return key, sg.random.dropout(sub, x, 0.5)

    static = sg.static(step, donate="key")
    key, eager_key = sg.random.key(0, device="cuda"), sg.random.key(0, device="cuda")
    outs = []
    for _ in range(3):
        key, y = static(key, torch.ones(256, device="cuda"))
        eager_key, eager_y = step(eager_key, torch.ones(256, device="cuda"))
        assert torch.equal(y, eager_y)
        outs.append(y)
    assert not torch.equal(outs[0], outs[1])


def test_an_output_from_step_k_is_unchanged_after_step_k_plus_1():
    @sg.static(donate="params")
    def step(params, x):
        new = {"w": params["w"] + x}
        return new, {"w_sum": new["w"].sum(), "x2": x * 2}

    params = {"w": torch.zeros(8, device="cuda")}
    params, first = step(params, torch.ones(8, device="cuda"))
    kept = {k: v.clone() for k, v in first.items()}
    params, second = step(params, torch.full((8,), 3.0, device="cuda"))
    for k in first:
        assert torch.equal(first[k], kept[k]), k
    assert float(second["w_sum"]) == 32.0


def test_outputs_view_mode_hands_out_graph_buffers():
    step = sg.static(lambda x: x * 2, outputs="view")
    step(torch.ones(4, device="cuda"))  # the first call runs eagerly, then captures
    a = step(torch.ones(4, device="cuda"))
    step(torch.full((4,), 5.0, device="cuda"))
    assert torch.equal(a, torch.full((4,), 10.0, device="cuda")), "view mode reuses the buffer (documented hazard)"


def test_a_replaced_donated_tensor_is_detected_before_replay():
    @sg.static(donate="params")
    def step(params):
        return {"w": params["w"] + 1}

    kept = step({"w": torch.zeros(4, device="cuda")})  # held, so its memory is not reused below
    replaced = {"w": torch.full((4,), 10.0, device="cuda")}
    with pytest.warns(sg.RetraceWarning, match=re.escape("donated input params['w'] is not the tensor")):
        out = step(replaced)
    assert torch.equal(out["w"], torch.full((4,), 11.0, device="cuda")), "never a stale result"
    assert step.last_compiled.executable.captures == 2
    assert torch.equal(kept["w"], torch.ones(4, device="cuda"))

    strict = sg.static(lambda params: {"w": params["w"] + 1}, donate="params", retrace="error")
    held = strict({"w": torch.zeros(4, device="cuda")})
    with pytest.raises(sg.StaleBufferError, match=r"params\['w'\]"):
        strict({"w": torch.zeros(4, device="cuda")})
    assert torch.equal(held["w"], torch.ones(4, device="cuda"))


def test_cpu_tensor_inputs_are_refused_for_a_cuda_graph():
    step = sg.static(lambda x, scale: x * scale)
    with pytest.raises(sg.CaptureError, match=r"input scale is a cpu tensor .* Move it to the GPU"):
        step(torch.ones(2, device="cuda"), torch.tensor(2.0))


def test_a_host_copy_in_the_step_raises_at_trace_time():
    class HostSync(nn.Module):
        def forward(self, x):
            return x + x.sum().to("cpu", non_blocking=False).to(x.device)

    mod = HostSync()
    with pytest.raises(sg.CaptureError):
        sg.static(lambda x: mod(x))(torch.ones(2, device="cuda"))


@torch.library.custom_op("sgraph_test::host_sync", mutates_args=())
def host_sync(x: torch.Tensor) -> torch.Tensor:
    torch.cuda.current_stream().synchronize()  # illegal while a stream is capturing
    return x * 2


@host_sync.register_fake
def _(x):
    return torch.empty_like(x)


def syncing_step(x):
    y = x + 1
    return host_sync(y)


def test_a_capture_failure_names_the_op_and_line():
    step = sg.static(syncing_step)
    with pytest.raises(
        sg.CaptureError,
        match=r"(?s)sgraph_test\.host_sync\.default .*test_static_gpu\.py:\d+ in syncing_step .*ran eagerly",
    ):
        step(torch.ones(4, device="cuda"))


def test_a_capture_failure_falls_back_when_asked():
    step = sg.static(syncing_step, fallback="eager")
    with pytest.warns(sg.FallbackWarning, match="uncaptured"):
        first = step(torch.ones(4, device="cuda"))
    second = step(torch.full((4,), 2.0, device="cuda"))
    assert torch.equal(first, torch.full((4,), 4.0, device="cuda"))
    assert torch.equal(second, torch.full((4,), 6.0, device="cuda"))
    assert step.last_compiled.executable.uncaptured
