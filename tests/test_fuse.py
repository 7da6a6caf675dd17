"""sg.fuse on CPU: the whole step as generated C++ (TorchInductor), against eager.

Compiling costs tens of seconds on a small CPU, so each compiled step is made once
per module (fixtures) and the tests read it from several sides.
"""

from __future__ import annotations

import re
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import mlp

import sgraph as sg

pytestmark = pytest.mark.slow  # compiles with Inductor
OPT = sg.optim.adamw(1e-2, weight_decay=0.01)


def make_step(apply, buffers):
    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, buffers, x), y)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def batches(n=4, batch=16, width=16, classes=4):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, width, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)
    ]


@pytest.fixture(scope="module")
def run():
    """Four steps of a tiny MLP under sg.static(sg.fuse), donated, next to the same step run eagerly."""
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(mlp(16, 2, 4))
    step = make_step(apply, buffers)
    fused = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    config_before = _inductor_settings()
    caches_before = _cache_counts()
    state = [{k: v.clone() for k, v in params.items()}, None]
    state[1] = OPT.init(state[0])
    ref = [{k: v.clone() for k, v in params.items()}, None]
    ref[1] = OPT.init(ref[0])
    ids, losses, ref_losses = [], [], []
    for batch in batches():
        ids.append([id(v) for v in state[0].values()])
        state[0], state[1], metrics = fused(state[0], state[1], batch)
        ref[0], ref[1], ref_metrics = step(ref[0], ref[1], batch)
        losses.append(metrics["loss"])
        ref_losses.append(ref_metrics["loss"])
    return {
        "fused": fused,
        "state": state,
        "ref": ref,
        "losses": losses,
        "ref_losses": ref_losses,
        "ids": ids,
        "config_before": config_before,
        "config_after": _inductor_settings(),
        "caches": {k: v - caches_before[k] for k, v in _cache_counts().items()},
    }


def _cache_counts():
    from torch._dynamo.utils import counters

    names = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    found = {name: counters["inductor"][name] for name in names}
    found.update({name: counters["aot_autograd"][name] for name in ("autograd_cache_bypass",)})
    return found


def _inductor_settings():
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    return (
        config.size_asserts,
        config.max_autotune,
        config.trace.provenance_tracking_level,
        config.triton.cudagraphs,
        getattr(config.triton, "mix_order_reduction", None),
        functorch_config.enable_autograd_cache,
        getattr(torch.fx.config, "do_not_emit_stack_traces", None),  # not in torch 2.11
    )


def test_fused_step_matches_eager_over_several_steps(run):
    torch.testing.assert_close(torch.stack(run["losses"]), torch.stack(run["ref_losses"]), rtol=1e-5, atol=0)
    for k, v in run["state"][0].items():
        torch.testing.assert_close(v, run["ref"][0][k], rtol=1e-5, atol=1e-6, msg=k)
    for k, v in run["state"][1].mu.items():
        torch.testing.assert_close(v, run["ref"][1].mu[k], rtol=1e-5, atol=1e-7, msg=k)
    assert int(run["state"][1].count) == int(run["ref"][1].count) == 4


def test_donated_params_are_written_in_place_by_the_generated_code(run):
    assert all(ids == run["ids"][0] for ids in run["ids"])
    assert [id(v) for v in run["state"][0].values()] == run["ids"][0]
    assert run["fused"].last_compiled.executable._late == set()  # no write waits for a copy after the call


# Donated inputs that take each other's old values (through a clone or a view, which
# Inductor drops as a no-op), or an old value returned beside a new one.
EXCHANGES = {
    "b takes a.clone()": lambda a, b: (b.sin(), a.clone()),
    "b takes a[:]": lambda a, b: (b.sin(), a[:]),
    "b takes a.view": lambda a, b: (b + 1, a.view(2, 3).view(6)),
    "b takes a.t() (1-D)": lambda a, b: (b + 0, a.t()),
    "b takes a.reshape": lambda a, b: (b * 2, a.reshape(6), b + 1),
    "a and b swap": lambda a, b: (b * 1, a * 1),
    "b takes a flipped": lambda a, b: (b.flip(0) * 2, a.flip(0) * 2),
    "new a, old a beside it": lambda a, b: (a * 2, b - 1, a.clone()),
}


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", list(EXCHANGES))
def test_donated_inputs_exchanging_values_match_eager(name, device):
    """Under sg.static(sg.fuse), both donated, over three calls fed back as the next
    call's inputs (on a GPU, in a CUDA graph): the results are eager's. The new ``a``
    was once written into ``b`` too, when ``b`` took ``a``'s old value through an op
    Inductor drops."""
    fn = EXCHANGES[name]
    fused = sg.static(sg.fuse(fn), donate=(0, 1))
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, generator=g).to(device), torch.randn(6, generator=g).to(device)
    mine, ref = (a.clone(), b.clone()), (a, b)
    for call in range(3):
        got, want = fused(*mine), fn(*ref)
        assert len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=f"call {call}, result[{i}]")
        mine, ref = got[:2], want[:2]


def _lion_per_tensor(lr=1e-3, b1=0.9, b2=0.99, weight_decay=0.1):
    """Lion written leaf by leaf with plain elementwise ops, as a user might."""

    def init(params):
        return {k: torch.zeros_like(v) for k, v in params.items()}

    def update(grads, mu, params):
        updates = {k: -lr * (torch.lerp(mu[k], g, 1 - b1).sign() + weight_decay * params[k]) for k, g in grads.items()}
        return updates, {k: torch.lerp(mu[k], g, 1 - b2) for k, g in grads.items()}

    return init, update


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["sg.optim.lion", "per tensor"])
def test_lion_reading_its_old_moment_beside_the_new_one_matches_eager_donated(device, kind):
    """Lion's direction reads the old moment, which the step also overwrites with the new
    one. On a GPU, Inductor fused the two foreach ops into one kernel that read the
    moment after the store into it (updates of the wrong sign from the second call on);
    that write now comes after the generated code. The same written with plain
    elementwise ops is ordered right by Inductor and keeps its writes in the code."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(18)
    params = {"w": (torch.randn(16, 24, generator=g) * 0.2).to(device), "b": torch.randn(16, generator=g).to(device)}
    if kind == "sg.optim.lion":
        opt = sg.optim.lion(1e-3, weight_decay=0.1)
        init, update = opt.init, lambda grads, state, params: opt.update(grads, state, params)
    else:
        init, update = _lion_per_tensor()

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: F.smooth_l1_loss(F.linear(x, p["w"], p["b"]), y))(params)
        updates, opt_state = update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    def moments(state):
        return state.mu if kind == "sg.optim.lion" else state

    fused = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    mine = ({k: v.clone() for k, v in params.items()}, init(params))
    want = ({k: v.clone() for k, v in params.items()}, init(params))
    for call in range(4):
        batch = (torch.randn(10, 24, generator=g).to(device), torch.randn(10, 16, generator=g).to(device))
        *want, want_loss = step(*want, batch)
        *mine, loss = fused(*mine, batch)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=f"call {call}")
        for k in params:
            torch.testing.assert_close(mine[0][k], want[0][k], rtol=0, atol=1e-6, msg=f"call {call}, {k}")
            torch.testing.assert_close(
                moments(mine[1])[k], moments(want[1])[k], rtol=1e-5, atol=1e-7, msg=f"call {call}, mu {k}"
            )
    executable = fused.last_compiled.executable
    executable = getattr(executable, "body", executable)  # under a CUDA graph, the code it captured
    paths = sorted(fused.last_compiled.program.outputs[o].path for o in executable._late)
    assert paths == (["result[1].mu['b']", "result[1].mu['w']"] if kind == "sg.optim.lion" else [])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_gradient_read_from_a_donated_moment_that_adamw_overwrites_matches_eager(device):
    """The loss reads ``mu['b']`` (donated), AdamW's foreach writes its new value, and
    ``u``'s gradient, computed from the old one, feeds another tensor of the same
    foreach. Inductor computed that gradient again inside the foreach kernel, after the
    store (the fuzz, seed 7992: ``u`` moved by 8% of a step wrong). The write of
    ``mu['b']`` now comes after the generated code. ``ones_like(loss)`` seeds every
    gradient but reads no value of the loss, so ``b``'s own gradient does not count as
    reading ``mu['b']``. (A float64 ``b`` makes the update Inductor's foreach code; the
    own AdamW kernel, taken for one dtype, runs apart from the generated code.)"""
    opt = sg.optim.adamw(1e-2, weight_decay=0.01)

    def step(params, opt_state):
        def loss(p):
            return sum((torch.tanh(v) * 1.5).square().sum() for v in p.values()) + p["u"].sum() * opt_state.mu["b"]

        value, grads = sg.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, value

    g = torch.Generator().manual_seed(3)
    params = {"u": torch.randn(3, generator=g), "w": torch.randn(3, generator=g), "b": torch.randn((), generator=g)}
    params = {k: v.to(device, torch.float64 if k == "b" else None) for k, v in params.items()}
    fused = sg.static(sg.fuse(step), donate="opt_state")
    mine, want = opt.init(params), opt.init(params)
    p_mine, p_want = dict(params), dict(params)
    for call in range(3):
        p_want, want, _ = step(p_want, want)
        p_mine, mine, _ = fused(p_mine, mine)
        for k in params:
            torch.testing.assert_close(p_mine[k], p_want[k], rtol=1e-6, atol=1e-7, msg=f"call {call}, {k}")
    executable = fused.last_compiled.executable
    executable = getattr(executable, "body", executable)
    assert sorted(fused.last_compiled.program.outputs[o].path for o in executable._late) == ["result[1].mu['b']"]


def test_a_partial_write_into_a_donated_input_is_read_after_it_beside_outputs_in_donated_memory():
    """``k[:, 0] += k[:, 0]`` and then ``k + r`` read back, while three other outputs are
    written into donated inputs: Inductor's reordering for locality and its reinplacing
    of the scatter had ``k + r`` read ``k`` before the write (the fuzz, seed 582, these
    layouts). Such steps compile without that reordering."""
    g = torch.Generator().manual_seed(5)

    def inputs():
        g.manual_seed(5)
        return {
            "k": torch.randn(9, generator=g)[3:].view(2, 3),  # at an offset in its storage
            "m": torch.randn(2, 6, generator=g)[:, ::2],  # gapped
            "x": torch.randn(3, generator=g, dtype=torch.float64).expand(2, 3),
            "y": torch.randn(3, 2, generator=g).t(),
            "z": torch.randn(2, 3, generator=g),
            "a": torch.randn(3, generator=g),
        }

    def step(k, m, x, y, z, a):  # the fuzz's order of ops: the reordering depends on it
        column = k[:, 0]
        column += column
        r6 = (m + x).to(m.dtype)
        r7 = (x + a).to(x.dtype)
        r8 = (y + a).to(y.dtype)
        r9 = (z + a).to(z.dtype)
        r10 = (k + r7).to(k.dtype)
        return r10, r6, r7, r8, r9, r10

    fused = sg.static(sg.fuse(step), donate=("k", "m", "y", "z"))
    want = step(**inputs())
    for call in range(2):
        got = fused(**inputs())
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"call {call}, result[{i}]:\n{a}\n{b}"


def test_stats_count_kernels_before_and_after_fusion(run):
    stats = run["fused"].last_compiled.stats
    assert stats.runtime == "inductor" and stats.calls == 4 and stats.traces == 1
    assert stats.kernels_unfused is not None and stats.kernels_fused is not None
    assert 0 < stats.kernels_fused < stats.kernels_unfused, stats
    assert stats.compile_seconds is not None and stats.compile_seconds > 0


def test_as_text_names_the_kernel_of_each_op(run):
    text = run["fused"].last_compiled.as_text()
    assert re.search(r"aten\.gelu\(.*-> #\d+ cpp_fused\w*gelu", text), text
    assert re.search(r"aten\.addmm\(.*-> #\d+ extern_kernels\.addmm", text), text
    assert re.search(r"kernels \(\d+ calls per step\):", text)
    # the AdamW update is generated too, fused with the ops making the gradients
    assert re.search(r"#\d+ cpp_fused\w*adamw\w*: .*%adamw__default", text), text
    assert "torch.ops.sgraph.adamw" not in text.split("kernels (")[1], text


def test_the_profile_script_reads_each_kernels_ops_from_as_text(run):
    from profile_step import kernel_ops

    ops = kernel_ops(run["fused"].last_compiled.as_text())
    assert ops and all(name and text.startswith("%") for name, text in ops.items())
    assert any("gelu" in text for text in ops.values())
    assert kernel_ops("no kernel list") == {}


def test_the_compile_goes_through_inductors_persistent_caches(run):
    """A bypassed cache (e.g. example inputs without a shape environment) would make
    every new process compile from scratch."""
    caches = run["caches"]
    assert caches["fxgraph_cache_bypass"] == 0 and caches["autograd_cache_bypass"] == 0, caches
    assert caches["fxgraph_cache_hit"] + caches["fxgraph_cache_miss"] == 1, caches


def test_inductor_settings_are_patched_only_while_compiling(run):
    assert run["config_before"] == run["config_after"]


def test_the_compile_settings_hold_inside_the_patch_only():
    """sgraph owns the CUDA graph and finishes no reduction outside a kernel (Inductor's
    mix-order LayerNorm backward leaves its column sums to ATen): set while compiling,
    the user's values before and after."""
    from torch._inductor import config

    from sgraph._src.options import FuseOptions
    from sgraph._src.runtime.inductor import inductor_config

    before = _inductor_settings()
    with config.patch({"triton.cudagraphs": True, "triton.mix_order_reduction": True}):
        with inductor_config(FuseOptions()):
            assert config.triton.cudagraphs is False and config.triton.mix_order_reduction is False
        assert config.triton.cudagraphs is True and config.triton.mix_order_reduction is True
    assert _inductor_settings() == before


def test_inductors_cache_keys_hold_sgraphs_source_and_the_users_tag():
    """What sgraph's own ops tell Inductor (a fake's output layout) is in no key of
    Inductor's caches: sgraph's source hash goes into torch's ``cache_key_tag`` while it
    compiles, after the user's own tag, which is back afterwards."""
    import torch.compiler.config as compiler_config

    from sgraph._src.options import FuseOptions
    from sgraph._src.runtime.inductor import inductor_config, sgraph_source_hash

    own = sgraph_source_hash()
    assert re.fullmatch(r"[0-9a-f]{32}", own)
    with compiler_config.patch(cache_key_tag="mine"):
        with inductor_config(FuseOptions()):
            assert compiler_config.cache_key_tag == f"mine|sgraph-{own}"
        assert compiler_config.cache_key_tag == "mine"
    with inductor_config(FuseOptions()):
        assert compiler_config.cache_key_tag == f"sgraph-{own}"
    assert compiler_config.cache_key_tag == ""


def test_another_sgraph_source_misses_inductors_cache(monkeypatch):
    """The same step compiled again in this process loads Inductor's cached code; with
    sgraph's source changed (its hash), it compiles afresh."""
    from torch._dynamo.utils import counters

    from sgraph._src.runtime import inductor

    def step(x):
        return (x.sin() * 3).sum()

    x = torch.randn(5)
    sg.fuse(step)(x)
    counters.clear()
    sg.fuse(step)(x)
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    other = uuid.uuid4().hex  # a hash no earlier run left entries under
    monkeypatch.setattr(inductor, "sgraph_source_hash", lambda: other)
    sg.fuse(step)(x)
    assert counters["inductor"]["fxgraph_cache_miss"] == 1


def test_user_compile_afterwards_is_unaffected(run):
    from torch._inductor import config

    assert config.size_asserts is True and config.trace.provenance_tracking_level == 0


def test_fuse_alone_runs_without_donation_and_retraces_on_mode_switch():
    """sg.fuse without sg.static: no donation (inputs untouched), a training-flag
    switch of a closed-over module traces again, and dropout masks change per call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    apply, params, buffers = sg.functional(model)

    @sg.fuse
    def forward(params, x):
        out = apply(params, buffers, x)
        return out.sum(), out

    x = torch.randn(4, 8)
    x_before, w_before = x.clone(), params["0.weight"].clone()
    train_a, train_b = forward(params, x)[1], forward(params, x)[1]
    model.eval()
    with pytest.warns(sg.RetraceWarning, match=r"training"):
        evaluated = forward(params, x)[1]
    assert torch.equal(x, x_before) and torch.equal(params["0.weight"], w_before)
    assert not torch.equal(train_a, train_b)  # a fresh dropout mask per call
    torch.testing.assert_close(evaluated, model(x))
    assert forward.trace_count == 2 and forward.last_compiled.stats.runtime == "inductor"
    assert forward.api.startswith("sg.fuse(") and forward.api.endswith(".forward)")


def test_options_are_checked_when_decorating():
    def f(x):
        return x

    with pytest.raises(
        sg.ArgumentError, match=r"kernels names 'linear_crossentropy'.*Did you mean 'linear_cross_entropy'"
    ):
        sg.fuse(kernels=("linear_crossentropy",))(f)
    with pytest.raises(sg.ArgumentTypeError, match=r"autotune must be True or False; found 'yes'"):
        sg.fuse(autotune="yes")(f)
    with pytest.raises(sg.ArgumentTypeError, match=r"unknown option autotun=True.*Did you mean autotune="):
        sg.fuse(autotun=True)
    with pytest.raises(sg.ArgumentError, match=r"sg.fuse is applied twice"):
        sg.fuse(sg.static(sg.fuse(f)))
    stacked = sg.static(sg.fuse(kernels=())(f), donate=0)
    assert stacked.options.fuse == sg.fuse(kernels=())(f).options.fuse
    assert stacked.options.fuse.kernels == () and stacked.options.static.donate == (0,)
    assert sg.fuse(f).options.fuse.kernels == ("linear_cross_entropy", "adamw", "gelu_mlp")
    assert "fuse(" in repr(sg.fuse(autotune=True)(f)) and "autotune=True" in repr(sg.fuse(autotune=True)(f))


def test_gpt_step_with_the_fused_cross_entropy_through_inductor():
    """The own linear + cross-entropy kernel inside generated code: a tiny GPT (vocab
    1024, so the head matches the pattern), three donated momentum-SGD steps against
    eager (SGD: Adam would amplify rounding noise in near-zero gradients)."""
    from models_for_tests import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    apply, params, buffers = sg.functional(GPT(GPTConfig(vocab=1024, d=32, layers=1, heads=2, seq=16)))

    def loss_fn(params, batch):
        x, y = batch
        return gpt_loss(apply(params, buffers, x), y)

    opt = sg.optim.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    fused = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    mine = [{k: v.clone() for k, v in params.items()}, None]
    mine[1] = opt.init(mine[0])
    ref = [{k: v.clone() for k, v in params.items()}, None]
    ref[1] = opt.init(ref[0])
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        batch = (torch.randint(0, 1024, (2, 16), generator=g), torch.randint(0, 1024, (2, 16), generator=g))
        mine[0], mine[1], loss = fused(mine[0], mine[1], batch)
        ref[0], ref[1], ref_loss = step(ref[0], ref[1], batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for k in mine[0]:
        torch.testing.assert_close(mine[0][k], ref[0][k], rtol=1e-5, atol=1e-6, msg=k)
    text = fused.last_compiled.as_text()
    own_kernel = r"sgraph\.linear_cross_entropy\.default\(.*-> .*#\d+ torch\.ops\.sgraph\.linear_cross_entropy"
    assert re.search(own_kernel, text)


def test_an_inductor_failure_is_a_capture_error_or_falls_back(monkeypatch):
    import torch._inductor.compile_fx as inductor

    import sgraph._src.runtime.inductor as runtime

    def fail(*args, **kwargs):
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(runtime, "compile_direct", fail)
    monkeypatch.setattr(inductor, "compile_fx", fail)

    def step(x):
        return (x * 2).sum()

    x = torch.randn(3)
    with pytest.raises(sg.CaptureError, match=r"failed in TorchInductor: RuntimeError: no lowering for this op\. "):
        sg.fuse(step)(x)
    fallback = sg.static(sg.fuse(step), fallback="eager")
    with pytest.warns(sg.FallbackWarning, match="no lowering for this op"):
        assert torch.equal(fallback(x), step(x))


def test_a_failure_below_aotautograd_compiles_through_compile_fx(monkeypatch):
    import sgraph._src.runtime.inductor as runtime

    def fail(*args, **kwargs):
        raise RuntimeError("an op the plain retrace cannot take")

    def step(x):
        return (x * 3).sum()

    x = torch.randn(3)
    fused = sg.fuse(step)
    torch.testing.assert_close(fused(x), step(x))
    assert fused.last_compiled.stats.inductor_entry == "direct"
    monkeypatch.setattr(runtime, "compile_direct", fail)
    fused = sg.fuse(step)
    torch.testing.assert_close(fused(x), step(x))
    assert fused.last_compiled.stats.inductor_entry == "compile_fx"


def test_compile_workers_start_only_for_a_cuda_step(monkeypatch):
    """Inductor's Triton compile pool is asked to start before a fused step for a CUDA
    device is traced, and never for a CPU step (C++ compiles in threads)."""
    import torch._inductor.async_compile as async_compile

    from sgraph._src.runtime.workers import start_compile_workers

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    assert not start_compile_workers([torch.device("cpu")]) and not started
    assert start_compile_workers([torch.device("cpu"), torch.device("cuda", 0)]) and started == [True]

    started.clear()
    assert torch.equal(sg.fuse(lambda x: x * 2)(torch.ones(3)), torch.full((3,), 2.0))
    assert not started


def test_compile_workers_that_fail_to_start_do_not_fail_the_step(monkeypatch):
    import torch._inductor.async_compile as async_compile

    from sgraph._src.runtime.workers import start_compile_workers

    def fail():
        raise OSError("cannot start a process")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", fail)
    assert not start_compile_workers([torch.device("cuda")])


def test_the_retrace_records_no_stack_traces_while_sgraph_compiles(monkeypatch):
    """The retrace's Python stacks would be those of the graph's generated code; the
    user's own setting is back afterwards."""
    import sgraph._src.runtime.inductor_direct as direct

    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        pytest.skip("this torch always records the stacks")
    seen = []
    original = direct._decomposed

    def spy(*args, **kwargs):
        seen.append(torch.fx.config.do_not_emit_stack_traces)
        return original(*args, **kwargs)

    monkeypatch.setattr(direct, "_decomposed", spy)
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)
    x = torch.randn(3)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached step is not traced again
        assert torch.equal(sg.fuse(lambda x: x + 1.5)(x), x + 1.5)
    assert seen == [True] and torch.fx.config.do_not_emit_stack_traces is False


def test_a_fused_first_call_asks_for_workers_before_tracing_and_trace_alone_does_not(monkeypatch):
    import sgraph._src.api as api

    events = []
    monkeypatch.setattr(api, "start_compile_workers", lambda devices: events.append(("workers", devices)))

    def step(x):
        events.append("traced")
        return x * 2

    x = torch.ones(3)
    sg.fuse(step).trace(x)
    assert events == ["traced"]
    events.clear()
    assert torch.equal(sg.fuse(step)(x), x * 2)
    assert events == [("workers", {torch.device("cpu")}), "traced"]


@pytest.mark.slow
def test_an_add_with_alpha_of_a_matmul_keeps_its_alpha():
    """Inductor folds ``add(x, mm(a, b))`` into ``addmm`` and drops ``alpha``: a hand-written
    SGD step ``p.add_(grad, alpha=-lr)`` moved the weight by the whole gradient."""

    def sgd(params, x, y):
        grads = sg.grad(lambda p: (x @ p["w"] - y).square().mean())(params)
        params["w"].add_(grads["w"], alpha=-0.01)
        return params, torch.add(torch.zeros(8, 3), x @ params["w"], alpha=0.25)

    torch.manual_seed(0)
    w, x, y = torch.randn(5, 3), torch.randn(8, 5), torch.randn(8, 3)
    want = sgd({"w": w.clone()}, x, y)
    step = sg.static(sg.fuse(sgd), donate="params")
    params = {"w": w.clone()}
    for _ in range(2):  # the second call from the first call's result, as eager does
        params, scaled = step(params, x, y)
        want_params, want_scaled = want
        torch.testing.assert_close(params["w"], want_params["w"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(scaled, want_scaled, rtol=1e-6, atol=1e-6)
        want = sgd({"w": want_params["w"].clone()}, x, y)


def test_a_closed_over_tensor_changed_in_place_retraces_and_reads_no_stale_layout():
    """The generated code has the traced sizes and dtype built in (size asserts off)."""
    s = torch.ones(4)

    def f(x):
        return x * s

    step = sg.static(sg.fuse(f))
    x = torch.randn(4)
    torch.testing.assert_close(step(x), f(x))
    s.data = torch.arange(4, dtype=torch.float64)
    with pytest.warns(sg.RetraceWarning, match=re.escape("closed over by the step, changed: f32[4] -> f64[4]")):
        out = step(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, f(x))


def test_a_float_times_an_integer_zero_keeps_nan_infinity_and_negative_zero():
    """Inductor's constant folding took ``x * 0`` and ``x * False`` for zeros; eagerly NaN
    and infinity times zero are NaN and a negative value times zero is -0 (the fuzz,
    seed 4306: an auxiliary loss switched off by a flag hid a NaN)."""

    def f(x, flag, n):
        return x * flag, x * 0, n * 0, x.sum() * False, x.clone().mul_(0)

    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -2.0, 3.0])
    n = torch.arange(5)
    want = f(x, False, n)
    got = sg.fuse(f)(x, False, n)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(torch.signbit(g), torch.signbit(w))  # -0 where eager has -0


def test_ops_over_empty_tensors_give_eagers_values_and_no_inductor_failure():
    """Inductor failed on some ops whose inputs have no elements (the fuzz, seeds 3580
    and 5467 fused: a mean over the concatenation of an empty bool and an empty float
    tensor, a bool matmul); sg.fuse now makes each such result the constant it is."""

    def f(flags, scores, a, b, ids):
        mixed = torch.cat([flags.flatten(), scores], -1)  # bool and float32: float32[0]
        return (
            mixed.mean(0),  # NaN; Inductor's scheduler asserted on this one
            flags.logical_not() @ flags.logical_not().t(),  # a bool matmul: Inductor has no lowering
            a @ b,  # zeros of shape [3, 4]
            scores.sum(),
            scores.prod(),
            scores.reshape(0, 5).sum(0),
            ids.float().mean(),  # not empty: computed as usual
        )

    args = (torch.zeros(0, 3, dtype=torch.bool), torch.randn(0), torch.randn(3, 0), torch.randn(0, 4), torch.arange(6))
    fused = sg.fuse(f)
    program = fused.lower(*args).program
    assert "empty_folds" in program.passes
    assert not {torch.ops.aten.mean.dim, torch.ops.aten.mm.default} & {n.target for n in program.graph.nodes}
    want = f(*args)
    got = fused(*args)
    for g, w in zip(got, want, strict=True):
        assert (g.shape, g.dtype, g.stride()) == (w.shape, w.dtype, w.stride())
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
    assert got[0].isnan() and got[-1] == 2.5


def test_the_empty_folds_leave_views_writes_and_random_ops_alone():
    from sgraph._src.passes.empty_folds import _functional

    aten = torch.ops.aten
    assert _functional(aten.mean.dim) and _functional(aten.mm.default) and _functional(aten.cat.default)
    kept = (aten.view.default, aten._unsafe_view.default, aten.add_.Tensor, aten.rand_like.default)
    for op in (*kept, aten.var_mean.correction):
        assert not _functional(op), op
