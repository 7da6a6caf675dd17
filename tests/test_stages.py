"""Staged use: trace -> lower -> compile, listings, signatures, reprs."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import sgraph as sg


def step(params, batch):
    loss, grads = sg.value_and_grad(loss_fn)(params, batch)
    new = sg.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    return new, {"loss": loss}


def loss_fn(params, batch):
    x, y = batch
    return ((torch.tanh(x @ params["w"]) - y) ** 2).mean()


def args():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=g)}, (torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g))


def test_trace_lists_forward_backward_and_update_with_source_lines():
    traced = sg.static(step).trace(*args())
    text = traced.as_text()
    lines, start = inspect.getsourcelines(loss_fn)
    forward_line = start + next(i for i, line in enumerate(lines) if "torch.tanh" in line)
    update_line = inspect.getsourcelines(step)[1] + 2
    assert re.search(rf"aten\.tanh\(.*# test_stages\.py:{forward_line} in loss_fn: return", text), text
    assert re.search(rf"aten\.tanh_backward\(.*# backward of test_stages\.py:{forward_line} in loss_fn", text), text
    assert re.search(rf"aten\.sub\.Tensor\(.*# test_stages\.py:{update_line} in <lambda>", text), text
    assert "<- params['w']" in text and "<- batch[0]" in text
    assert "result[1]['loss']" in text
    assert isinstance(traced.graph, torch.fx.Graph)


def test_every_op_node_has_a_user_source():
    program = sg.static(step).trace(*args()).lower().program
    missing = [n.name for n in program.ops() if "sgraph_source" not in n.meta]
    assert not missing


def test_lower_runs_the_passes_and_compile_is_callable():
    params, batch = args()
    lowered = sg.static(step, donate="params").trace(params, batch).lower()
    assert lowered.program.passes == ("replay", "cleanup", "simplify", "donation", "reinplace")
    assert not any(n.target is torch.ops.aten.detach.default for n in lowered.program.ops())
    assert "(written into donated input params['w'])" in lowered.as_text()
    compiled = lowered.compile()
    expected = step({"w": params["w"].clone()}, batch)
    new, metrics = compiled(params, batch)
    assert torch.equal(new["w"], expected[0]["w"]) and torch.equal(metrics["loss"], expected[1]["loss"])


def test_lowering_leaves_the_traced_program_as_it_was():
    """The pipeline edits one copy of the traced graph in place: the traced program
    keeps its listing and graph, and lowering it again gives the same program."""
    params, batch = args()
    traced = sg.static(step, donate="params").trace(params, batch)
    text, graph_module = traced.as_text(), traced.program.graph_module
    nodes = [(n.name, n.target, n.args) for n in traced.graph.nodes]
    first, second = traced.lower(), traced.lower()
    assert traced.as_text() == text and traced.program.graph_module is graph_module
    assert [(n.name, n.target, n.args) for n in traced.graph.nodes] == nodes
    assert first.program.graph_module is not graph_module
    assert first.program.graph_module is not second.program.graph_module
    assert first.as_text() == second.as_text() and first.as_text() != text
    assert any(n.target is torch.ops.aten.detach.default for n in traced.program.ops())  # cleanup's work


def test_a_pass_edits_in_place_only_when_asked():
    from sgraph._src.passes.cleanup import cleanup

    program = sg.static(step).trace(*args()).program
    detached = lambda p: sum(n.target is torch.ops.aten.detach.default for n in p.ops())  # noqa: E731
    before = detached(program)
    copied = cleanup(program)
    assert copied.graph_module is not program.graph_module and detached(program) == before > detached(copied) == 0
    edited = cleanup(program, in_place=True)
    assert edited.graph_module is program.graph_module and detached(program) == 0


def test_graph_code_is_generated_on_the_first_eager_call_only(monkeypatch):
    generated = []
    recompile = torch.fx.GraphModule.recompile

    def counting(self):
        generated.append(self)
        return recompile(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counting)
    params, batch = args()
    expected = step({"w": params["w"].clone()}, batch)
    compiled = sg.static(step, donate="params").lower(params, batch).compile()
    assert generated == []  # tracing and the passes only read and edit graphs
    new, metrics = compiled(params, batch)
    assert torch.equal(new["w"], expected[0]["w"]) and torch.equal(metrics["loss"], expected[1]["loss"])
    compiled(new, batch)
    assert len(generated) == 1


def test_compiled_rejects_another_signature():
    params, batch = args()
    compiled = sg.static(step).trace(params, batch).lower().compile()
    with pytest.raises(TypeError, match=re.escape("batch[0]: f32[5, 3] -> f32[4, 3]")):
        compiled(params, (batch[0][:4], batch[1]))


def test_compiled_names_the_leaves_of_another_structure():
    params, batch = args()
    compiled = sg.static(step).trace(params, batch).lower().compile()
    with pytest.raises(TypeError, match=re.escape("params['b'] is new")):
        compiled({**params, "b": torch.ones(2)}, batch)
    with pytest.raises(TypeError, match=re.escape("batch[2] is new")):
        compiled(params, (*batch, batch[1]))
    with pytest.raises(TypeError, match=re.escape("1 positional argument and keywords ['batch']")):
        compiled(params, batch=batch)
    with pytest.raises(TypeError, match="too many positional arguments"):  # as Python says it
        compiled(params, batch, 1)


def test_signature_and_trace_count():
    static = sg.static(step)
    traced = static.trace(*args())
    assert static.trace_count == 1
    static.trace(*args())
    assert static.trace_count == 2
    assert traced.signature == static.trace(*args()).signature


def test_reprs_are_short_and_html_has_the_listing():
    static = sg.static(step)
    params, batch = args()
    static(params, batch)
    assert repr(static) == "<sg.static(step): 1 compiled signature, 1 traces>"
    traced = static.trace(params, batch)
    assert re.fullmatch(r"Traced\(sg\.static\(step\): \d+ ops, 3 tensor inputs\)", repr(traced))
    assert repr(traced.lower()).startswith("Lowered(") and repr(traced.lower().compile()).startswith("Compiled(")
    assert "aten.tanh" in traced._repr_html_() and "<details>" in traced._repr_html_()


def test_compiled_stats_on_cpu():
    static = sg.static(step)
    params, batch = args()
    for _ in range(3):
        static(params, batch)
    stats = static.last_compiled.stats
    assert stats.runtime == "eager" and stats.calls == 3 and stats.traces == 1 and stats.retraces == 0
    assert stats.kernel_launches is None and stats.trace_seconds > 0
