"""Tracing changes nothing other threads can see: ``torch.cuda.synchronize`` refuses
only in the thread that traces a step, and never stays patched afterwards.

There is no CUDA here, so ``torch.cuda.synchronize`` is replaced by a recording fake
(as a profiler or a test would); sgraph's guard wraps whatever is installed."""

from __future__ import annotations

import threading

import pytest
import torch

import sgraph as sg
from sgraph._src.capture import no_host_sync

WAIT = 10


@pytest.fixture
def synchronize(monkeypatch):
    """A fake ``torch.cuda.synchronize`` recording the threads that called it."""
    calls: list[str] = []

    def fake_synchronize(device=None):
        """Wait for all kernels in all streams on a CUDA device to complete."""
        calls.append(threading.current_thread().name)

    monkeypatch.setattr(torch.cuda, "synchronize", fake_synchronize)
    return fake_synchronize, calls


def run_in_thread(target, name):
    """Start ``target`` in a thread; return it and a list that receives its exception."""
    errors: list[BaseException] = []

    def run():
        try:
            target()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, errors


def test_another_thread_synchronizes_while_a_step_traces(synchronize):
    original, calls = synchronize
    inside, release = threading.Event(), threading.Event()

    def step(x):
        inside.set()
        assert release.wait(WAIT)
        return x * 2

    tracer, errors = run_in_thread(lambda: sg.static(step)(torch.ones(2)), "tracer")
    assert inside.wait(WAIT)
    try:
        torch.cuda.synchronize()
    finally:
        release.set()
        tracer.join(WAIT)
    assert errors == [] and calls == ["MainThread"]


def test_the_tracing_thread_itself_is_refused(synchronize):
    _, calls = synchronize
    with no_host_sync("sg.static(step)"):
        with pytest.raises(sg.CaptureError, match=r"^sg\.static\(step\): torch\.cuda\.synchronize\(\) at .* waits"):
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    assert calls == ["MainThread"]


def test_overlapping_traces_leave_the_original_behaviour(synchronize):
    """A enters, B enters, A leaves, B leaves: the order that used to leave A's
    refusing function installed for good."""
    original, calls = synchronize
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def trace_a():
        with no_host_sync("sg.static(a)"):
            a_in.set()
            assert b_in.wait(WAIT)
        a_out.set()

    def trace_b():
        assert a_in.wait(WAIT)
        with no_host_sync("sg.static(b)"):
            b_in.set()
            assert a_out.wait(WAIT)

    threads = [run_in_thread(trace_a, "a"), run_in_thread(trace_b, "b")]
    for thread, errors in threads:
        thread.join(WAIT)
        assert errors == []
    torch.cuda.synchronize()
    assert calls == ["MainThread"]
    assert torch.cuda.synchronize.__wrapped__ is original


def test_many_concurrent_traces_each_refuse_their_own_call_only(synchronize):
    original, calls = synchronize
    count = 16
    barrier = threading.Barrier(count)

    def trace(i):
        with no_host_sync(f"sg.static(step{i})"):
            barrier.wait(WAIT)
            with pytest.raises(sg.CaptureError, match=rf"^sg\.static\(step{i}\): torch\.cuda\.synchronize"):
                torch.cuda.synchronize()
            barrier.wait(WAIT)
        torch.cuda.synchronize()

    threads = [run_in_thread(lambda i=i: trace(i), f"t{i}") for i in range(count)]
    for thread, errors in threads:
        thread.join(WAIT)
        assert errors == []
    torch.cuda.synchronize()
    assert sorted(calls) == sorted([f"t{i}" for i in range(count)] + ["MainThread"])


def test_a_trace_replaces_no_function():
    synchronize = torch.cuda.synchronize
    sg.static(lambda x: x * 2)(torch.ones(2))
    assert torch.cuda.synchronize is synchronize


def test_the_wrapper_looks_like_the_original(synchronize):
    original, _ = synchronize
    with no_host_sync("sg.static(step)"):
        pass
    wrapper = torch.cuda.synchronize
    assert wrapper.__wrapped__ is original
    assert (wrapper.__name__, wrapper.__doc__, wrapper.__qualname__) == (
        original.__name__,
        original.__doc__,
        original.__qualname__,
    )
    with no_host_sync("sg.static(step)"):
        pass
    assert torch.cuda.synchronize is wrapper, "the guard is installed once"


@pytest.mark.skipif(not hasattr(torch, "accelerator"), reason="torch.accelerator is new in torch 2.6")
def test_accelerator_synchronize_is_refused_too(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    with no_host_sync("sg.static(step)"):
        with pytest.raises(sg.CaptureError, match=r"torch\.accelerator\.synchronize\(\) at .* waits"):
            torch.accelerator.synchronize()
    torch.accelerator.synchronize()
