"""The capture contract: what cannot be captured raises at trace time, naming the
op (or the input's path), the user's source line, and what to do instead."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import sgraph as sg


def line_of(fn, text):
    """``test_capture.py:N`` where N is the line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return re.escape(f"test_capture.py:{start + offset} in {fn.__name__} (`{lines[offset].strip()}`)")


def uses_item(x):
    y = x * 2
    return y + y.sum().item()


def uses_tolist(x):
    return torch.tensor(x.tolist())


def branches_on_value(x):
    if x.sum() > 0:
        return x
    return -x


def prints(x):
    print(x)
    return x


def formats(x):
    return x, f"{x.sum():.3f}"


def masks(x):
    return x[x > 0].sum()


def nonzero(x):
    return torch.nonzero(x)


def synchronizes(x):
    torch.cuda.synchronize()
    return x


CASES = [
    (uses_item, "y + y.sum().item()", r"Tensor\.item\(\) reads a tensor's value on the host", "torch.where"),
    # make_fx turns .tolist() into .item() calls before any mode sees it.
    (uses_tolist, "torch.tensor(x.tolist())", r"Tensor\.item\(\) reads a tensor's value", "return what you want"),
    (branches_on_value, "if x.sum() > 0:", r"Python control flow \(bool\(tensor\)\)", r"torch\.where\(cond, a, b\)"),
    (prints, "print(x)", r"printing a tensor", "print it after the call"),
    (formats, 'f"{x.sum():.3f}"', r"printing a tensor \(Tensor\.__format__\)", "print it after the call"),
    (masks, "x[x > 0].sum()", r"depends on tensor data", r"torch\.where\(mask, x, 0\)"),
    (nonzero, "torch.nonzero(x)", r"aten\.nonzero\.default on \(f32\[4\]\)", "fixed-shape"),
    (synchronizes, "torch.cuda.synchronize()", r"torch\.cuda\.synchronize\(\)", "Remove it from the step"),
]


@pytest.mark.parametrize("fn, text, what, fix", CASES, ids=[c[0].__name__ for c in CASES])
def test_contract_violation_raises_with_op_line_and_fix(fn, text, what, fix):
    step = sg.static(fn)
    with pytest.raises(sg.CaptureError) as info:
        step(torch.randn(4))
    message = str(info.value)
    assert message.startswith(f"sg.static({fn.__name__}): ")
    assert re.search(what, message), message
    assert re.search(line_of(fn, text), message), message
    assert re.search(fix, message), message


def mutates_input(params, x):
    params["w"].add_(x)
    return x * 2


def test_writing_into_an_input_that_is_not_donated_names_path_and_line():
    params = {"w": torch.zeros(3)}
    with pytest.raises(sg.CaptureError) as info:
        sg.static(mutates_input)(params, torch.ones(3))
    message = str(info.value)
    assert "writes in place into input params['w']" in message
    assert re.search(line_of(mutates_input, 'params["w"].add_(x)'), message), message
    assert "donate" in message
    assert torch.equal(params["w"], torch.zeros(3)), "tracing must not touch the user's tensors"


def test_writing_into_a_view_of_an_input_is_caught_too():
    def step(params):
        params["w"][0].mul_(2)
        return params["w"].sum()

    with pytest.raises(sg.CaptureError, match=r"writes in place into input params\['w'\] at .*mul_"):
        sg.static(step)({"w": torch.ones(3)})


def test_donating_the_input_allows_the_write():
    params = {"w": torch.zeros(3)}
    out = sg.static(mutates_input, donate="params")(params, torch.ones(3))
    assert torch.equal(params["w"], torch.ones(3)) and torch.equal(out, torch.full((3,), 2.0))


def test_parameter_closed_over_instead_of_passed_raises():
    layer = torch.nn.Linear(3, 2)

    def step(x):
        return layer(x).sum()

    with pytest.raises(sg.CaptureError, match=r"reads an nn\.Parameter of shape \[2, 3\] .*not an argument"):
        sg.static(step)(torch.ones(4, 3))


def test_constants_closed_over_are_allowed():
    table = torch.arange(4.0)
    assert torch.equal(sg.static(lambda x: x + table)(torch.ones(4)), torch.arange(4.0) + 1)
