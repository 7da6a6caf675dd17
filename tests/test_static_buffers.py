"""The CUDA graph's buffers for inputs it does not own: laid out as the inputs are.

Generated code reads an input with the strides it was traced with, so the buffer the
graph reads must have them, and refilling it from the next call's input (same
strides, other values) must give that input's elements. The buffer logic is plain
tensor code, checked here on the CPU; the GPU test of the whole path is
tests/test_fuse_gpu.py::test_inputs_with_gaps_transposed_or_expanded_match_eager_under_the_graph.
"""

import pytest
import torch

from sgraph._src.runtime.cudagraph import StaticBuffer
from sgraph._src.runtime.eager import copy_lists

LAYOUTS = {
    "contiguous": lambda: torch.randn(10, 16),
    "transposed": lambda: torch.randn(24, 10).t(),
    "gaps": lambda: torch.randn(10, 32)[:, ::2],
    "offset": lambda: torch.randn(12, 16)[2:],
    "expanded": lambda: torch.randn(16).expand(10, 16),
    "expanded-gaps": lambda: torch.randn(32)[::2].expand(3, 16),
    "overlapping": lambda: torch.randn(40).as_strided((10, 16), (2, 1)),
    "scalar": lambda: torch.tensor(3.0),
    "empty": lambda: torch.randn(0, 4),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_buffer_has_its_inputs_strides_and_refills_with_the_next_inputs_elements(layout):
    first, second = LAYOUTS[layout](), LAYOUTS[layout]()
    assert first.stride() == second.stride()
    before = first.clone()
    buffer = StaticBuffer(first)
    assert (buffer.view.shape, buffer.view.stride()) == (first.shape, first.stride())
    assert torch.equal(buffer.view, first)
    if first.numel():
        assert buffer.view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    # several buffers refill together (the multi-tensor copy of a replay)
    other = StaticBuffer(torch.randn(4, 4))
    copy_lists([buffer.filled, other.filled], [buffer.source(second), other.source(torch.ones(4, 4))])
    assert torch.equal(buffer.view, second)
    assert torch.equal(other.view, torch.ones(4, 4))
    assert torch.equal(first, before)  # the input is only read
