"""Errors torch raises while a step traces: the type eager PyTorch raises, the user's
line added, and no ERROR log lines from torch's fake-tensor machinery on the way."""

from __future__ import annotations

import inspect
import logging
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import sgraph as sg


def located(fn, text):
    """The suffix sgraph adds: ``(raised at file.py:N in fn (`code`) while sg.static(fn) traced the step)``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    where = f"test_capture_errors.py:{start + offset} in {fn.__name__} (`{lines[offset].strip()}`)"
    return re.escape(f"(raised at {where} while sg.static({fn.__name__}) traced the step)")


def views_across_strides(x):
    return x.reshape(2, 2).t().view(4)


def views_to_an_impossible_size(x):
    return x.view(-1, 3)


def multiplies_mismatched_matrices(x):
    return x.reshape(2, 2) @ torch.ones(3, 3)


def indexes_out_of_range(x):
    return x[10]


def indexes_with_floats(x):
    return x[torch.tensor([1.0])]


def reduces_a_missing_dim(x):
    return x.sum(dim=3)


def selects_with_a_float_condition(x):
    return torch.where(x, x, 0)


def divides_with_a_bad_rounding_mode(x):
    return x.div(2, rounding_mode="nearest")


def clamps_without_bounds(x):
    return x.clamp()


def adds_a_float_alpha_to_ints(x):
    return x.long().add(x.long(), alpha=1.5)


def broadcasts_mismatched_shapes(x):
    return x + torch.ones(3)


def concatenates_nothing(x):
    return torch.cat([])


MISTAKES = [
    (views_across_strides, ".view(4)"),
    (views_to_an_impossible_size, ".view(-1, 3)"),
    (multiplies_mismatched_matrices, "@ torch.ones(3, 3)"),
    (indexes_out_of_range, "x[10]"),
    (indexes_with_floats, "x[torch.tensor([1.0])]"),
    (reduces_a_missing_dim, "x.sum(dim=3)"),
    (selects_with_a_float_condition, "torch.where(x, x, 0)"),
    (divides_with_a_bad_rounding_mode, 'rounding_mode="nearest"'),
    (clamps_without_bounds, "x.clamp()"),
    (adds_a_float_alpha_to_ints, "alpha=1.5"),
    (broadcasts_mismatched_shapes, "x + torch.ones(3)"),
    (concatenates_nothing, "torch.cat([])"),
]


@pytest.mark.parametrize("fn, text", MISTAKES, ids=[m[0].__name__ for m in MISTAKES])
def test_a_mistake_raises_the_eager_type_with_the_user_line(fn, text):
    with pytest.raises(Exception) as eager:
        fn(torch.randn(4))
    with pytest.raises(Exception) as traced:
        sg.static(fn)(torch.randn(4))
    assert type(traced.value) is type(eager.value), (type(traced.value), type(eager.value), traced.value)
    assert re.search(located(fn, text) + "$", str(traced.value)), str(traced.value)


def test_a_bad_view_says_to_reshape_like_eager_does():
    with pytest.raises(RuntimeError, match=r"Cannot view a tensor .*; use \.reshape\(\.\.\.\) instead \(raised at"):
        sg.static(views_across_strides)(torch.randn(4))


def test_the_error_keeps_its_traceback_into_the_user_line():
    with pytest.raises(RuntimeError) as info:
        sg.static(views_across_strides)(torch.randn(4))
    names = [entry.name for entry in info.traceback]
    assert "views_across_strides" in names


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def fake_tensor_log():
    """What torch's fake-tensor logger emits (it has its own handler and does not propagate)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    handler = _Records()
    logger.addHandler(handler)
    yield logger, handler.records
    logger.removeHandler(handler)


def test_torch_error_logs_do_not_reach_the_user_while_tracing(fake_tensor_log):
    _, records = fake_tensor_log
    with pytest.raises(RuntimeError, match="reduction dim"):
        sg.static(multiplies_mismatched_matrices)(torch.randn(4))
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []


def test_logs_are_dropped_only_in_the_tracing_thread_and_only_while_it_traces(fake_tensor_log):
    logger, records = fake_tensor_log
    done = threading.Event()

    def other_thread() -> None:
        logger.error("from another thread")
        done.set()

    def step(x):
        logger.error("from the tracing thread")
        threading.Thread(target=other_thread).start()
        assert done.wait(10)
        return x * 2

    sg.static(step)(torch.ones(2))
    logger.error("after the trace")
    assert [r.getMessage() for r in records] == ["from another thread", "after the trace"]


def test_warnings_of_the_tracing_thread_still_pass(fake_tensor_log):
    logger, records = fake_tensor_log

    def step(x):
        logger.warning("a warning")
        return F.relu(x)

    sg.static(step)(torch.ones(2))
    assert [r.getMessage() for r in records] == ["a warning"]


def test_arguments_on_two_devices_are_named_with_the_fix():
    def step(params, batch):
        return (batch["x"] @ params["w"]).sum()

    params = {"w": torch.ones(3, 3, device="meta"), "b": torch.ones(3, device="meta")}
    batch = {"x": torch.ones(2, 3), "step": torch.tensor(1)}  # a 0-d CPU tensor mixes with any device
    with pytest.raises(RuntimeError) as caught:
        sg.static(step)(params, batch)
    message = str(caught.value)
    assert re.search(r"\(raised at test_capture_errors.py:\d+ in step \(`return \(batch", message), message
    assert "arguments are on 2 devices (on meta: params['b'], params['w']; on cpu: batch['x'])" in message, message
    assert "batch = sg.tree.map(lambda t: t.to('meta'), batch)" in message, message
