"""sg.shard on 1, 2 and 4 CPU processes over gloo: every strategy against one process
running the same step without sgraph.

Each world size is one spawn (starting processes costs seconds); each check's result
per rank is then one pytest test. The reference is the same step run by one process
on the global batch, without sgraph; rank r holds rows [ROWS r, ROWS (r + 1)) of
it. fp32 throughout: results agree to rtol 1e-5 (sums over ranks add in another
order than one process does).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from gloo_workers import assert_passed, spawn_checks
from torch import nn

import sgraph as sg
from sgraph._src.passes.shard.collectives import collectives

ROWS = 3  # per data-parallel rank
STEPS = 10
TP = {"0": "colwise", "2": "rowwise"}

_CHECKS: dict[str, Callable[[int, int], None]] = {}


def _check(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    _CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- the step


def _model() -> nn.Module:
    """Widths divide by 2 and 4 for TP; the last layer's 6 rows shard unevenly over 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = world * ROWS
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 6, generator=g)) for _ in range(STEPS)]


def _rows(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[rank * ROWS : (rank + 1) * ROWS] for t in batch)  # type: ignore[return-value]


OPT = sg.optim.adamw(1e-2, weight_decay=0.1)


def _step_for(apply, buffers):
    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: (apply(p, buffers, x) - y).square().mean())(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    return step


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    apply, params, buffers = sg.functional(_model())
    step = _step_for(apply, buffers)
    state = OPT.init(params)
    losses = []
    for batch in _batches(world):
        params, state, loss = step(params, state, batch)
        losses.append(loss.item())
    return losses, params


def _full(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _static(step):
    return sg.static(step, donate=("params", "opt_state"))


def _fused(step):
    return _static(sg.fuse(step))


def _train(world: int, rank: int, mesh, spec, *, wrap=_static):
    """10 steps of ``wrap(sharded step)`` (by default under sg.static, donating); returns
    (losses, final params, the lowered step, the step)."""
    apply, full_params, buffers = sg.functional(_model())
    params = sg.distribute(full_params, mesh, spec)
    data_parallel = "dp" in mesh.mesh_dim_names
    step = wrap(sg.shard(mesh, params=spec, batch=sg.P("dp") if data_parallel else None)(_step_for(apply, buffers)))
    state = OPT.init(params)

    def batch_of(batch):
        return _rows(batch, mesh.get_local_rank("dp")) if data_parallel else batch

    lowered = step.lower(params, state, batch_of(_batches(world)[0]))
    losses = []
    for batch in _batches(world):
        params, state, loss = step(params, state, batch_of(batch))
        losses.append(_full(loss).item())
    assert step.trace_count == 2, step.trace_count  # .lower, then the first call: no retrace
    return losses, params, lowered, step


def _assert_matches(world: int, losses, params) -> None:
    want_losses, want = _reference(world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-7)
    for k, v in want.items():
        assert type(params[k]).__name__ == "DTensor", k
        torch.testing.assert_close(params[k].full_tensor(), v, rtol=1e-5, atol=1e-6)


def _counts(stage, group: str | None = None) -> dict[str, int]:
    """Collectives by kind (over the process group named ``group`` only, if given)."""
    found: dict[str, int] = {}
    for c in collectives(stage.program.graph):
        if group is None or c.group == group:
            found[c.kind] = found.get(c.kind, 0) + 1
    return found


# --------------------------------------------------------------------------- checks


@_check
def ddp_matches_one_process(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate

    mesh = sg.mesh(dp=world)
    losses, params, lowered, _ = _train(world, rank, mesh, sg.ddp("dp"))
    _assert_matches(world, losses, params)
    assert all(p.placements == (Replicate(),) for p in params.values())
    # traced: one all-reduce per gradient (4) and one for the loss's mean over ranks;
    # bucketed: the gradients' sums in one, the loss's mean (another op) apart
    if world == 1:
        assert _counts(lowered) == {}, _counts(lowered)  # a mesh of one communicates nothing
        return
    assert _counts(lowered.traced) == {"all_reduce": 5}, _counts(lowered.traced)
    assert _counts(lowered) == {"all_reduce": 2}, _counts(lowered)


@_check
def fsdp_matches_one_process(rank: int, world: int) -> None:
    from torch.distributed.tensor import Shard

    mesh = sg.mesh(dp=world)
    losses, params, lowered, _ = _train(world, rank, mesh, sg.fsdp("dp"))
    _assert_matches(world, losses, params)
    assert all(p.placements == (Shard(0),) for p in params.values())
    # traced: each parameter gathered for the forward (the backward reuses it), its
    # gradient reduce-scattered, the loss all-reduced. Lowered: the last weight, which
    # the backward reads, gathered again there (reshard after forward); then one
    # bucket for the forward's gathers, one for the backward's, one of reduce-scatters
    if world == 1:
        assert _counts(lowered) == {}, _counts(lowered)
        return
    counts = _counts(lowered.traced)
    assert counts == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 1}, counts
    assert _counts(lowered) == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}, _counts(lowered)
    assert "regather" in lowered.program.passes


@_check
def tp_matches_one_process(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mesh = sg.mesh(tp=world)
    losses, params, lowered, _ = _train(world, rank, mesh, sg.tp(TP, axis="tp"))
    _assert_matches(world, losses, params)
    assert params["0.weight"].placements == (Shard(0),) and params["2.weight"].placements == (Shard(1),)
    assert params["2.bias"].placements == (Replicate(),)
    assert _counts(lowered).get("all_reduce", 0) >= (world > 1), _counts(lowered)


@_check
def fsdp_times_tp_matches_one_process(rank: int, world: int) -> None:
    if world < 4:
        return
    mesh = sg.mesh(dp=2, tp=world // 2)
    spec = sg.fsdp("dp") + sg.tp(TP, axis="tp")
    losses, params, lowered, _ = _train(world // 2, rank, mesh, spec)
    _assert_matches(world // 2, losses, params)
    # over dp, FSDP gathers and reduce-scatters each parameter it shards: all but
    # 0.bias, whose one dim TP splits (it stays whole over dp). Over tp, DTensor's own
    # collectives differ by torch version (2.11 all-reduces the row-wise layer's partial
    # sums where 2.13 reduce-scatters and gathers them), so they are not counted here.
    dp = mesh.get_group("dp").group_name
    assert params["0.bias"].placements[0].is_replicate()
    traced = _counts(lowered.traced, dp)
    assert traced.get("all_gather", 0) >= 3 and traced.get("reduce_scatter", 0) == 3, traced
    counts = _counts(lowered)
    assert sum(counts.values()) < sum(_counts(lowered.traced).values()), counts  # bucketed


@_check
def uneven_shards_over_one_axis_of_a_2d_mesh_match_one_process(rank: int, world: int) -> None:
    """FSDP over dp of a 2 x 2 mesh with a 3-row layer: rank 0's row of the mesh
    all-reduces other shapes than rank 2's row, and the first call's agreement must
    compare shapes within each group only (it refused the step)."""
    if world < 4:
        return
    torch.manual_seed(0)
    apply, full, buffers = sg.functional(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    opt = sg.optim.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: (apply(p, buffers, x) - y).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, 3, generator=g)) for _ in range(3)]
    want, state = dict(full), opt.init(full)
    for batch in batches:
        want, state, _ = step(want, state, batch)
    mesh = sg.mesh(dp=2, tp=world // 2)
    sharded = sg.static(sg.shard(mesh, params=sg.fsdp("dp"), batch=sg.P(("dp", "tp")))(step))
    params = sg.distribute(full, mesh, sg.fsdp("dp"))
    state = opt.init(params)
    for x, y in batches:
        params, state, _ = sharded(params, state, (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
    assert params["2.weight"].to_local().shape[0] == (2 if mesh.get_local_rank("dp") == 0 else 1)
    for k, v in want.items():
        torch.testing.assert_close(params[k].full_tensor(), v, rtol=1e-5, atol=1e-6, msg=k)


@_check
def plain_step_without_static_matches(rank: int, world: int) -> None:
    """sg.shard alone (no graph) runs the same traced program."""
    losses, params, _, _ = _train(world, rank, sg.mesh(dp=world), sg.fsdp("dp"), wrap=lambda step: step)
    _assert_matches(world, losses, params)


@_check
def returned_params_checkpoint_with_dcp(rank: int, world: int) -> None:
    """The step's outputs are real DTensors: torch.distributed.checkpoint saves them, and
    loads them back into fresh shards."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    mesh = sg.mesh(dp=world)
    _, params, _, _ = _train(world, rank, mesh, sg.fsdp("dp"))
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    dcp.save({"params": params}, checkpoint_id=directory[0])
    apply, full, buffers = sg.functional(_model())
    fresh = sg.distribute(full, mesh, sg.fsdp("dp"))
    assert not torch.equal(fresh["0.weight"].full_tensor(), params["0.weight"].full_tensor())
    dcp.load({"params": fresh}, checkpoint_id=directory[0])
    for k in params:
        assert torch.equal(fresh[k].full_tensor(), params[k].full_tensor()), k


@_check
def fused_fsdp_matches_one_process(rank: int, world: int) -> None:
    """sg.fuse lowers the collectives with the rest (Inductor's C++ here); 2 ranks only:
    a compile costs tens of seconds on this CPU."""
    if world != 2:
        return
    losses, params, _, step = _train(world, rank, sg.mesh(dp=world), sg.fsdp("dp"), wrap=_fused)
    stats = step.last_compiled.stats
    assert stats.runtime == "inductor" and stats.inductor_entry == "direct", stats
    _assert_matches(world, losses, params)


@_check
def two_undonated_inputs_that_are_one_dtensor_come_back_apart(rank: int, world: int) -> None:
    """``step(p, x, x)`` returning ``x`` and a view of ``y``: passing ``x`` back donated
    must not overwrite the view the user still holds (as under sg.static alone)."""

    def step(p, x, y):
        return p + x, x, {"y": y, "cols": y[:, :2]}

    mesh = sg.mesh(dp=world)
    run = sg.static(sg.shard(mesh, p=sg.P("dp"), x=sg.P("dp"), y=sg.P("dp"))(step), donate="p")

    def placed(value: float | None = None):
        full = (
            torch.arange(4.0 * world * 2).reshape(world * 2, 4) if value is None else torch.full((world * 2, 4), value)
        )
        return sg.distribute(full, mesh, sg.P("dp"))

    x = placed()
    first = run(placed(1.0), x, x)
    second = run(first[1], placed(10.0), placed(0.0))  # x given back as donated memory
    want = torch.arange(4.0 * world * 2).reshape(world * 2, 4)
    assert torch.equal(second[0].full_tensor(), want + 10)
    assert torch.equal(first[2]["y"].full_tensor(), want)
    assert torch.equal(first[2]["cols"].full_tensor(), want[:, :2])


@_check
def an_input_sharing_memory_with_a_donated_dtensor_is_checked(rank: int, world: int) -> None:
    """The per-call aliasing check covers DTensor arguments (their local shards): an input
    overlapping a donated one is copied for the call, or raises where the step writes the
    donated one in place (it ran, reading the write part-way, before)."""
    from torch.distributed.tensor import DTensor

    mesh = sg.mesh(dp=world)

    def scaled(p, x):
        return p * 2 + x

    def written(p, x):
        p.mul_(2)
        return p + x

    want = torch.arange(2.0 * world) * 3
    for step, outcome in ((scaled, want), (written, sg.ArgumentError)):
        run = sg.static(sg.shard(mesh, p=sg.P("dp"), x=sg.P("dp"))(step), donate="p")
        for _ in range(2):  # the second call takes the remembered-addresses path
            p = sg.distribute(torch.arange(2.0 * world), mesh, sg.P("dp"))
            x = DTensor.from_local(p.to_local()[:], mesh, p.placements, run_check=False)  # p's memory
            if outcome is sg.ArgumentError:
                with pytest.raises(sg.ArgumentError, match=r"input x shares memory with donated input p"):
                    run(p, x)
            else:
                assert torch.equal(run(p, x).full_tensor(), outcome)


@_check
def a_write_into_a_view_of_a_split_dim_raises_naming_the_line(rank: int, world: int) -> None:
    """``a[0] = x`` with ``a`` split by rows: DTensor gathers ``a`` to index the split dim
    and writes into the gathered copy, so ``a`` keeps its old row (eager DTensor too: the
    fuzz's split mode, seed 151). The trace raises naming the line; a view of a dim that
    is not split still takes the write, and so does any view on one rank."""
    mesh = sg.mesh(dp=world)

    def into_row(a, x):
        a[0] = x
        return a * 1

    def into_column(a, x):
        a[:, 1:] = x[1:]
        return a * 1

    full = torch.arange(6.0 * world).reshape(2 * world, 3)
    x = torch.tensor([7.0, 8.0, 9.0])
    for step in (into_row, into_column):
        want = step(full.clone(), x)
        run = sg.static(sg.shard(mesh, a=sg.P("dp"))(step), donate="a")
        rows = full.chunk(world)[rank].clone()
        if step is into_row and world > 1:
            with pytest.raises(sg.CaptureError, match=r"a\[0\] = x.*laid out as S\(0\).*gathered copy"):
                run(rows, x)
        else:
            assert torch.equal(run(rows, x).full_tensor(), want)


@_check
def the_gradient_of_a_pending_sum_is_whole(rank: int, world: int) -> None:
    """``sg.grad`` with respect to ``t @ t`` of a split ``t`` (a ``Partial`` DTensor): the
    gradient comes back whole on every rank, as eager DTensor's does; asking DTensor to
    lay it out as a pending sum raised (the fuzz's split mode, seed 640)."""
    mesh = sg.mesh(dp=world)

    def step(a):
        t = torch.sin(a)
        return sg.grad(lambda s: torch.tanh(s) * 1.5)(t @ t)

    full = torch.arange(2.0 * world)
    t = torch.sin(full)
    want = torch.func.grad(lambda s: torch.tanh(s) * 1.5)(t @ t)
    got = sg.static(sg.shard(mesh, a=sg.P("dp"))(step))(full.chunk(world)[rank].clone())
    torch.testing.assert_close(got.full_tensor(), want)


@_check
def a_split_mask_gathered_under_fuse_stays_bool(rank: int, world: int) -> None:
    """A bool mask split over the ranks and sliced across its split dim (a gather) comes
    back bool under sg.fuse, as eagerly: Inductor's lowering promoted a bool gather (and
    reduce-scatter, and broadcast) to int64. ``mask.any()`` over the ranks (an all-reduce
    summing bool bytes to 2) compares as True: generated code read the 2. The four
    collectives also run through the graph sgraph hands Inductor, compiled: bool results
    equal to eager's."""
    if world != 2:
        return
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from sgraph._src.runtime.inductor import _bool_collectives_on_integers

    mesh = sg.mesh(dp=world)
    full = torch.tensor([True, False, True, True])

    def step(mask, x):
        kept = mask[1:]
        return kept, torch.where(kept, x[1:], 0.0), x < mask.any()

    fused = sg.static(sg.fuse(sg.shard(mesh, mask=sg.P("dp"))(step)))
    for call in range(3):
        mask = full if call != 1 else ~full
        x = torch.linspace(0.5, 1.5, 4) + call / 4
        got = [_full(v) for v in fused(mask.chunk(world)[rank].clone(), x)]
        assert got[0].dtype == torch.bool, f"call {call}: the gathered mask came back {got[0].dtype}"
        for name, g, w in zip(("kept", "picked", "below"), got, step(mask, x)):
            assert torch.equal(g, w), f"call {call}: {name} is {g} where eager gives {w}"

    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name

    def collectives_of(m):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(m.logical_not(), world, group))
        summed = c10d.wait_tensor(c10d.reduce_scatter_tensor(m.logical_not(), "sum", world, group))
        sent = c10d.wait_tensor(c10d.broadcast(m.logical_not(), 1, group))
        anywhere = c10d.wait_tensor(c10d.all_reduce(m.logical_not(), "sum", group))
        return gathered, summed, sent, anywhere.float()

    m = torch.tensor([True, False, rank == 0, False])
    want = collectives_of(m)
    gm = make_fx(collectives_of)(m)
    _bool_collectives_on_integers(gm.graph)
    gm.recompile()
    got = compile_fx(gm, [m])(m)
    for name, g, w in zip(("gather", "reduce-scatter", "broadcast", "all-reduce"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {g} where eager gives {w}"


@_check
def random_steps_match_eager_replicated_over_the_mesh(rank: int, world: int) -> None:
    """The fuzz's cases (tests/test_fuzz_static.py) under sg.shard(mesh), every argument
    replicated: the sharded call path (local shards in, DTensors out, the per-call
    aliasing and two-places checks) against eager, on 1 and 2 ranks. A case DTensor
    itself has no rule for ends at its trace."""
    if world > 2:
        return
    from test_fuzz_static import SHARDED_SEEDS, run_sample

    run_sample(SHARDED_SEEDS, mesh=sg.mesh(dp=world))


@_check
def random_steps_match_eager_split_over_the_mesh(rank: int, world: int) -> None:
    """The fuzz's cases with some arguments split by rows over the mesh (``sg.P("dp")``),
    each rank given its own rows: DTensor's sharding rules, the pending sums and their
    gradients, against eager on the whole tensors, on 2 and 4 ranks."""
    if world < 2:
        return
    from test_fuzz_static import SPLIT_SEEDS, run_sample

    run_sample(SPLIT_SEEDS if world == 2 else SPLIT_SEEDS[::4], mesh=sg.mesh(dp=world), split=True)


@_check
def program_mismatch_raises_on_every_rank(rank: int, world: int) -> None:
    if world < 2:
        return
    mesh = sg.mesh(dp=world)
    apply, full, buffers = sg.functional(_model())
    step = sg.static(sg.shard(mesh, params=sg.ddp("dp"), batch=sg.P("dp"))(_step_for(apply, buffers)))
    x, y = _batches(world)[0]
    rows = ROWS + (rank == 1)  # rank 1 traces another batch shape
    with pytest.raises(sg.CaptureError, match=r"rank 0 and rank 1 compiled different programs.*batch\[0\]"):
        step(full, OPT.init(full), (x[:rows], y[:rows]))


@_check
def replicated_input_that_differs_raises(rank: int, world: int) -> None:
    if world < 2:
        return
    mesh = sg.mesh(dp=world)
    apply, full, buffers = sg.functional(_model())
    step = sg.static(sg.shard(mesh, params=sg.ddp("dp"))(_step_for(apply, buffers)))  # no batch spec
    batch = _rows(_batches(world)[0], rank)  # but each rank passes its own rows
    with pytest.raises(sg.CaptureError, match=r"batch\[0\] is replicated .* rank 1 holds other values"):
        step(full, OPT.init(full), batch)


@_check
def input_replicated_over_one_axis_that_differs_raises(rank: int, world: int) -> None:
    """batch=sg.P('dp') on a 2 x 2 mesh: both tp ranks of a dp group must pass the same rows."""
    if world < 4:
        return
    mesh = sg.mesh(dp=2, tp=world // 2)
    apply, full, buffers = sg.functional(_model())
    spec = sg.ddp("dp") + sg.tp(TP, axis="tp")
    step = sg.static(sg.shard(mesh, params=spec, batch=sg.P("dp"))(_step_for(apply, buffers)))
    params = sg.distribute(full, mesh, spec)
    batch = _rows(_batches(world)[0], rank)  # each rank its own rows: the tp ranks differ
    with pytest.raises(sg.CaptureError, match=r"batch\[0\] is replicated over mesh axes 'tp'.*rank 1 holds other"):
        step(params, OPT.init(params), batch)


@_check
def wrong_specs_raise_naming_the_path(rank: int, world: int) -> None:
    mesh = sg.mesh(dp=world)
    apply, full, buffers = sg.functional(_model())
    step = _step_for(apply, buffers)
    with pytest.raises(sg.ArgumentError, match=r"params\['0'\]: sg.fsdp\('dq'\) names mesh axis 'dq'.*'dp'"):
        sg.shard(mesh, params={"0": sg.fsdp("dq")})(step)
    with pytest.raises(sg.ArgumentError, match=r"batchh= names no parameter of the step.*Did you mean batch="):
        sg.shard(mesh, batchh=sg.P("dp"))(step)
    if world > 1:
        with pytest.raises(
            sg.ArgumentError, match=rf"value\['w'\] has size 5 in dim 0, which sg.P\('dp'\) splits {world}"
        ):
            sg.distribute({"w": torch.ones(5)}, mesh, sg.P("dp"))
    with pytest.raises(
        sg.ArgumentError, match=r"value\['w'\] has 1 dims, but its spec sg.P\(None, 'dp'\) splits dim 1"
    ):
        sg.distribute({"w": torch.ones(4)}, mesh, sg.P(None, "dp"))
    placed = sg.static(sg.shard(mesh, params=sg.fsdp("dp"))(step))
    with pytest.raises(
        sg.ArgumentError, match=r"params\['0.bias'\] is a DTensor placed \(Replicate\(\),\).*asks \(Shard"
    ):
        placed(sg.distribute(full, mesh), None, _rows(_batches(world)[0], rank))
    with pytest.raises(sg.ArgumentError, match=r"the spec for params is not a prefix"):
        sg.static(sg.shard(mesh, params=[sg.P()])(step))(full, OPT.init(full), _rows(_batches(world)[0], rank))


# --------------------------------------------------------------------------- processes


def _world(rank: int, world: int) -> int:
    return world


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory) -> list[dict[str, str]]:
    out_dir = tmp_path_factory.mktemp(f"shard{request.param}")
    return spawn_checks(_CHECKS, request.param, out_dir, _world, seconds=240)


@pytest.mark.parametrize("check", list(_CHECKS))
def test_shard(results: list[dict[str, str]], check: str) -> None:
    assert_passed(results, check)
