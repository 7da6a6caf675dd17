"""sg.plan_memory: rematerialization chosen by policy and budget, bitwise equal results."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import classification_batches, gpt_loss, mlp, run_steps, tiny_gpt, token_batches, train_step_fn

import sgraph as sg
from sgraph._src.passes.memory.remat import RECOMPUTED_KEY, forward_end, groups
from sgraph._src.runtime.inductor_placement import _COPY_RUN, _POSITION, _KeepCopiesInPlace, _scheduling, _sink_copies
from sgraph._src.source import MODULE_KEY

X = torch.randn(256)  # 1024 bytes


@pytest.fixture(scope="module")
def gpt():
    model = tiny_gpt()
    apply, params, _ = sg.functional(model)
    opt = sg.optim.adamw(1e-2, weight_decay=0.01)
    # A batch large enough that activations, not the optimizer's update, make the peak.
    return train_step_fn(apply, gpt_loss, opt), params, opt.init(params), token_batches(3, 64)


def _assert_bitwise(got, want):
    for (loss_g, p_g), (loss_w, p_w) in zip(got, want):
        assert torch.equal(loss_g, loss_w)
        for k in p_w:
            assert torch.equal(p_g[k], p_w[k]), k


# ------------------------------------------------------------------ hand-built graphs


def test_a_pointwise_activation_is_recomputed_in_the_backward_and_the_peak_falls():
    def step(w, x):
        def loss(w):
            h = x * w  # kept for gelu's backward...
            e = F.gelu(h)  # ...so gelu's output, read by the backward of e * e, is made again from it
            return (e * e).sum()

        return sg.grad(loss)(w)

    w = torch.randn(256)
    plain = sg.static(step).lower(w, X)
    planned = sg.static(sg.plan_memory(step)).lower(w, X)
    plan = planned.memory_plan
    assert plan is not None and plan.policy == "min_time" and plan.budget is None
    assert set(plan.recomputed) == {"gelu", "mul"}  # x * w too: its inputs are the step's
    copies = [n for n in planned.program.graph.nodes if RECOMPUTED_KEY in n.meta]
    assert sorted(n.meta[RECOMPUTED_KEY] for n in copies) == ["gelu", "mul"]
    position = {n: i for i, n in enumerate(planned.program.graph.nodes)}
    assert position[copies[0]] >= forward_end(planned.program.graph)  # made in the backward
    before, after = plain.memory_analysis(), planned.memory_analysis()
    assert plan.peak_before == before.peak_bytes and after.peak_bytes <= before.peak_bytes

    def lifetime(analysis, name):
        return next((b.start, b.end) for b in analysis.buffers if b.name == name)

    end = forward_end(planned.program.graph)
    assert lifetime(before, "gelu")[1] >= forward_end(plain.program.graph)  # unplanned: into the backward
    assert lifetime(after, "gelu")[1] < end  # planned: dies in the forward, its copy is made after
    assert lifetime(after, copies[0].name)[0] >= end
    assert torch.equal(sg.static(sg.plan_memory(step))(w, X), step(w, X))


def test_no_plan_when_nothing_is_worth_recomputing():
    def step(w, x):
        return sg.grad(lambda w: (x @ w).sum())(w)  # the backward reads only inputs

    planned = sg.static(sg.plan_memory(step)).lower(torch.randn(4, 3), torch.randn(5, 4))
    assert planned.memory_plan.recomputed == ()
    assert not any(RECOMPUTED_KEY in n.meta for n in planned.program.graph.nodes)


def test_random_ops_are_never_recomputed():
    def step(w, x):
        def loss(w):
            return torch.exp(F.dropout(x * w, 0.5, training=True)).sum()

        return sg.grad(loss)(w)

    w = torch.randn(256)
    program = sg.static(step).lower(w, X).program
    randoms = [n for n in program.graph.nodes if "bernoulli" in str(n.target) or "rand" in str(n.target)]
    assert randoms  # the mask is drawn in the graph...
    names = {m.name for g in groups(program) for m in g.members}
    assert not names & {n.name for n in randoms}  # ...and never offered for recompute
    planned = sg.static(sg.plan_memory(policy="save_matmuls")(step)).lower(w, X)
    assert not any(
        "bernoulli" in str(n.target) or "rand" in str(n.target)
        for n in planned.program.graph.nodes
        if RECOMPUTED_KEY in n.meta
    )


@pytest.mark.parametrize("write", ["neg_", "copy_"])
def test_a_value_read_before_the_step_writes_its_input_is_not_recomputed_after(write):
    """``y = x * 3`` returned, then ``x`` written in place (donated): a copy of ``y``
    made for the output would read the new ``x`` (the fuzz, seeds 725 and 1559 under
    plan_memory: silently wrong values)."""

    def step(x, w):
        y = x * 3.0
        loss, g = sg.value_and_grad(lambda w: (torch.tanh(w) * w).sum())(w)
        x.neg_() if write == "neg_" else x.t().copy_(g)
        return x, y, g, loss

    args = (torch.randn(16), torch.randn(16))
    want = step(*(a.clone() for a in args))
    planned = sg.static(sg.plan_memory(policy="save_matmuls")(step), donate=("x",))
    for _ in range(2):
        got = planned(*(a.clone() for a in args))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    plan = planned.lower(*args).memory_plan
    assert plan is not None and plan.recomputed  # the backward's tanh is still recomputed...
    assert "mul" not in plan.recomputed  # ...but not y, read before the write


# ------------------------------------------------------------------ a tiny GPT


def test_module_paths_are_recorded_on_forward_nodes(gpt):
    step, params, opt_state, batches = gpt
    program = sg.static(step).lower(params, opt_state, batches[0]).program
    paths = {n.meta.get(MODULE_KEY) for n in program.graph.nodes}
    assert {"blocks.0.fc", "blocks.1.qkv", "blocks.0", "head", "ln"} <= paths
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    end = forward_end(program.graph)
    assert all(position[n] < end for n in program.graph.nodes if MODULE_KEY in n.meta)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"policy": "save_matmuls"},
        {"policy": "save_block_inputs"},
        {"budget": "4MiB"},
        {"recompute": "blocks.*"},
    ],
    ids=["free", "save_matmuls", "save_block_inputs", "budget", "pinned"],
)
def test_planned_steps_give_bitwise_equal_params_over_several_steps(gpt, options):
    step, params, opt_state, batches = gpt
    want = run_steps(sg.static(step, donate=("params", "opt_state")), params, opt_state, batches)
    planned = sg.static(sg.plan_memory(**options)(step), donate=("params", "opt_state"))
    got = run_steps(planned, params, opt_state, batches)
    _assert_bitwise(got, want)
    assert planned.last_compiled.lowered.memory_plan.recomputed  # something was recomputed


def test_policies_recompute_more_and_lower_the_peak_in_order(gpt):
    step, params, opt_state, batches = gpt
    args = (params, opt_state, batches[0])
    plain = sg.static(step).lower(*args).memory_analysis().peak_bytes
    peaks, counts = {}, {}
    for policy in ("min_time", "save_matmuls", "save_block_inputs"):
        lowered = sg.static(sg.plan_memory(policy=policy)(step)).lower(*args)
        peaks[policy] = lowered.memory_analysis().peak_bytes
        counts[policy] = len(lowered.memory_plan.recomputed)
    assert plain > peaks["min_time"] >= peaks["save_matmuls"] > peaks["save_block_inputs"]
    assert counts["min_time"] <= counts["save_matmuls"]


def test_save_matmuls_keeps_every_matmul_output(gpt):
    step, params, opt_state, batches = gpt
    lowered = sg.static(sg.plan_memory(policy="save_matmuls")(step)).lower(params, opt_state, batches[0])
    copied = [n for n in lowered.program.graph.nodes if RECOMPUTED_KEY in n.meta]
    assert copied and not any(str(n.target).startswith(("aten.mm", "aten.addmm", "aten.bmm")) for n in copied)


def test_a_budget_is_met_in_prediction_at_the_least_recompute(gpt):
    step, params, opt_state, batches = gpt
    args = (params, opt_state, batches[0])
    free = sg.static(sg.plan_memory(step)).lower(*args)
    low = sg.static(sg.plan_memory(policy="save_block_inputs")(step)).lower(*args)
    budget = (free.memory_plan.peak_after + low.memory_plan.peak_after) // 2
    planned = sg.static(sg.plan_memory(budget=budget)(step)).lower(*args)
    plan = planned.memory_plan
    assert plan.budget == budget and plan.peak_after <= budget < free.memory_plan.peak_after
    assert planned.memory_analysis().peak_bytes <= budget
    looser = sg.static(sg.plan_memory(budget=free.memory_plan.peak_after)(step)).lower(*args).memory_plan
    assert len(looser.recomputed) <= len(plan.recomputed)


def test_an_unreachable_budget_raises_with_the_smallest_peak(gpt):
    step, params, opt_state, batches = gpt
    with pytest.raises(sg.ArgumentError, match=r"cannot fit the step in budget=1024 B .* smallest predicted peak"):
        sg.static(sg.plan_memory(budget=1024)(step)).lower(params, opt_state, batches[0])


def test_pins_save_and_recompute_by_module_path(gpt):
    step, params, opt_state, batches = gpt
    args = (params, opt_state, batches[0])
    forced = sg.static(sg.plan_memory(recompute="blocks.0.*")(step)).lower(*args).memory_plan
    kept = sg.static(sg.plan_memory(policy="save_block_inputs", save="blocks.1")(step)).lower(*args)
    modules = {n.name: n.meta.get(MODULE_KEY, "") for n in kept.program.graph.nodes}
    recomputed = {n.meta[RECOMPUTED_KEY] for n in kept.program.graph.nodes if RECOMPUTED_KEY in n.meta}
    assert any(modules.get(r, "").startswith("blocks.0") for r in recomputed)
    assert not any(modules.get(r, "").startswith("blocks.1") for r in recomputed)
    assert any("addmm" in name for name in forced.recomputed)  # a matmul of blocks.0, forced


def test_a_module_path_pattern_naming_nothing_warns(gpt):
    step, params, opt_state, batches = gpt
    match = r"save='blocks\.\*\.qvk' matches no .* Did you mean 'blocks\.\*\.qkv'\? .*: blocks\.\*, blocks\.\*\.fc, "
    with pytest.warns(sg.SgraphWarning, match=match):
        sg.static(sg.plan_memory(save="blocks.*.qvk")(step)).lower(params, opt_state, batches[0])


def test_plan_memory_alone_runs_eagerly_and_matches(gpt):
    step, params, opt_state, batches = gpt
    planned = sg.plan_memory(policy="save_block_inputs")(step)
    assert planned.api.startswith("sg.plan_memory(") and planned.last_compiled is None
    want = run_steps(sg.static(step), params, opt_state, batches)
    _assert_bitwise(run_steps(planned, params, opt_state, batches), want)


def test_the_plan_is_shown(gpt):
    step, params, opt_state, batches = gpt
    plan = sg.static(sg.plan_memory(step)).lower(params, opt_state, batches[0]).memory_plan
    text = plan.as_text()
    assert text.startswith("memory plan (min_time, no budget): predicted peak") and "recomputed" in text


# ------------------------------------------------------------------ under sg.fuse


@pytest.fixture(scope="module")
def fused_mlp():
    """Three steps of a tiny MLP planned and fused (one Inductor compile, cached on disk),
    next to the same steps unplanned and run eagerly."""
    torch.manual_seed(0)
    apply, params, _ = sg.functional(mlp(16, 2, 4))
    opt = sg.optim.adamw(1e-2, weight_decay=0.01)
    step = train_step_fn(apply, F.cross_entropy, opt)
    batches = classification_batches(3, 16, 16, 4)
    # Not donated: the graph stays small enough (copies within 64 nodes of their twins) that
    # Inductor's own distance limit on horizontal fusions does not hide the fusion refused here.
    planned = sg.static(sg.fuse(sg.plan_memory(step)))
    got = run_steps(planned, params, opt.init(params), batches)
    want = run_steps(sg.static(step), params, opt.init(params), batches)
    return planned.last_compiled, got, want


@pytest.mark.slow
def test_no_generated_kernel_computes_a_copy_with_its_forward_twin(fused_mlp):
    """Inductor fuses the copy of gelu in the backward with its twin in the forward (both
    read the saved addmm): the copy would be made in the forward and kept after all."""
    compiled, _, _ = fused_mlp
    assert compiled.stats.inductor_entry == "direct"  # the rule reads provenance through sgraph's retrace
    copies = [n for n in compiled.program.graph.nodes if RECOMPUTED_KEY in n.meta]
    assert sorted(n.meta[RECOMPUTED_KEY] for n in copies) == ["gelu", "gelu_1"]
    kernels = compiled.executable.kernels.of_node
    for copy in copies:
        twin = copy.meta[RECOMPUTED_KEY]
        assert kernels.get(copy.name) and kernels.get(twin)  # both computed by kernels we can see
        assert not set(kernels[copy.name]) & set(kernels[twin]), compiled.as_text()


@pytest.mark.slow
def test_a_fused_planned_step_matches_the_unplanned_one(fused_mlp):
    _, got, want = fused_mlp
    for (loss_g, p_g), (loss_w, p_w) in zip(got, want):
        # Generated kernels round differently from ATen's (as in test_fuse.py): not bitwise.
        torch.testing.assert_close(loss_g, loss_w, rtol=1e-5, atol=0)
        for k in p_w:
            torch.testing.assert_close(p_g[k], p_w[k], rtol=1e-5, atol=1e-6, msg=k)


def _scheduler_node(name, position, run=None, inlined=()):
    """A stand-in for an Inductor scheduler node: the op making its value at ``position``
    of the graph given to Inductor (None: unknown; a copy when ``run``, its run's start,
    is given), with ops ``inlined`` into it from earlier positions."""
    marks = {_POSITION: position, _COPY_RUN: run}
    metas = [{k: v for k, v in marks.items() if v is not None}] + [{_POSITION: p} for p in inlined]
    origins = [SimpleNamespace(meta=m) for m in metas]
    node = SimpleNamespace(get_name=lambda: name, node=SimpleNamespace(origins=origins))
    node.get_nodes = lambda: [node]
    return node


def _fused(*nodes):
    return SimpleNamespace(get_name=lambda: "_".join(n.get_name() for n in nodes), get_nodes=lambda: list(nodes))


def test_a_copy_fuses_with_nothing_placed_before_its_run():
    """Forward op at 3, a backward op at 15, a run of two copies at 20-21 read at 22."""
    twin, early = _scheduler_node("twin", 3), _scheduler_node("early", 15)
    copy, chained = _scheduler_node("copy", 20, run=20), _scheduler_node("chained", 21, run=20)
    reader, later = _scheduler_node("reader", 22, inlined=(3,)), _scheduler_node("later", 30)
    older_copy, unknown = _scheduler_node("older_copy", 10, run=10), _scheduler_node("unknown", None)
    verdict = []
    rule = _KeepCopiesInPlace(SimpleNamespace(can_fuse=lambda *args: verdict[-1]))

    def fuses(a, b, inductor_says=True):
        verdict.append(inductor_says)
        return rule.can_fuse(None, a, b, 1)

    for other in (twin, early, older_copy, _fused(later, twin)):
        assert not fuses(copy, other) and not fuses(other, copy)
    for other in (chained, reader, later, _fused(chained, reader), unknown, _fused()):
        assert fuses(copy, other) and fuses(other, copy)
        assert not fuses(copy, other, inductor_says=False)  # otherwise Inductor decides
    assert fuses(twin, later) and fuses(reader, twin)  # no copy in either


def test_copies_fuse_with_later_kernels_reading_the_same_input_however_far():
    """Inductor refuses horizontal fusions of nodes over 64 apart; a copy placed just
    before its matmul reader may still join the later kernel that reads its input (the
    recomputed GELU with the GELU's gradient): that makes it later, never earlier."""
    copy, later = _scheduler_node("copy", 20, run=20), _scheduler_node("later", 200)
    forward, backward = _scheduler_node("forward", 3), _scheduler_node("backward", 300)
    far = SimpleNamespace(are_long_distant_nodes=lambda a, b: True)
    inductor = SimpleNamespace(  # Inductor's rule, as in InductorChoices.can_fuse_horizontal
        can_fuse_horizontal=lambda scheduler, a, b, shared: shared >= 10 and not scheduler.are_long_distant_nodes(a, b)
    )
    rule = _KeepCopiesInPlace(inductor)
    assert rule.can_fuse_horizontal(far, copy, later, 2**20) and rule.can_fuse_horizontal(far, later, copy, 2**20)
    assert not rule.can_fuse_horizontal(far, forward, backward, 2**20)  # no copy: Inductor's limit holds
    assert not rule.can_fuse_horizontal(far, copy, later, 0)  # nothing shared: Inductor's rule
    near = SimpleNamespace(are_long_distant_nodes=lambda a, b: False)
    assert rule.can_fuse_horizontal(near, forward, backward, 2**20)


def test_fused_steps_recompute_without_a_budget_only_what_a_backward_kernel_computes():
    """bf16 autocast on CPU: the bf16 casts of the weights are read in the backward by
    matmuls only (a kernel of their own under sg.fuse: not recomputed there); the GELU's
    output is recomputed inside the GELU's gradient kernel, which reads the same input."""
    torch.manual_seed(0)
    apply, params, _ = sg.functional(mlp(16, 2, 4))
    opt = sg.optim.adamw(1e-2)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    step = train_step_fn(apply, lambda x, y: F.cross_entropy(x.float(), y), opt, autocast=bf16)
    batch = classification_batches(1, 32, 16, 4)[0]

    def recomputed(body):
        lowered = sg.static(sg.plan_memory(body)).trace(params, opt.init(params), batch).lower()
        return set(lowered.memory_plan.recomputed)

    eager, fused = recomputed(step), recomputed(sg.fuse(step))
    casts = {name for name in eager if name.startswith("_to_copy")}
    assert casts and {name for name in eager if name.startswith("gelu")} == {"gelu", "gelu_1"}
    assert fused == {"gelu", "gelu_1"}


def _ordered(name, reads=(), waits=()):
    """A stand-in for a scheduler node making buffer ``name``, reading ``reads`` and
    ordered after the readers ``waits`` (how Inductor records a later mutation)."""
    deps = [SimpleNamespace(name=n) for n in (*reads, *waits)]
    return SimpleNamespace(
        name=name, get_buffer_names=lambda: {name}, read_writes=SimpleNamespace(reads=deps), unmet_dependencies=()
    )


def test_copies_sink_to_just_before_what_depends_on_them():
    forward = _ordered("forward")
    copy = _ordered("copy", reads=["forward"])
    chained = _ordered("chained", reads=["copy"])
    unrelated = _ordered("unrelated")
    writes_input = _ordered("writes_input", waits=["other_copy"])  # mutates what other_copy reads
    other_copy = _ordered("other_copy", reads=["forward"])
    reader = _ordered("reader", reads=["chained", "other_copy"])
    order = [forward, copy, chained, other_copy, unrelated, writes_input, reader]
    copies = {"copy", "chained", "other_copy"}
    sunk = [n.name for n in _sink_copies(order, lambda n: n.name in copies)]
    assert sunk == ["forward", "unrelated", "other_copy", "writes_input", "copy", "chained", "reader"]
    last = _ordered("last_copy", reads=["forward"])  # read by nothing: it sinks to the end
    assert [n.name for n in _sink_copies([forward, last, unrelated], lambda n: n is last)][-1] == "last_copy"


def test_copies_stay_out_of_combo_kernels_while_compiling(monkeypatch):
    from torch._inductor import config
    from torch._inductor.scheduler import ForeachKernelSchedulerNode as Combo

    twin, copy = _scheduler_node("twin", 3), _scheduler_node("copy", 20, run=20)
    cast, other_cast = _scheduler_node("cast", 5), _scheduler_node("other_cast", 6)
    monkeypatch.setattr(Combo, "group_algorithm_for_combo_kernels", lambda s: [[twin, copy, cast], [copy, other_cast]])
    rule = _KeepCopiesInPlace(SimpleNamespace())
    with config.patch(combo_kernels=True), _scheduling(rule):
        assert config.combo_kernels
        assert Combo.group_algorithm_for_combo_kernels(None) == [[twin, cast]]  # a group of one is no group
    assert len(Combo.group_algorithm_for_combo_kernels(None)) == 2  # as it was after the compile


@pytest.mark.slow
def test_the_fusion_rule_is_set_only_while_compiling(fused_mlp):
    from torch._inductor import config, memory
    from torch._inductor.virtualized import V

    assert config.post_grad_custom_post_pass is None
    assert not isinstance(V.choices, _KeepCopiesInPlace)
    from torch._inductor.scheduler import ForeachKernelSchedulerNode as Combo

    assert memory.reorder_for_peak_memory.__module__ == "torch._inductor.memory"
    assert Combo.group_algorithm_for_combo_kernels.__name__ == "_default_group_nodes_for_combo_kernels"


# ------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"budget": "40 parsecs"}, sg.ArgumentError, r"budget='40 parsecs' is not a size"),
        ({"budget": 1.5}, sg.ArgumentError, r"fraction of device memory, in \(0, 1\]"),
        ({"budget": 0}, sg.ArgumentError, r"budget=0 must be positive"),
        ({"budget": [1]}, sg.ArgumentTypeError, r"budget must be bytes"),
        ({"policy": "fastest"}, sg.ArgumentError, r"policy='fastest' is not one of 'min_time'"),
        ({"save": 3}, sg.ArgumentTypeError, r"save must be a pattern of module paths or tags"),
        ({"budgett": 1}, sg.ArgumentTypeError, r"unknown option budgett=1.*Did you mean budget=\?"),
    ],
)
def test_bad_options_raise_naming_the_option(options, error, match):
    with pytest.raises(error, match=match):
        sg.plan_memory(**options)(lambda x: x)


def test_budget_sizes_and_fractions():
    assert sg.plan_memory(budget="1.5GiB")(lambda x: x).options.memory.budget == int(1.5 * 2**30)
    assert sg.plan_memory(budget="2GB")(lambda x: x).options.memory.budget == 2 * 10**9
    assert sg.plan_memory(budget=0.5)(lambda x: x).options.memory.budget == 0.5
    with pytest.raises(sg.ArgumentError, match=r"fraction of device memory, but the step's inputs are not on a CUDA"):
        sg.static(sg.plan_memory(budget=0.5)(lambda x: (x * 2).sum())).lower(X)


def test_applied_twice_raises():
    with pytest.raises(sg.ArgumentError, match=r"sg.plan_memory is applied twice"):
        sg.plan_memory(sg.plan_memory(lambda x: x))


def _update_bound_mlp():
    """A step whose peak is its optimizer update (params and moments, a small batch):
    where donation, which writes the new params and moments into the old, matters most."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 64, generator=g), "w2": torch.randn(64, 64, generator=g)}
    params["w3"] = torch.randn(64, 8, generator=g)
    opt = sg.optim.adamw(1e-2)
    batches = [(torch.randn(16, 64, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(3)]

    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            return F.cross_entropy(torch.tanh(torch.tanh(x @ p["w1"]) @ p["w2"]) @ p["w3"], y)

        loss, grads = sg.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return step, params, opt.init(params), batches


def test_with_donation_a_budget_is_met_by_the_step_as_it_runs():
    """Donated params and state take their new values in their own memory: a budget the
    donated step already meets unplanned is accepted (it was refused, measured on the
    step before donation), the planned peak is the one ``memory_analysis()`` predicts for
    the lowered step, and an unreachable budget's message gives the donated figures."""
    from sgraph._src.passes.memory.plan import _mib

    step, params, opt_state, batches = _update_bound_mlp()
    donate = {"donate": ("params", "opt_state")}
    unplanned = sg.static(step, **donate).lower(params, opt_state, batches[0]).memory_analysis().peak_bytes
    lowered = sg.static(sg.plan_memory(budget=unplanned)(step), **donate).lower(params, opt_state, batches[0])
    plan = lowered.memory_plan
    assert plan.peak_after == lowered.memory_analysis().peak_bytes <= unplanned
    assert plan.peak_before <= unplanned
    with pytest.raises(sg.ArgumentError, match=rf"\(unplanned: {re.escape(_mib(plan.peak_before))}\)"):
        sg.static(sg.plan_memory(budget=1)(step), **donate).lower(params, opt_state, batches[0])
    planned = sg.static(sg.plan_memory(budget=unplanned)(step), **donate)
    got = run_steps(planned, params, opt_state, batches)
    _assert_bitwise(got, run_steps(sg.static(step, **donate), params, opt_state, batches))
    for (loss_g, p_g), (loss_w, p_w) in zip(got, run_steps(step, params, opt_state, batches)):
        torch.testing.assert_close(loss_g, loss_w, rtol=1e-5, atol=0)
        for k in p_w:
            torch.testing.assert_close(p_g[k], p_w[k], rtol=1e-5, atol=1e-6, msg=k)
