"""An error raised while a compiled step runs (not while it is traced) names the
user's line it comes from: the traceback itself ends in generated code."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import sgraph as sg

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")


def step(params, idx):
    rows = F.embedding(idx, params["weight"])  # the line the note names
    return rows.sum()


PARAMS = {"weight": torch.randn(10, 4)}


def test_an_index_out_of_range_names_the_op_and_the_source_line():
    compiled = sg.static(step)
    compiled(PARAMS, torch.tensor([1, 2]))
    with pytest.raises(IndexError) as info:
        compiled(PARAMS, torch.tensor([1, 20]))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "aten.embedding" in note
    assert "test_runtime_errors.py:18 in step" in note and "F.embedding(idx" in note


@pytest.mark.slow
def test_under_fuse_it_names_the_generated_kernel_and_the_source_line():
    compiled = sg.static(sg.fuse(step))
    compiled(PARAMS, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="index out of bounds") as info:
        compiled(PARAMS, torch.tensor([1, 20]))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "generated kernel" in note
    assert "test_runtime_errors.py:18 in step" in note
