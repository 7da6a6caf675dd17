"""sg.static on a GPU: one CUDA graph for the whole step (skipped without CUDA)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import cuda_bf16_autocast, make_train_step, small_model_and_batches

import sgraph as sg
from sgraph._src.runtime.eager import EagerExecutable

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fp32_parity_one_capture_and_stable_addresses_over_50_steps(kind):
    model, batches, loss = small_model_and_batches(kind)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = make_train_step(apply, loss, opt, autocast=cuda_bf16_autocast(False), donate=("params", "opt_state"))
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
    model, batches, loss = small_model_and_batches(kind)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    step = make_train_step(apply, loss, opt, autocast=cuda_bf16_autocast(False), donate=("params", "opt_state"))
    lowered = step.lower(params, state, batches[0])
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
    model, batches, loss = small_model_and_batches(kind)
    reference = copy.deepcopy(model)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = make_train_step(apply, loss, opt, autocast=cuda_bf16_autocast(False), donate=("params", "opt_state"))
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
    model, batches, loss = small_model_and_batches(kind)
    reference = copy.deepcopy(model)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    step = make_train_step(apply, loss, opt, autocast=cuda_bf16_autocast(True), donate=("params", "opt_state"))
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


def test_inputs_and_outputs_of_mixed_dtypes_are_copied_in_one_kernel_per_dtype():
    """Nothing donated: before each replay the inputs (fp32, bf16 and int64 leaves) are
    copied into the graph's buffers, after it the outputs out of them, a multi-tensor
    copy per dtype each way, not a copy per tensor; every call's results are its own
    and equal the eager step's."""

    def fn(params, tokens):  # no cast or copy of its own (the graph's kernels are not counted apart)
        total = tokens.sum()
        new = {k: v * 0.5 + total for k, v in params.items()}
        return new, {"count": total, "half": params["h0"] * 2}

    step = sg.static(fn)
    params = {f"w{i}": torch.randn(16, 8, device="cuda") for i in range(20)}
    params |= {f"h{i}": torch.randn(8, device="cuda").bfloat16() for i in range(10)}
    results = []
    for i in range(4):
        tokens = torch.arange(i, i + 6, device="cuda")
        results.append((step(params, tokens), fn(params, tokens)))
        params = results[-1][0][0]
    for got, expected in results:  # earlier results survive the later replays
        for a, b in zip(sg.tree.leaves(got), sg.tree.leaves(expected)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(params, tokens)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    per_tensor = [n for n in names if "Memcpy DtoD" in n or "direct_copy_kernel" in n]
    assert len(per_tensor) <= 2, per_tensor  # was one per tensor each way: 31 in, 32 out
    assert sum("multi_tensor_apply" in n for n in names) >= 2


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


def test_a_cpu_batch_for_cuda_params_names_the_arguments_and_the_fix():
    step = sg.static(lambda params, batch: (batch["x"] @ params["w"]).sum())
    params = {"w": torch.ones(3, 3, device="cuda")}
    with pytest.raises(RuntimeError, match=r"on cuda:0: params\[.w.\]; on cpu: batch\[.x.\]\)\. Move them"):
        step(params, {"x": torch.ones(2, 3)})


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


@pytest.mark.parametrize("fuse", [False, True], ids=["static", "static+fuse"])
def test_a_gapped_input_run_uncaptured_reads_a_dense_copy(fuse):
    """The program (and its generated code) reads a gapped input densely: the first
    call's eager run and every uncaptured one copy it so (read as they are, the
    generated code would take other elements)."""

    def step(x):
        return host_sync(x.sum(1) * 3 + 1)

    fn = sg.static(sg.fuse(step) if fuse else step, fallback="eager")
    bigs = [torch.randn(64, 256, device="cuda") for _ in range(3)]
    with pytest.warns(sg.FallbackWarning, match="uncaptured"):
        first = fn(bigs[0][:, 8:12])
    torch.testing.assert_close(first, step(bigs[0][:, 8:12]), rtol=1e-6, atol=1e-5)
    for big in bigs[1:]:
        torch.testing.assert_close(fn(big[:, 8:12]), step(big[:, 8:12]), rtol=1e-6, atol=1e-5)
    assert "dense_inputs" in fn.last_compiled.program.passes and fn.last_compiled.executable.uncaptured


def test_a_capture_failure_leaves_stream_capture_mode_and_rng_as_they_were():
    stream = torch.cuda.current_stream()
    step = sg.static(lambda x: host_sync(x + torch.rand_like(x)))
    torch.cuda.manual_seed(1)
    with pytest.raises(sg.CaptureError):
        step(torch.ones(4, device="cuda"))
    after_failure = torch.cuda.get_rng_state()
    assert torch.cuda.current_stream() == stream
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.manual_seed(1)
    torch.rand(4, device="cuda")  # what the call's one eager step drew
    assert torch.equal(after_failure, torch.cuda.get_rng_state())
    # and the process can still capture and replay
    again = sg.static(lambda x: x * 3)
    for _ in range(3):
        out = again(torch.ones(4, device="cuda"))
    assert torch.equal(out, torch.full((4,), 3.0, device="cuda")) and again.last_compiled.executable.captures == 1


@pytest.mark.parametrize("fuse", [False, True], ids=["static", "static+fuse"])
def test_a_gapped_input_gets_a_dense_graph_buffer_and_matches_eager(fuse, monkeypatch):
    """16 columns of a 4096-column batch: the graph's buffer holds those (256 KiB), not
    the view's memory extent (64 MiB), and the step matches eager over calls with new
    values, a returned view of the input included."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator(device="cuda").manual_seed(0)

    def step(params, batch):
        def loss_fn(p):
            return ((batch["x"] @ p["w"]).tanh() - batch["y"][:, None]).pow(2).mean()

        loss, grads = sg.value_and_grad(loss_fn)(params)
        return sg.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss, "x0": batch["x"][0]}

    params = {"w": torch.randn(16, 8, device="cuda", generator=g) * 0.3}
    fn = sg.static(sg.fuse(step) if fuse else step, donate=("params",))
    mine, want = {"w": params["w"].clone()}, {"w": params["w"].clone()}
    labels = torch.randn(4096, 3, device="cuda", generator=g)
    for i in range(3):
        feats = torch.randn(4096, 4096, device="cuda", generator=g)
        batch = {"x": feats[:, 100:116], "y": labels[:, i]}
        mine, metrics = fn(mine, batch)
        want, expected = step(want, batch)
        torch.testing.assert_close(metrics["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
        assert torch.equal(metrics["x0"], feats[0, 100:116])
        torch.testing.assert_close(mine["w"], want["w"], rtol=1e-5, atol=1e-6)
    compiled = fn.last_compiled
    assert "dense_inputs" in compiled.program.passes and compiled.executable.captures == 1
    held = sum(b.untyped_storage().nbytes() for b in compiled.executable.static_buffers)
    assert held == 4096 * 16 * 4 + 4096 * 4, held  # the dense x, and y's one column


def test_a_donated_result_returned_again_as_a_metric_survives_the_next_replay():
    @sg.static(donate="params")
    def step(params):
        new = {"w": params["w"] + 1}
        return new, {"w_after": new["w"], "head": new["w"][:2]}

    params = {"w": torch.zeros(4, device="cuda")}
    kept = []
    for _ in range(4):
        params, metrics = step(params)
        kept.append(metrics)
    for k, metrics in enumerate(kept, start=1):
        assert torch.equal(metrics["w_after"], torch.full((4,), float(k), device="cuda"))
        assert torch.equal(metrics["head"], torch.full((2,), float(k), device="cuda"))
    assert step.last_compiled.executable.captures == 1


def test_an_outer_autocast_retraces_and_matches_eager():
    def f(a, b):
        return a @ b

    step = sg.static(f)
    a, b = torch.randn(16, 16, device="cuda"), torch.randn(16, 16, device="cuda")
    assert step(a, b).dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.warns(sg.RetraceWarning, match=re.escape("autocast (cuda) changed: off -> bfloat16")):
            out = step(a, b)
        expected = f(a, b)
        again = step(a, b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected) and torch.equal(again, expected)
    assert step(a, b).dtype == torch.float32


@pytest.mark.parametrize("fuse", [False, True], ids=["eager-kernels", "fuse"])
def test_a_region_the_step_turns_autocast_off_in_stays_fp32_in_the_graph(fuse):
    """Capture runs the graph's ops under the caller's autocast unless sgraph turns it off."""

    def f(a, b):
        with torch.autocast("cuda", enabled=False):
            return a @ b

    step = sg.static(sg.fuse(f) if fuse else f)
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = f(a, b)
        outs = [step(a, b) for _ in range(3)]
    for out in outs:
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse", [False, True], ids=["eager-kernels", "fuse"])
def test_a_closed_over_tensor_given_new_memory_is_read_there_not_at_the_captured_address(fuse):
    s = torch.ones(4, device="cuda")

    def f(x):
        return x * s

    step = sg.static(sg.fuse(f) if fuse else f)
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(step(x), f(x))
    s.data = torch.full((4,), 3.0, device="cuda")  # same metadata, other memory: the graph read the old one
    with pytest.warns(sg.RetraceWarning, match="now holds other memory"):
        out = step(x)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(step(x), f(x))


def test_inputs_aliasing_a_donated_input_give_the_eager_result_under_replay():
    def step(params, ema):
        new = {"w": params["w"] - 0.1}
        return new, {"w": 0.9 * ema["w"] + 0.1 * new["w"]}, ema

    static = sg.static(step, donate="params")
    params = {"w": torch.ones(3, device="cuda")}
    for k in range(3):
        shared = dict(params)  # the EMA shares the params' tensors
        expected = step({"w": params["w"].clone()}, {"w": params["w"].clone()})
        params, ema, returned = static(params, shared)
        assert torch.allclose(ema["w"], expected[1]["w"]) and torch.equal(returned["w"], expected[2]["w"]), k


def test_threads_replaying_one_graph_take_turns():
    import threading

    step = sg.static(lambda x: (x * 2).sum(0))
    step(torch.ones(64, 64, device="cuda"))
    step(torch.ones(64, 64, device="cuda"))  # captured
    errors, results = [], {}

    def call(k):
        try:
            for _ in range(20):
                out = step(torch.full((64, 64), float(k), device="cuda"))
                if not torch.equal(out, torch.full((64,), 128.0 * k, device="cuda")):
                    errors.append((k, out[0].item()))
            results[k] = True
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4


@pytest.mark.parametrize("fuse", [False, True], ids=["static", "static+fuse"])
def test_a_step_of_empty_tensors_captures_a_graph_of_no_kernels_and_leaves_cuda_clean(fuse):
    # Counting the nodes of an empty graph once left the CUDA runtime's last error set,
    # which the next kernel launch anywhere reported as its own ("invalid argument").
    def f(x, y):
        z = x[None] - y
        return z * x, (x + 1).flatten()

    step = sg.static(sg.fuse(f) if fuse else f)
    x, y = torch.randn(3, 0, device="cuda"), torch.randn(3, 0, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = step(x, y)
            want = f(x, y)
            assert [t.shape for t in got] == [t.shape for t in want]
    assert step.last_compiled.stats.kernel_launches == 0
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]  # nothing went wrong
    assert (torch.arange(4, device="cuda") * 2).sum().item() == 12  # a launch after it raises nothing
