"""Recurrent layers through sg.static: bitwise parity with the eager step; the
``replay`` pass that makes ``nn.LSTM``'s oneDNN kernels replay on CPU; and the
trace-time refusal of cuDNN RNNs on CUDA, naming what works instead.

On CPU, ``nn.LSTM`` runs ``aten.mkldnn_rnn_layer``, whose kernel saves the workspace
its backward needs only when grad mode is on; runtimes replay the graph under
``no_grad``. The ``replay`` pass runs that op with grad mode on (see its module).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn as nn

import sgraph as sg
from sgraph._src.passes.replay import replay
from sgraph._src.program import returned

aten = torch.ops.aten
FORWARD, BACKWARD = aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default
T, N, IN, H = 2, 2, 3, 4  # steps, batch, input size, hidden size


def grad_step(module, argnums=0):
    """A step returning the loss and gradients of the summed RNN outputs, as eager code."""
    apply, params, buffers = sg.functional(module)

    def loss(params, x, state):
        out, last = apply(params, buffers, x) if state is None else apply(params, buffers, x, state)
        return out.sum() + sum(t.square().sum() for t in torch.utils._pytree.tree_leaves(last))

    def step(params, x, state):
        return sg.value_and_grad(loss, argnums=argnums)(params, x, state)

    return step, params


def assert_bitwise(expected, found):
    want, got = sg.tree.leaves(expected), sg.tree.leaves(found)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert torch.equal(a, b), (a - b).abs().max()
    # Eager gives every gradient its own tensor; so must the step.
    assert len({id(t) for t in got}) == len(got)


LSTMS = {
    "one layer": dict(),
    "two layers, bidirectional": dict(num_layers=2, bidirectional=True),
    "two layers, batch_first, (h0, c0)": dict(num_layers=2, batch_first=True, state=True),
    "no bias": dict(bias=False),
    "proj_size, (h0, c0)": dict(proj_size=2, state=True),
}


def lstm_case(num_layers=1, bidirectional=False, batch_first=False, proj_size=0, state=False, bias=True):
    torch.manual_seed(0)
    module = nn.LSTM(IN, H, num_layers, bias, batch_first, 0.0, bidirectional, proj_size)
    x = torch.randn((N, T, IN) if batch_first else (T, N, IN))
    d = num_layers * (2 if bidirectional else 1)
    h0c0 = (torch.randn(d, N, proj_size or H), torch.randn(d, N, H)) if state else None
    return module, x, h0c0


@pytest.mark.parametrize("case", list(LSTMS))
def test_lstm_step_matches_eager_bitwise(case):
    module, x, h0c0 = lstm_case(**LSTMS[case])
    step, params = grad_step(module)
    assert_bitwise(step(params, x, h0c0), sg.static(step)(params, x, h0c0))


def test_lstm_gradients_of_initial_state_match_eager_bitwise():
    module, x, h0c0 = lstm_case(bidirectional=True, state=True)
    step, params = grad_step(module, argnums=(0, 2))
    assert_bitwise(step(params, x, h0c0), sg.static(step)(params, x, h0c0))


def test_lstm_step_replays_bitwise():
    module, x, _ = lstm_case()
    step, params = grad_step(module)
    static = sg.static(step)
    first, second = static(params, x, None), static(params, x, None)
    assert_bitwise(step(params, x, None), second)
    assert_bitwise(first, second)


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN])
def test_gru_and_rnn_steps_match_eager_bitwise(cls):
    torch.manual_seed(0)
    module = cls(IN, H, num_layers=2)
    x, h0 = torch.randn(T, N, IN), torch.randn(2, N, H)
    step, params = grad_step(module)
    assert_bitwise(step(params, x, h0), sg.static(step)(params, x, h0))


def lstm_program(**options):
    module, x, h0c0 = lstm_case(**options)
    step, params = grad_step(module)
    return sg.static(step).trace(params, x, h0c0).program


def targets(program):
    return [n.target for n in program.ops()]


def test_replay_swaps_every_forward_whose_workspace_backward_reads():
    program = lstm_program(num_layers=2, bidirectional=True)
    assert targets(program).count(FORWARD) == 4
    fixed = replay(program)
    assert FORWARD not in targets(fixed) and BACKWARD not in targets(fixed)
    assert targets(fixed).count(torch.ops.sgraph.mkldnn_rnn_layer_grad_enabled.default) == 4
    # the backward's kernel reads its tensors as contiguous: its twin passes them so
    assert targets(fixed).count(torch.ops.sgraph.mkldnn_rnn_layer_backward_contiguous.default) == 4
    assert fixed.passes[-1] == "replay"
    assert FORWARD in targets(program)  # the input Program is untouched


def test_replay_leaves_forward_only_lstm_alone_and_it_matches_eager():
    torch.manual_seed(0)
    module, x = nn.LSTM(IN, H), torch.randn(T, N, IN)
    apply, params, buffers = sg.functional(module)

    def forward(params, x):
        return apply(params, buffers, x)

    static = sg.static(forward)
    fixed = targets(replay(static.trace(params, x).program))
    assert fixed.count(torch.ops.sgraph.mkldnn_rnn_layer_contiguous.default) == 1 and FORWARD not in fixed
    # Eager runs oneDNN's training forward (grad mode is on), the graph its inference
    # forward (no workspace is read); both give the same bits.
    assert_bitwise(forward(params, x), static(params, x))


@pytest.mark.slow
def test_batch_first_lstm_under_sg_fuse_matches_eager():
    """Inductor handed the backward kernel its input's copy on other strides, which the
    kernel reads as contiguous: the input weights' gradient came out wrong."""
    module, x, h0c0 = lstm_case(**LSTMS["two layers, batch_first, (h0, c0)"])
    step, params = grad_step(module)
    want, got = step(params, x, h0c0), sg.fuse(step)(params, x, h0c0)
    for a, b in zip(sg.tree.leaves(want), sg.tree.leaves(got)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_replay_is_idempotent():
    once = replay(lstm_program())
    twice = replay(once)
    assert targets(twice) == targets(once)
    assert [n.name for n in returned(twice.graph)] == [n.name for n in returned(once.graph)]


# A hand-built graph of one LSTM layer's forward and backward, as tracing records it
# when the fake-tensor cache misses: the meta kernel returns ``diff_b`` for both bias
# gradients, so one getitem stands for both. ``traced_dtype`` stamps the dtype a meta
# kernel claimed for that gradient (torch 2.11's keeps the input's; the kernel gives float32).
def hand_built_program(traced_dtype=None):
    graph = torch.fx.Graph()
    x, w_ih, w_hh, b_ih, b_hh, hx, cx, grad = (graph.placeholder(n) for n in "x w_ih w_hh b_ih b_hh hx cx grad".split())
    fwd = graph.call_function(
        FORWARD, (x, w_ih, w_hh, b_ih, b_hh, hx, cx, False, [], 2, H, 1, True, False, False, True)
    )
    out, hy, cy, workspace = (graph.call_function(operator.getitem, (fwd, i)) for i in range(4))
    bwd = graph.call_function(
        BACKWARD,
        (x, w_ih, w_hh, b_ih, b_hh, hx, cx, out, hy, cy, grad, None, None)
        + (False, 2, H, 1, True, True, False, [], False, workspace),
    )
    d_bias = graph.call_function(operator.getitem, (bwd, 4))
    if traced_dtype is not None:
        d_bias.meta["val"] = torch.empty(4 * H, dtype=traced_dtype, device="meta")
    graph.output([out, d_bias, d_bias])
    base = sg.static(lambda t: t + 1).trace(torch.zeros(1)).program
    return base.replace(graph_module=torch.fx.GraphModule(torch.nn.Module(), graph))


def lstm_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    w = nn.LSTM(IN, H, dtype=dtype)
    return [torch.randn(T, N, IN, dtype=dtype), w.weight_ih_l0, w.weight_hh_l0, w.bias_ih_l0, w.bias_hh_l0] + [
        torch.randn(N, H, dtype=dtype),
        torch.randn(N, H, dtype=dtype),
        torch.randn(T, N, H, dtype=dtype),
    ]


def eager_lstm(inputs):
    """The forward output and both bias gradients, as eager autograd computes them."""
    x, w_ih, w_hh, b_ih, b_hh, hx, cx, grad = inputs
    out = FORWARD(x, w_ih, w_hh, b_ih, b_hh, hx, cx, False, [], 2, H, 1, True, False, False, True)[0]
    return (out, *torch.autograd.grad(out, (b_ih, b_hh), grad))


def test_root_cause_forward_under_no_grad_saves_no_workspace():
    program = hand_built_program()
    with torch.no_grad(), pytest.raises(RuntimeError, match="'workspace'"):
        program.graph_module(*[t.detach() for t in lstm_inputs()])


def test_replay_runs_hand_built_graph_under_no_grad_like_eager():
    fixed = replay(hand_built_program())
    inputs = lstm_inputs()
    with torch.no_grad():
        found = fixed.graph_module(*inputs)
        assert torch.is_grad_enabled() is False  # the switch is scoped to the op
    assert not any(t.requires_grad for t in found)  # no autograd graph was recorded
    for want, got in zip(eager_lstm(inputs), found):
        assert torch.equal(want, got)
    assert found[1] is not found[2]
    assert [r.args[1] for r in returned(fixed.graph)[1:]] == [3, 4]


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="this CPU has no oneDNN bf16 LSTM kernel (it needs AVX512-BF16 or AMX); eager LSTM avoids it there",
)
def test_replay_casts_outputs_to_the_dtype_they_were_traced_with():
    fixed = replay(hand_built_program(traced_dtype=torch.bfloat16))
    casts = [n for n in fixed.ops() if n.target is aten._to_copy.default]
    assert [c.kwargs["dtype"] for c in casts] == [torch.bfloat16] * 2
    assert set(returned(fixed.graph)[1:]) == set(casts)
    inputs = lstm_inputs(torch.bfloat16)
    with torch.no_grad():
        found = fixed.graph_module(*inputs)
    for want, got in zip(eager_lstm(inputs), found):
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.equal(want, got)
    assert len(replay(fixed).ops()) == len(fixed.ops())  # idempotent


def test_grad_enabled_twin_runs_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    fixed = replay(hand_built_program())
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, d_ih, d_hh = fixed.graph_module(*[t.detach() for t in lstm_inputs()])
    assert out.shape == (T, N, H) and d_ih.shape == d_hh.shape == (4 * H,)


@pytest.mark.gpu
@pytest.mark.parametrize("cls, op", [(nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn_tanh")])
def test_cudnn_rnn_raises_at_trace_time_naming_the_fix(cls, op):
    torch.manual_seed(0)
    step, params = grad_step(cls(IN, H).cuda())
    x = torch.randn(T, N, IN, device="cuda")
    name = cls.__name__
    match = (
        rf"nn\.{name} on cuda:0 runs cuDNN's fused RNN \(aten\.{op}\) at test_rnn\.py:\d+ in loss "
        rf".*torch\.backends\.cudnn\.enabled = False.*nn\.{name}Cell"
    )
    with pytest.raises(sg.UnsupportedError, match=match):
        sg.static(step)(params, x, None)


@pytest.mark.gpu
def test_cuda_lstm_without_cudnn_matches_eager_bitwise():
    module, x, h0c0 = lstm_case(num_layers=2, bidirectional=True, state=True)
    module, x, h0c0 = module.cuda(), x.cuda(), tuple(t.cuda() for t in h0c0)
    step, params = grad_step(module)
    with torch.backends.cudnn.flags(enabled=False):
        assert_bitwise(step(params, x, h0c0), sg.static(step)(params, x, h0c0))
