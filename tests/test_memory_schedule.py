"""The schedule pass: optimizer updates split by layer and run inside the backward,
bitwise equal to eager, with gradients dying early."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import gpt_loss, mlp, tiny_gpt

import sgraph as sg
from sgraph import tree
from sgraph._src.passes.cleanup import cleanup
from sgraph._src.passes.donation import donation
from sgraph._src.passes.memory.analysis import memory_analysis
from sgraph._src.passes.memory.schedule import group_lanes, schedule
from sgraph._src.passes.reinplace import reinplace
from sgraph._src.passes.replay import replay
from sgraph._src.passes.simplify import simplify
from sgraph._src.program import Program
from sgraph._src.stages import Lowered

DONATE = ("params", "opt_state")
ADAMW = torch.ops.sgraph.adamw.default


def train_step(apply, opt):
    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, {}, x), y)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    return step


def away_from_zero(params):
    """``params`` moved at least 0.05 from zero, so that no update of 1e-3 changes a value
    by a factor of two: the pipeline's fold of ``p + (new_p - p)`` into ``new_p`` is then
    exact (Sterbenz), and eager PyTorch is a bitwise reference."""
    return tree.map(lambda p: p + torch.where(p < 0, -0.05, 0.05).to(p.dtype), params)


def mlp_parts(width=16, depth=3, dtype=torch.float32):
    """A small MLP's apply function and params, and a batch of two."""
    torch.manual_seed(0)
    apply, params, _ = sg.functional(mlp(width, depth, 4).to(dtype))
    return apply, away_from_zero(params), (torch.randn(2, width, dtype=dtype), torch.tensor([1, 3]))


def mlp_case(width=16, depth=3, dtype=torch.float32, opt=None):
    """A small MLP train step, its params, AdamW (or ``opt``) state and a batch of two."""
    apply, params, batch = mlp_parts(width, depth, dtype)
    opt = opt or sg.optim.adamw(1e-3)
    return train_step(apply, opt), params, opt.init(params), batch


def traced(step, *args, donate=DONATE):
    return sg.static(step, donate=donate).trace(*args)


def before_schedule(traced_step) -> Program:
    """The passes the pipeline runs before ``schedule``."""
    return simplify(cleanup(replay(traced_step.program)))


def finish(traced_step, program: Program) -> Lowered:
    """The passes the pipeline runs after ``schedule``, as a Lowered stage."""
    return Lowered(reinplace(donation(program)), traced_step, 0.0)


def count(program: Program, target) -> int:
    return sum(n.target is target for n in program.ops())


def position(program: Program, name: str) -> int:
    return next(i for i, n in enumerate(program.graph.nodes) if n.name == name)


def last_backward(program: Program) -> int:
    nodes = list(program.graph.nodes)
    return max(i for i, n in enumerate(nodes) if getattr(n.meta.get("sgraph_source"), "backward", False))


def run_steps(fn, params, opt_state, batch, steps=3):
    """``steps`` updates from fresh copies (donated inputs are overwritten); every output."""
    params, opt_state = tree.map(torch.clone, params), tree.map(torch.clone, opt_state)
    seen = []
    for _ in range(steps):
        params, opt_state, loss = fn(params, opt_state, batch)
        seen.append([t.clone() for t in tree.leaves((params, opt_state, loss))])
    return seen


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_group_lanes_cuts_runs_of_readiness_by_bytes_into_at_most_max_groups():
    assert group_lanes([5, 9, 9, 20], [400, 100, 100, 400], max_groups=2) == [0, 0, 0, 1]
    assert group_lanes([3, 1, 2], [10, 10, 10], max_groups=16) == [2, 0, 1]  # in order of readiness
    assert group_lanes([7, 7, 7], [10, 10, 10], max_groups=3) == [0, 0, 0]  # ready together, kept together
    assert group_lanes([1, 2, 3], [0, 0, 0], max_groups=3) == [0, 0, 0]  # nothing to balance
    many = group_lanes(list(range(100)), [1000] * 100, max_groups=16)
    assert many == sorted(many) and max(many) == 14  # 7 lanes each: 7000 >= ceil(100000 / 16) > 6000
    step, params, state, batch = mlp_case()
    with pytest.raises(sg.ArgumentError, match=r"schedule: max_groups must be at least 1; found 0\."):
        schedule(before_schedule(traced(step, params, state, batch)), max_groups=0)


def test_a_fused_update_is_split_by_layer_and_runs_inside_the_backward():
    step, params, state, batch = mlp_case()
    before = before_schedule(traced(step, params, state, batch))
    after = schedule(before)
    after.graph.lint()
    pieces = [n for n in after.ops() if n.target is ADAMW]
    assert count(before, ADAMW) == 1 and len(pieces) == 4  # one per Linear: weight and bias
    assert len(after.ops()) == len(before.ops()) + 3  # the getitems are rebuilt, not added
    assert count(after, operator.getitem) == count(before, operator.getitem)
    assert [[a.name for a in p.args[0]] for p in pieces] == [
        ["arg6_1", "arg7_1"],
        ["arg4_1", "arg5_1"],
        ["arg2_1", "arg3_1"],
        ["arg0_1", "arg1_1"],
    ]
    # all but the first layer's update run inside the backward (its grads are the backward's last ops)
    assert [position(after, p.name) < last_backward(after) for p in pieces] == [True, True, True, False]
    assert after.passes[-1] == "schedule"


def test_a_foreach_chain_splits_into_independent_chains_per_group():
    step, params, state, batch = mlp_case(dtype=torch.float64)  # not fusable: the foreach path
    before = before_schedule(traced(step, params, state, batch))
    after = schedule(before)
    after.graph.lint()
    foreach = {n.target for n in before.ops() if "_foreach_" in str(n.target)}
    assert len(foreach) >= 6
    assert all(count(after, t) == 4 * count(before, t) for t in foreach)
    for piece in (n for n in after.ops() if n.target in foreach):
        group = piece.name.rsplit("_g", 1)[1]
        inputs = [a.args[0] for a in piece.all_input_nodes if a.target is operator.getitem]
        assert all(a.name.endswith(f"_g{group}") for a in inputs if a.target in foreach), piece.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused", "foreach"])
def test_scheduled_steps_are_bitwise_equal_to_eager_and_to_the_unscheduled_step(dtype):
    step, params, state, batch = mlp_case(dtype=dtype)
    traced_step = traced(step, params, state, batch)
    before = before_schedule(traced_step)
    eager = run_steps(step, params, state, batch)
    unscheduled = run_steps(finish(traced_step, before).compile(), params, state, batch)
    scheduled = run_steps(finish(traced_step, schedule(before)).compile(), params, state, batch)
    assert_bitwise(unscheduled, eager)
    assert_bitwise(scheduled, eager)


def test_a_transformer_step_is_split_into_a_few_groups_and_stays_exact():
    apply, params, _ = sg.functional(tiny_gpt())
    params, opt = away_from_zero(params), sg.optim.adamw(1e-3)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(lambda p: gpt_loss(apply(p, {}, batch[0]), batch[1]))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    state, batch = opt.init(params), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    traced_step = traced(step, params, state, batch)
    after = schedule(before_schedule(traced_step))
    pieces = [len(n.args[0]) for n in after.ops() if n.target is ADAMW]
    assert sum(pieces) == len(params) == 29 and 4 <= len(pieces) <= 16
    eager = run_steps(step, params, state, batch, steps=2)
    assert_bitwise(run_steps(finish(traced_step, after).compile(), params, state, batch, steps=2), eager)


def test_a_global_norm_clip_makes_every_update_wait_and_stays_exact():
    opt = sg.optim.chain(sg.optim.clip_by_global_norm(0.1), sg.optim.adamw(1e-3))
    step, params, state, batch = mlp_case(opt=opt)
    traced_step = traced(step, params, state, batch)
    before = before_schedule(traced_step)
    after = schedule(before)
    assert count(after, ADAMW) == 1  # every update needs the norm of every grad
    assert position(after, "adamw") > last_backward(after)
    assert count(after, torch.ops.aten._foreach_norm.Scalar) == 3  # each group's norms as its grads are final
    assert_bitwise(
        run_steps(finish(traced_step, after).compile(), params, state, batch), run_steps(step, params, state, batch)
    )


def test_an_update_waits_for_the_backward_read_of_its_param_and_stays_in_place():
    opt = sg.optim.adamw(1e-3)

    def loss_fn(params, x):
        # d/dw is made before the backward of `h * w` reads w for d/dh
        h = torch.tanh(params["v"] * x)
        return (h * params["w"]).square().sum()

    def step(params, opt_state, x):
        loss, grads = sg.value_and_grad(loss_fn)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    torch.manual_seed(0)
    params, x = away_from_zero({"v": torch.randn(8), "w": torch.randn(8)}), torch.randn(8)
    state = opt.init(params)
    traced_step = traced(step, params, state, x)
    lowered = finish(traced_step, schedule(before_schedule(traced_step)))
    program = lowered.program
    w = program.graph.find_nodes(op="placeholder")[1]
    nodes = list(program.graph.nodes)
    updates_op = torch.ops.sgraph.adamw_.default
    updates = {n.args[0][0]: nodes.index(n) for n in program.ops() if n.target is updates_op}
    assert set(updates) == set(program.graph.find_nodes(op="placeholder")[:2])  # both in place
    readers = [nodes.index(n) for n in w.users if n.op == "call_function" and n.target is not updates_op]
    assert max(readers) < updates[w] < last_backward(program)
    assert_bitwise(run_steps(lowered.compile(), params, state, x), run_steps(step, params, state, x))


def test_the_predicted_peak_goes_down_when_the_optimizer_phase_is_the_peak():
    step, params, state, batch = mlp_case(width=256)  # 0.8 MB of params, a batch of two
    traced_step = traced(step, params, state, batch)
    before = before_schedule(traced_step)
    unscheduled = memory_analysis(finish(traced_step, before).program)
    scheduled = memory_analysis(finish(traced_step, schedule(before)).program)
    param_bytes = sum(p.numel() * 4 for p in params.values())
    layer = 256 * 256 * 4
    # Before: params, moments and every grad at once (3178588 B). After: params, moments and
    # one layer's grads (2661480 B).
    assert unscheduled.peak_bytes == pytest.approx(4 * param_bytes, rel=0.01)
    assert scheduled.peak_bytes == pytest.approx(3 * param_bytes + layer, rel=0.01)


def test_a_graph_without_an_optimizer_after_its_backward_is_left_alone():
    apply, params, batch = mlp_parts()

    def grads_only(params, batch):
        return sg.value_and_grad(lambda p: F.cross_entropy(apply(p, {}, batch[0]), batch[1]))(params)

    def foreach_only(xs):
        return torch._foreach_mul(torch._foreach_add(xs, 1.0), 2.0)

    for program in (
        before_schedule(traced(grads_only, params, batch, donate=())),
        before_schedule(traced(foreach_only, [torch.randn(3), torch.randn(4)], donate=())),
    ):
        after = schedule(program)
        assert after.graph_module is program.graph_module
        assert after.passes == program.passes + ("schedule",)


def test_writes_into_inputs_and_random_draws_stay_after_the_backward():
    apply, params, batch = mlp_parts()
    opt = sg.optim.adamw(1e-3)
    state = opt.init(params)

    def step(params, opt_state, batch, stats):
        loss, grads = sg.value_and_grad(lambda p: F.cross_entropy(apply(p, {}, batch[0]), batch[1]))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        stats["steps"].add_(1)
        return sg.optim.apply_updates(params, updates), opt_state, loss + torch.rand(())

    stats = {"steps": torch.zeros(())}
    traced_step = traced(step, params, state, batch, stats, donate=(*DONATE, "stats"))
    after = schedule(before_schedule(traced_step))
    nodes = list(after.graph.nodes)
    pinned = [i for i, n in enumerate(nodes) if "rand" in str(n.target) or "copy_" in str(n.target)]
    assert len(pinned) == 2 and min(pinned) > last_backward(after)
    assert count(after, ADAMW) == 4

    def run(fn):
        torch.manual_seed(5)
        mine = {"steps": torch.zeros(())}
        return run_steps(lambda p, s, b: fn(p, s, b, mine), params, state, batch), mine["steps"]

    (scheduled, n1), (eager, n2) = run(finish(traced_step, after).compile()), run(step)
    assert_bitwise(scheduled, eager)
    assert float(n1) == float(n2) == 3.0
