"""Full garbage collections are deferred while a step is traced, lowered and compiled,
and the collector's thresholds are given back as they were."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import sgraph as sg
from sgraph._src.collector import full_collections_deferred

DEFERRED = 1_000_000


@pytest.fixture(autouse=True)
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_thresholds_raised_inside_and_restored_after_nesting():
    with full_collections_deferred():
        assert gc.get_threshold() == (700, 10, DEFERRED)
        with full_collections_deferred():
            assert gc.get_threshold() == (700, 10, DEFERRED)
        assert gc.get_threshold() == (700, 10, DEFERRED)  # the outer stage still runs
    assert gc.get_threshold() == (700, 10, 10)


def test_restored_after_an_error():
    with pytest.raises(RuntimeError), full_collections_deferred():
        raise RuntimeError("a stage failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_the_user_set_meanwhile_are_kept():
    with full_collections_deferred():
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)


def test_overlapping_stages_in_two_threads_restore_once_both_end():
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with full_collections_deferred():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with full_collections_deferred():
        thread.start()
        assert inside.wait(10)
    assert gc.get_threshold() == (700, 10, DEFERRED)  # the other thread's stage is still running
    leave.set()
    thread.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_first_call_traces_and_compiles_with_full_collections_deferred():
    seen = []

    def step(w, x):
        seen.append(gc.get_threshold())  # the step's Python runs while it is traced
        return w - 0.1 * (x @ w).sum() * w

    static = sg.static(step)
    w, x = torch.ones(3, 3), torch.ones(2, 3)
    expected = step(w, x)
    seen.clear()
    assert torch.equal(static(w, x), expected)
    assert seen == [(700, 10, DEFERRED)]
    assert gc.get_threshold() == (700, 10, 10)
    static.trace(w, x).lower()
    assert seen[-1] == (700, 10, DEFERRED) and gc.get_threshold() == (700, 10, 10)


def test_the_signature_and_the_first_run_are_inside_the_deferral_too(monkeypatch):
    # A full collection started by the allocations of the signature or of the capture
    # (the first run) walks the whole heap like one during the trace.
    from sgraph._src import api, dispatch

    seen = {}
    signature_of, run = api.signature_of, dispatch.Entry.run

    def watched_signature(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["signature"] = gc.get_threshold()
        return signature_of(*args, **kwargs)

    def watched_run(self, tensors):  # type: ignore[no-untyped-def]
        seen.setdefault("first run", gc.get_threshold())
        return run(self, tensors)

    monkeypatch.setattr(api, "signature_of", watched_signature)
    monkeypatch.setattr(dispatch.Entry, "run", watched_run)
    static = sg.static(lambda w: w * 2)
    static(torch.ones(3))
    assert seen == {"signature": (700, 10, DEFERRED), "first run": (700, 10, DEFERRED)}
    assert gc.get_threshold() == (700, 10, 10)
