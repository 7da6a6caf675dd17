"""Gapped inputs a CUDA graph copies are laid out densely in the program.

The pass applies only where the step replays as a CUDA graph; here its program is
built on the CPU and run on the CPU, which checks what the GPU depends on: the new
layout's values computed again agree with a full propagation, the program computes
the same values from a dense copy of a gapped input as the traced one from the input
itself, and the inputs it must leave alone stay as traced. The whole path on the GPU:
tests/test_static_gpu.py::test_a_gapped_input_gets_a_dense_graph_buffer_and_matches_eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import sgraph as sg
from sgraph._src.passes.dense_inputs import dense_inputs, dense_layout, has_gaps
from sgraph._src.program import placeholders
from sgraph._src.runtime.cudagraph import StaticBuffer, relaid


def step(params, batch):
    def loss_fn(p):
        h = F.gelu(batch["x"] @ p["w1"] + p["b1"])
        h = F.layer_norm(h, (h.shape[-1],))
        return F.cross_entropy(h @ p["w2"], batch["y"])

    loss, grads = sg.value_and_grad(loss_fn)(params)
    new = sg.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    # views of the gapped input returned, and a reduction over one
    return new, {"loss": loss, "rows": batch["x"][1:].sum(0), "xt": batch["x"].t(), "y2": batch["y"][::2]}


def arguments(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(16, 32, generator=g),
        "b1": torch.randn(32, generator=g),
        "w2": torch.randn(32, 10, generator=g),
    }
    feats, labels = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64, 4), generator=g)
    return params, {"x": feats[:, 8:24], "y": labels[:, 1]}


def lowered(fn=step, donate=("params",), args=None):
    return sg.static(fn, donate=donate).lower(*(args or arguments()))


def layouts(program):
    return [(n.meta["val"].shape, n.meta["val"].stride()) for n in placeholders(program.graph)]


def test_not_applied_where_the_step_does_not_replay_as_a_graph():
    program = lowered().program
    assert "dense_inputs" not in program.passes
    assert (torch.Size([64, 16]), (256, 1)) in layouts(program)


def test_gapped_inputs_get_dense_layouts_and_the_program_computes_the_same_values():
    params, batch = arguments()
    traced = lowered(args=(params, batch)).program
    program = dense_inputs(traced)
    assert program.passes[-1] == "dense_inputs"
    assert layouts(program) == [
        (torch.Size([32]), (1,)),
        (torch.Size([16, 32]), (32, 1)),
        (torch.Size([32, 10]), (10, 1)),
        (torch.Size([64, 16]), (16, 1)),  # was (256, 1)
        (torch.Size([64]), (1,)),  # was (4,)
    ]
    assert layouts(traced)[3:] == [(torch.Size([64, 16]), (256, 1)), (torch.Size([64]), (4,))]
    inputs = [params["b1"], params["w1"], params["w2"], batch["x"], batch["y"]]
    want = traced.graph_module(*[t.clone() for t in inputs[:3]], *inputs[3:])
    got = program.graph_module(*[relaid(t.clone(), n.meta["val"]) for t, n in zip(inputs, placeholders(program.graph))])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_values_computed_again_agree_with_a_full_propagation():
    program = dense_inputs(lowered().program)
    mine = {n.name: n.meta.get("val") for n in program.graph.nodes}
    full = program.copy_graph_module()
    full.recompile()
    from torch._guards import detect_fake_mode

    inputs = [n.meta["val"] for n in placeholders(full.graph)]
    FakeTensorProp(full, mode=detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)

    def laid(v):
        vs = v if isinstance(v, (list, tuple)) else [v]
        return [(t.shape, t.dtype, t.stride(), t.storage_offset()) for t in vs if isinstance(t, torch.Tensor)]

    compared = [n for n in full.graph.nodes if n.op != "output"]
    assert len(compared) > 30
    for node in compared:
        assert laid(node.meta.get("val")) == laid(mine[node.name]), node.name


@pytest.mark.filterwarnings("ignore::sgraph.DonationWarning")
def test_donated_expanded_dense_and_addressed_inputs_stay_as_traced():
    def addressed(params, batch):
        # explicit strides into the input's memory: a dense copy would read other elements
        return params, batch["x"].as_strided((4, 4), (256, 2)).sum() + batch["y"].sum()

    params, batch = arguments()
    for program in (
        lowered(donate=("params", "batch")).program,  # the gapped inputs are donated
        lowered(addressed, args=(params, {"x": batch["x"], "y": torch.randn(8).expand(4, 8)})).program,
        lowered(args=(params, {"x": batch["x"].contiguous(), "y": batch["y"].contiguous()})).program,
    ):
        assert dense_inputs(program) is program


def test_a_gapped_input_beside_an_addressed_one_is_still_laid_out_densely():
    def step2(params, batch):
        return params, batch["x"].as_strided((2, 2), (256, 1)).sum() + (batch["z"] * 2).sum()

    params, batch = arguments()
    program = dense_inputs(lowered(step2, args=(params, {"x": batch["x"], "z": batch["x"][:, ::3]})).program)
    x, z = layouts(program)[-2:]
    assert x == (torch.Size([64, 16]), (256, 1)) and z == (torch.Size([64, 6]), (6, 1))


@pytest.mark.parametrize(
    "make, gaps",
    [
        (lambda: torch.randn(8, 32)[:, :4], True),
        (lambda: torch.randn(32)[::2], True),
        (lambda: torch.randn(6, 8, 4).permute(2, 0, 1)[:, ::2], True),
        (lambda: torch.randn(24, 10).t(), False),
        (lambda: torch.randn(16).expand(3, 16), False),
        (lambda: torch.randn(12, 16)[2:], False),
        (lambda: torch.randn(40).as_strided((10, 16), (2, 1)), False),
        (lambda: torch.randn(0, 4), False),
        (lambda: torch.randn(10, 1, 3)[:, :1], False),  # a size-1 dim's stride is no gap
        (lambda: torch.randn(10, 1, 3)[:, :, :1], True),
    ],
)
def test_gaps_and_the_dense_layout_of_a_tensor(make, gaps):
    t = make()
    assert has_gaps(t) is gaps
    if gaps:
        dense = torch.empty_like(t)  # what torch makes for it: dims in the same order
        assert dense_layout(t) == dense.stride()
        copy = relaid(t, dense)
        assert copy.stride() == dense.stride() and torch.equal(copy, t)
        buffer = StaticBuffer(t, dense)
        assert buffer.view.stride() == dense.stride() and torch.equal(buffer.view, t)
        assert buffer.filled.untyped_storage().nbytes() == t.numel() * t.element_size()
        again = make()
        buffer.filled.copy_(buffer.source(again))
        assert torch.equal(buffer.view, again)
    assert relaid(t, t) is t


def test_generated_code_for_the_dense_layout_reads_a_dense_copy_right():
    """Inductor's code is compiled for the strides the program states: compiled after
    the pass, fed the dense copies the graph's buffers hold, it gives the traced step's
    values; fed the gapped inputs as they are, it reads other elements (which is why
    every path of the graph's runtime copies them first)."""
    from sgraph._src.runtime.inductor import InductorExecutable

    params, batch = arguments()
    low = sg.static(sg.fuse(step), donate=("params",)).lower(params, batch)
    program = dense_inputs(low.program)
    inputs = [params["b1"], params["w1"], params["w2"], batch["x"], batch["y"]]
    want = low.program.graph_module(*[t.clone() for t in inputs[:3]], *inputs[3:])
    body = InductorExecutable(program, low.traced.options.fuse)
    got = body([relaid(t.clone(), n.meta["val"]) for t, n in zip(inputs, placeholders(program.graph))])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    misread = body([t.clone() for t in inputs[:3]] + inputs[3:])
    assert not torch.allclose(misread[3], want[3])  # the loss
