"""sg.shard in one process: a fake process group of 1024 ranks traces and lowers a
sharded step (nothing runs), and the spec language's errors. Parity over real
processes is in tests/distributed/test_shard.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sgraph as sg
from sgraph._src.passes.shard.collectives import collectives

DP, TP = 128, 8


@pytest.fixture(scope="module")
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process; the fake 1024-rank one cannot be made")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP * TP)
    try:
        yield sg.mesh(dp=DP, tp=TP, device_type="cpu")
    finally:
        dist.destroy_process_group()


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 128))
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(1e-3)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: (apply(p, buffers, x) - y).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    return step, params, opt


SPEC = sg.fsdp("dp") + sg.tp({"0": "colwise", "2": "rowwise"})


def test_a_1024_rank_fsdp_times_tp_step_traces_and_lowers_in_seconds(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard

    step, full, opt = _setup()
    params = sg.distribute(full, mesh, SPEC)
    assert params["0.weight"].placements == (Shard(1), Shard(0))  # TP splits rows, FSDP the free dim
    assert params["2.weight"].placements == (Shard(0), Shard(1))
    assert params["2.bias"].placements == (Shard(0), Replicate())
    sharded = sg.static(donate=("params", "opt_state"))(sg.shard(mesh, params=SPEC, batch=sg.P("dp"))(step))
    batch = (torch.randn(2, 128), torch.randn(2, 128))  # this rank's rows of a 256-row batch
    start = time.perf_counter()
    lowered = sharded.lower(params, opt.init(params), batch)
    cost = lowered.cost_analysis()
    seconds = time.perf_counter() - start
    assert seconds < 30, seconds
    found = [(c.kind, c.size) for c in collectives(lowered.traced.program.graph)]
    # FSDP over dp: the weights and the first bias gathered for compute, their gradients
    # reduce-scattered back (the last bias, split over dp only, is computed in shards:
    # its gradient is summed over dp); DTensor's propagation adds TP's collectives over
    # tp; the loss's mean is summed over both axes
    assert found.count(("all_gather", DP)) == 3 and found.count(("reduce_scatter", DP)) == 3, found
    assert ("all_reduce", DP) in found and ("all_reduce", TP) in found, found
    assert any(size == TP for _, size in found), found
    bucketed = [(c.kind, c.size) for c in collectives(lowered.program.graph)]
    # the forward's gathers in one bucket, the backward's (the weights gathered again
    # there, reshard after forward) in another; the gradients' reduce-scatters in one
    assert bucketed.count(("all_gather", DP)) == 2 and bucketed.count(("reduce_scatter", DP)) == 1, bucketed
    assert sum(cost.counts.values()) == len(bucketed) < len(found)
    links = {(row.size, row.link) for row in cost.collectives}
    assert (DP, "inter-node") in links and (TP, "intra-node") in links, links
    assert cost.as_text().startswith(f"{lowered.program.name}: per rank, predicted peak memory")
    text = lowered.as_text()
    assert (
        "f32[128, 1], shard of DTensor[Shard(1), Shard(0)] of global shape [1024, 128]  <- params['0.weight']" in text
    )


def test_resharding_after_forward_lowers_the_predicted_peak(mesh) -> None:
    """Eight layers under FSDP over dp: with the weights gathered again for the
    backward, a few gathered weights are alive at the peak instead of all eight."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())])
    apply, full, buffers = sg.functional(model)
    opt = sg.optim.sgd(1e-3)

    def step(params, opt_state, x):
        loss, grads = sg.value_and_grad(lambda p: apply(p, buffers, x).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    params = sg.distribute(full, mesh, sg.fsdp("dp"))
    peaks = {}
    for reshard in (True, False):
        options = {"x": sg.P("dp"), "reshard_after_forward": reshard, "bucket_bytes": 0}
        sharded = sg.static(sg.shard(mesh, params=sg.fsdp("dp"), **options)(step), donate=("params", "opt_state"))
        lowered = sharded.lower(params, opt.init(params), torch.randn(2, 256))
        assert ("regather" in lowered.program.passes) == reshard
        peaks[reshard] = lowered.memory_analysis().peak_bytes
    weight = 256 * 256 * 4
    assert peaks[False] - peaks[True] >= 4 * weight, peaks


def test_outputs_follow_their_inputs_or_the_out_spec(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard

    step, full, opt = _setup()
    params = sg.distribute(full, mesh, SPEC)
    batch = (torch.randn(2, 128), torch.randn(2, 128))

    def placements(lowered, path):
        leaf = next(o for o in lowered.program.outputs if o.path == path)
        return leaf.dist.placements

    default = sg.shard(mesh, params=SPEC, batch=sg.P("dp"))(step).lower(params, opt.init(params), batch)
    assert placements(default, "result[0]['0.weight']") == (Shard(1), Shard(0))  # like params['0.weight']
    assert placements(default, "result[1].mu['0.weight']") == (Shard(1), Shard(0))  # like the moments
    assert placements(default, "result[2]") == (Replicate(), Replicate())  # the loss, summed over ranks
    whole = (sg.replicate(), None, None)
    told = sg.shard(mesh, params=SPEC, batch=sg.P("dp"), out=whole)(step).lower(params, opt.init(params), batch)
    assert placements(told, "result[0]['0.weight']") == (Replicate(), Replicate())
    # a None in out= is no spec: that output keeps the default (it was gathered whole)
    assert placements(told, "result[1].mu['0.weight']") == (Shard(1), Shard(0))
    assert placements(told, "result[2]") == (Replicate(), Replicate())


def test_spec_errors_name_the_path_and_the_fix(mesh) -> None:
    step, full, opt = _setup()
    with pytest.raises(sg.ArgumentError, match=r"params\['0'\]: sg.fsdp\('dq'\) names mesh axis 'dq'.*'dp', 'tp'"):
        sg.shard(mesh, params={"0": sg.fsdp("dq")})(step)
    with pytest.raises(sg.ArgumentError, match=r"batchh= names no parameter of the step.*Did you mean batch="):
        sg.shard(mesh, batchh=sg.P("dp"))(step)
    with pytest.raises(sg.ArgumentTypeError, match=r"params\['0'\] is 3, not a spec"):
        sg.shard(mesh, params={"0": 3})(step)
    with pytest.raises(sg.ArgumentError, match=r"axis 'dp' splits two dims"):
        sg.P("dp", "dp")
    with pytest.raises(sg.ArgumentError, match=r'"colwise" or "rowwise"'):
        sg.tp({"fc": "columnwise"})
    with pytest.raises(sg.ArgumentError, match=r"value\['w'\] has size 100 in dim 0, which sg.P\('dp'\) splits 128"):
        sg.distribute({"w": torch.ones(100)}, mesh, sg.P("dp"))
    with pytest.raises(sg.ArgumentError, match=r"the spec for params is not a prefix"):
        sg.shard(mesh, params=[sg.P()])(step).lower(full, opt.init(full), (torch.ones(2, 128), torch.ones(2, 128)))
    with pytest.raises(sg.ArgumentError, match=r"axis sizes \{'dp': 2\} make 2 ranks, but the world has 1024"):
        sg.mesh(dp=2)
    with pytest.raises(sg.ArgumentError, match=r"bucket_bytes must be >= 0"):
        sg.shard(mesh, bucket_bytes=-1)(step)


def test_the_same_step_without_a_spec_replicates_plain_tensors(mesh) -> None:
    """A replicated step on 1024 ranks: no collective but the loss's (all ranks hold
    the same batch, so its mean needs no sum) and none for the params."""
    step, full, opt = _setup()
    lowered = sg.shard(mesh)(step).lower(full, opt.init(full), (torch.randn(2, 128), torch.randn(2, 128)))
    assert collectives(lowered.program.graph) == []


@pytest.mark.parametrize("spec", [sg.ddp("dp"), sg.fsdp("dp")])
def test_a_sharded_fused_step_keeps_the_aten_cross_entropy(mesh, spec) -> None:
    """The fused linear + cross-entropy kernel has no DTensor rule: sharded logits keep
    the ATen ops (they were matched, and the trace raised)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    full = {"W": torch.randn(1024, 8)}
    opt = sg.optim.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: F.cross_entropy(x @ p["W"].T, y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    params = sg.distribute(full, mesh, spec)
    sharded = sg.shard(mesh, params=spec, batch=sg.P("dp"))(sg.fuse(step))
    traced = sharded.trace(params, opt.init(params), (torch.randn(2, 8), torch.randint(0, 1024, (2,))))
    targets = {str(n.target) for n in traced.program.graph.nodes}
    assert not any("linear_cross_entropy" in t for t in targets)
    assert any("log_softmax" in t for t in targets)


def _agreement_record(sent: list[str], groups: list[list[int]]) -> dict:
    return {
        "hash": "h",
        "inputs": [],
        "ops": [line.split(":")[0] for line in sent],
        "sent": sent,
        "groups": groups,
        "replicated": {},
    }


def test_agreement_compares_collective_shapes_within_each_group_only():
    """Rows of a 2 x 2 mesh may all-reduce other shapes (a shard uneven over the other
    axis); two ranks of one group may not."""
    from sgraph._src.agreement import _difference

    row_0, row_1 = "all_reduce over 2 ranks: f32[29] -> f32[29]", "all_reduce over 2 ranks: f32[22] -> f32[22]"
    rows = [[0, 1], [0, 1], [2, 3], [2, 3]]
    fine = [_agreement_record([line], [rows[r]]) for r, line in enumerate([row_0, row_0, row_1, row_1])]
    assert _difference("step", fine) is None
    torn = [_agreement_record([line], [rows[r]]) for r, line in enumerate([row_0, row_0, row_1, row_0])]
    message = _difference("step", torn)
    assert message is not None and "ranks 2 and 3 run collective 0 of the step together" in message
    assert "f32[22]" in message and "f32[29]" in message


def test_reshaping_an_empty_dtensor_raises_naming_the_line_instead_of_hanging(mesh) -> None:
    """DTensor's view rule never returns for ``[0, 3] -> [-1]`` and divides by zero for
    ``[0, 3] -> [3, 0]`` (eagerly too): the trace raises first. Views that only add or drop
    dims of size 1 go through it and lower."""

    def flat(x):
        return x.reshape(-1) * 2

    def turned(x):
        return x.reshape(3, 0) * 2

    for step in (flat, turned):
        with pytest.raises(sg.CaptureError, match=r"a DTensor with no elements, f32\[0, 3\], is reshaped .*test_shard"):
            sg.shard(mesh)(step).lower(torch.zeros(0, 3))
    lowered = sg.shard(mesh)(lambda x: x.reshape(0, 1, 3) * 2).lower(torch.zeros(0, 3))
    assert lowered.program.outputs[0].dist.shape == (0, 1, 3)
