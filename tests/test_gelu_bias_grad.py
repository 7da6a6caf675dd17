"""The gelu_bias_grad pass: ``gelu_backward`` and the bias sum of its result handed to
one own op (``sgraph::gelu_bias_grad``).

The pass applies to CUDA steps only; here ``DEVICES`` lets it rewrite CPU graphs, where
the op runs ATen's ops (its Triton kernel is tested in ``test_kernels.py``, in the
interpreter and on the GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import GPT, TINY_GPT, gpt_loss, mlp

import sgraph as sg
from sgraph._src.passes import gelu_bias_grad as pass_module

OP = torch.ops.sgraph.gelu_bias_grad.default
GELU_BACKWARD = torch.ops.aten.gelu_backward.default
SUM = torch.ops.aten.sum.dim_IntList


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(pass_module, "DEVICES", ("cpu",))


def make_step(model, loss, autocast=False):
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)

    def loss_fn(params, batch):
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = apply(params, buffers, x)
        return loss(out.float(), y)

    def step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    return step, params, opt


def targets(program):
    return [n.target for n in program.graph.nodes]


def mlp_case(seed=0, bias=True, approximate="none"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16, bias=bias), nn.GELU(approximate), nn.Linear(16, 16), nn.GELU(approximate))
    model.append(nn.Linear(16, 5))
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    return make_step(model, F.cross_entropy), (x, y)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_each_gelu_gradient_and_its_bias_sum_become_one_op(on_cpu, approximate):
    (step, params, opt), batch = mlp_case(approximate=approximate)
    plain = sg.fuse(kernels=("adamw",))(step).lower(params, opt.init(params), batch).program
    lowered = sg.fuse(step).lower(params, opt.init(params), batch).program
    assert "gelu_bias_grad" in lowered.passes and "gelu_bias_grad" not in plain.passes
    assert targets(plain).count(GELU_BACKWARD) == 2 and OP not in targets(plain)
    assert targets(lowered).count(OP) == 2 and GELU_BACKWARD not in targets(lowered)
    assert targets(lowered).count(SUM) == targets(plain).count(SUM) - 2
    ops = [n for n in lowered.graph.nodes if n.target is OP]
    assert {n.args[2] for n in ops} == {approximate}
    assert all(n.meta["sgraph_source"].backward for n in ops)  # the user's line, as the ops it replaces


def test_not_on_a_cpu_step_by_default():
    (step, params, opt), batch = mlp_case()
    lowered = sg.fuse(step).lower(params, opt.init(params), batch).program
    assert OP not in targets(lowered) and targets(lowered).count(GELU_BACKWARD) == 2


def test_a_gelu_without_a_bias_sum_is_left_alone(on_cpu):
    """The Linear before the GELU has no bias: the GELU's gradient has no column sum to take along."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.GELU(), nn.Linear(16, 5))
    (step, params, opt), batch = make_step(model, F.cross_entropy), (torch.randn(8, 12), torch.randint(0, 5, (8,)))
    lowered = sg.fuse(step).lower(params, opt.init(params), batch).program
    assert OP not in targets(lowered) and GELU_BACKWARD in targets(lowered)


def test_other_sums_of_a_gelu_gradient_are_left_alone(on_cpu):
    """A row sum (over the last dimension) and a sum in another dtype are no bias gradients."""

    def step(dy, x):
        g = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
        return g.sum(-1), g.sum(0, dtype=torch.float64), g.view(2, 3, 4).sum(1)

    lowered = sg.fuse(step).lower(torch.randn(6, 4), torch.randn(6, 4)).program
    assert OP not in targets(lowered) and GELU_BACKWARD in targets(lowered)
    for bias_sum in (lambda g: g.sum((0, 1)), lambda g: g.view(6, 4).sum(0, keepdim=True)):
        matched = sg.fuse(lambda dy, x, bias_sum=bias_sum: bias_sum(torch.ops.aten.gelu_backward(dy, x)) * 2)
        dy, x = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        program = matched.lower(dy, x).program
        assert OP in targets(program) and GELU_BACKWARD not in targets(program)
        torch.testing.assert_close(matched(dy, x), bias_sum(torch.ops.aten.gelu_backward(dy, x)) * 2)


def test_fused_steps_match_eager_and_the_pass_off(on_cpu):
    """Three AdamW steps of a bf16-autocast MLP, donated: the fused step with the op as
    without it and within bf16 noise of eager (on the CPU the op runs ATen's ops)."""
    torch.manual_seed(0)
    step, params, opt = make_step(mlp(32, 2, 10), F.cross_entropy, autocast=True)
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    runs = {}
    with_op = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    without = sg.static(sg.fuse(kernels=("adamw",))(step), donate=("params", "opt_state"))
    for name, fn in (("eager", step), ("op", with_op), ("off", without)):
        p = copy.deepcopy(params)
        s = opt.init(p)
        losses = []
        for _ in range(3):
            p, s, metrics = fn(p, s, batch)
            losses.append(metrics["loss"])
        runs[name] = (p, torch.stack(losses))
    assert targets(with_op.last_compiled.lowered.program).count(OP) == 2
    assert OP not in targets(without.last_compiled.lowered.program)
    for key in params:
        torch.testing.assert_close(runs["op"][0][key], runs["off"][0][key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["op"][1], runs["eager"][1], rtol=1e-2, atol=0)


def test_inside_reused_gpt_blocks(on_cpu):
    """The op sits inside each block's backward: the blocks still share their code, and
    three steps agree with eager."""
    torch.manual_seed(0)
    step, params, opt = make_step(GPT(TINY_GPT), gpt_loss, autocast=True)
    x, y = (torch.randint(0, TINY_GPT.vocab, (2, TINY_GPT.seq)) for _ in range(2))
    fused = sg.static(sg.fuse(step), donate=("params", "opt_state"))
    p_e, s_e = copy.deepcopy(params), opt.init(params)
    p_f, s_f = copy.deepcopy(params), opt.init(params)
    for _ in range(3):
        p_e, s_e, eager = step(p_e, s_e, (x, y))
        p_f, s_f, mine = fused(p_f, s_f, (x, y))
        torch.testing.assert_close(mine["loss"], eager["loss"], rtol=1e-2, atol=0)
    compiled = fused.last_compiled
    assert targets(compiled.lowered.program).count(OP) == TINY_GPT.layers
    assert compiled.stats.block_calls == 2 * TINY_GPT.layers and compiled.stats.block_subgraphs == 2
