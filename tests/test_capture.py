"""The capture contract: what cannot be captured raises at trace time, naming the
op (or the input's path), the user's source line, and what to do instead."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import traceback

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


def indexes_with_a_count(x):
    return x[(x > 0).sum()]


def slices_to_a_count(x):
    n = (x > 0).sum()
    return x[:n]


def aranges_to_a_count(x):
    n = (x > 0).sum()
    return torch.arange(n)


def repeats_a_count(x):
    n = (x > 0).sum()
    return x.repeat(n)


def reads_data_ptr(x):
    return x * (x.data_ptr() % 2)


def reads_untyped_storage(x):
    y = x * 2
    return y, y.untyped_storage()


def reads_storage(x):
    return x, x.storage()


CASES = [
    (uses_item, "y + y.sum().item()", r"Tensor\.item\(\) reads a tensor's value on the host", "torch.where"),
    # FakeTensor.tolist calls .item() in Python; the message still names .tolist().
    (uses_tolist, "torch.tensor(x.tolist())", r"Tensor\.tolist\(\) copies a tensor to a Python list", "return what"),
    (branches_on_value, "if x.sum() > 0:", r"Python control flow \(bool\(tensor\)\)", r"torch\.where\(cond, a, b\)"),
    (prints, "print(x)", r"printing a tensor", "print it after the call"),
    (formats, 'f"{x.sum():.3f}"', r"printing a tensor \(Tensor\.__format__\)", "print it after the call"),
    (masks, "x[x > 0].sum()", r"depends on tensor data", r"torch\.where\(mask, x, 0\)"),
    (nonzero, "torch.nonzero(x)", r"aten\.nonzero\.default on \(f32\[4\]\)", "fixed-shape"),
    (synchronizes, "torch.cuda.synchronize()", r"torch\.cuda\.synchronize\(\)", "Remove it from the step"),
    (indexes_with_a_count, "x[(x > 0).sum()]", r"indexing x\[\.\.\.\] \(Tensor\.__getitem__\)", r"x\.index_select"),
    (
        slices_to_a_count,
        "return x[:n]",
        r"Tensor\.__getitem__\) at .* depends on tensor data",
        r"arange\(len\(x\)\) < n",
    ),
    (aranges_to_a_count, "torch.arange(n)", r"aten\.arange\.default at .* depends on tensor data", "fixed-shape"),
    (repeats_a_count, "x.repeat(n)", r"aten\.repeat\.default on \(f32\[4\]\) at", r"x\.index_select\(0, i\)"),
    (reads_data_ptr, "x.data_ptr()", r"Tensor\.data_ptr\(\) reads a memory address", "compare or inspect"),
    (reads_untyped_storage, "y.untyped_storage()", r"Tensor\.untyped_storage\(\) reads a tensor's storage", "Remove"),
    (reads_storage, "x.storage()", r"Tensor\.storage\(\) reads .* no meaning while the step is traced", "Remove"),
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


def test_data_dependent_error_carries_no_torch_internals():
    with pytest.raises(sg.CaptureError) as info:
        sg.static(slices_to_a_count)(torch.randn(4))
    shown = "".join(traceback.format_exception(info.value))
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "GuardOnDataDependentSymNode" not in shown and "TORCH_LOGS" not in shown, shown


def test_importing_sgraph_leaves_sympy_to_the_first_trace():
    code = "import sys, torch; before = 'sympy' in sys.modules; import sgraph; print(before, 'sympy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() in (["False", "False"], ["True", "True"]), result.stdout


def host_tolist_2d(x):
    return x.reshape(2, 2).tolist()


def host_numpy(x):
    return x.numpy()


def host_int(x):
    return int(x.sum())


def host_float(x):
    return float(x.sum())


def host_bool(x):
    return bool(x.sum())


def host_if(x):
    if x.sum():
        return x
    return -x


def host_item(x):
    return x.sum().item()


HOST_CALLS = [
    (host_tolist_2d, ".tolist()", "Tensor.tolist()"),
    (host_numpy, ".numpy()", "Tensor.numpy()"),
    (host_int, "return int(", "Tensor.__int__()"),
    (host_float, "return float(", "Tensor.__float__()"),
    (host_bool, "return bool(", "Tensor.__bool__()"),
    (host_if, "if x.sum():", "Tensor.__bool__()"),
    (host_item, ".item()", "Tensor.item()"),
]


@pytest.mark.parametrize("fn, text, name", HOST_CALLS, ids=[c[0].__name__ for c in HOST_CALLS])
def test_each_host_read_names_itself(fn, text, name):
    pattern = rf"^sg\.static\({fn.__name__}\): {re.escape(name)} .* at {line_of(fn, text)}, "
    with pytest.raises(sg.CaptureError, match=pattern):
        sg.static(fn)(torch.randn(4))


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
