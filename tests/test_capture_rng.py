"""A step must not seed, set or fork the global RNG: that would run once, at trace
time, and never in the compiled step. Random ops themselves trace without drawing.

``trace`` below runs ``make_fx`` under sgraph's modes exactly as ``sgraph._src.trace``
does (``GuardMode`` enters the guards); the last tests go through ``sg.static``."""

from __future__ import annotations

import inspect
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

import sgraph as sg
from sgraph._src.capture import GuardMode, SourceMode, rng_state_unchanged

API = "sg.static(step)"
WAIT = 10


def trace(fn, *tensors):
    """``make_fx`` of ``fn`` under sgraph's modes, as ``sg.static`` traces."""

    def run(*args):
        with GuardMode(API), SourceMode(API):
            return fn(*args)

    return make_fx(run, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)


@pytest.fixture(autouse=True)
def global_rng():
    """Each test starts from a known seed and leaves the global RNG as it found it."""
    state = torch.get_rng_state()
    torch.manual_seed(1234)
    yield
    torch.set_rng_state(state)


def line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return re.escape(f"test_capture_rng.py:{start + offset} in {fn.__name__} (`{lines[offset].strip()}`)")


def seeds(x):
    torch.manual_seed(0)
    return x * 2


def seeds_through_random(x):
    torch.random.manual_seed(0)
    return x * 2


def reseeds(x):
    torch.random.seed()
    return x * 2


def sets_state(x):
    torch.set_rng_state(torch.get_rng_state())
    return x * 2


def forks(x):
    with torch.random.fork_rng():
        return torch.rand(4) + x


def seeds_cuda(x):
    torch.cuda.manual_seed(0)
    return x * 2


CALLS = [
    (seeds, "torch.manual_seed(0)", r"torch\.manual_seed\(\)"),
    (seeds_through_random, "torch.random.manual_seed(0)", r"torch\.random\.manual_seed\(\)"),
    (reseeds, "torch.random.seed()", r"torch\.random\.seed\(\)"),
    (sets_state, "torch.set_rng_state(", r"torch\.set_rng_state\(\)"),
    (forks, "torch.random.fork_rng()", r"torch\.random\.fork_rng\(\)"),
    (seeds_cuda, "torch.cuda.manual_seed(0)", r"torch\.cuda\.manual_seed\(\)"),
]


@pytest.mark.parametrize("fn, text, what", CALLS, ids=[c[0].__name__ for c in CALLS])
def test_changing_the_global_rng_in_the_step_raises_with_line_and_fix(fn, text, what):
    state = torch.get_rng_state()
    changes = "changes the global RNG state"
    pattern = rf"^{re.escape(API)}: {what} {changes} at {line_of(fn, text)}, which would run only once"
    with pytest.raises(sg.CaptureError, match=pattern) as info:
        trace(fn, torch.ones(4))
    assert "Seed outside the step" in str(info.value) and "sg.random.key(seed)" in str(info.value)
    assert torch.equal(torch.get_rng_state(), state) and torch.initial_seed() == 1234


def test_reseeding_the_default_generator_directly_is_found_and_undone():
    def step(x):
        torch.default_generator.manual_seed(99)
        return x * 2

    state = torch.get_rng_state()
    pattern = r"the step changes the global RNG state \(it reseeds the CPU generator, .*Seed outside the step"
    with pytest.raises(sg.CaptureError, match=pattern):
        trace(step, torch.ones(4))
    assert torch.initial_seed() == 1234 and torch.equal(torch.get_rng_state(), state)


def test_random_ops_trace_without_drawing_from_the_global_generator():
    def step(x):
        return F.dropout(x, 0.5, training=True) + torch.rand(4) + torch.randn_like(x)

    state = torch.get_rng_state()
    graph = trace(step, torch.ones(4))
    seeded = [
        n for n in graph.graph.nodes if n.op == "call_function" and torch.Tag.nondeterministic_seeded in n.target.tags
    ]
    assert len(seeded) >= 3
    assert torch.equal(torch.get_rng_state(), state)


def test_torch_forking_the_rng_for_itself_is_allowed():
    """torch.utils.checkpoint forks and restores the RNG around its recomputation."""

    def step(w, x):
        w = w.requires_grad_()
        loss = checkpoint(lambda w: torch.tanh(x @ w).sum(), w, use_reentrant=False)
        return torch.autograd.grad(loss, w)[0]

    trace(step, torch.randn(3, 3), torch.randn(2, 3))


def test_an_error_in_the_step_is_not_hidden_and_the_rng_is_restored():
    def step(x):
        torch.default_generator.manual_seed(99)
        return x.view(3)

    with pytest.raises(RuntimeError, match="invalid for input of size 4"):
        trace(step, torch.ones(4))
    assert torch.initial_seed() == 1234


def test_other_threads_seed_and_draw_while_a_step_traces():
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def step(x):
        inside.set()
        assert release.wait(WAIT)
        return x * 2

    def tracer():
        try:
            trace(step, torch.ones(4))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=tracer)
    thread.start()
    assert inside.wait(WAIT)
    try:
        torch.rand(100)
        torch.manual_seed(4321)
        drawn = torch.rand(3)
    finally:
        release.set()
        thread.join(WAIT)
    assert errors == []
    assert torch.initial_seed() == 4321, "another thread's seed is not undone"
    torch.manual_seed(4321)
    torch.rand(3)
    assert not torch.equal(torch.rand(3), drawn)


def test_the_guards_pass_everything_through_outside_a_trace():
    seed, fork = torch.manual_seed, torch.random.fork_rng
    with rng_state_unchanged(API):
        pass
    assert (torch.manual_seed, torch.random.fork_rng) == (seed, fork), "a trace replaces no function"
    torch.manual_seed(7)
    assert torch.initial_seed() == 7
    assert torch.manual_seed.__name__ == "manual_seed" and torch.manual_seed.__doc__ == seed.__wrapped__.__doc__
    with torch.random.fork_rng():
        torch.manual_seed(8)
    assert torch.initial_seed() == 7


def test_sg_static_refuses_seeding_in_the_step():
    def step(x):
        torch.manual_seed(0)
        return F.dropout(x, 0.5, training=True)

    what = r"torch\.manual_seed\(\) changes the global RNG state"
    pattern = rf"^sg\.static\(\S*step\): {what} at {line_of(step, 'manual_seed')}"
    with pytest.raises(sg.CaptureError, match=pattern):
        sg.static(step)(torch.ones(4))
    assert torch.initial_seed() == 1234


def test_sg_static_dropout_steps_trace_and_draw_fresh_masks():
    step = sg.static(lambda x: F.dropout(x, 0.5, training=True))
    first, second = step(torch.ones(64)), step(torch.ones(64))
    assert not torch.equal(first, second)
