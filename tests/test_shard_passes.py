"""The collective passes of sharded steps: elide_trivial, bucket, overlap.

Node counts and orders are checked in this process, over a fake process group of 4
ranks (``dp``) and a one-rank ``tp`` group: the graphs are traced, never run. Numbers
are checked in 2 CPU processes over gloo (one spawn for the file; each check's result
per rank is one test): every graph runs before and after a pass on the same per-rank
inputs, and the outputs must be bitwise equal. They can be: gathering and the copies
around a bucket only move data, and over 2 ranks every reduced element is ``a + b``
(or ``(a + b) / 2``), the same floats whichever bucket it travels in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from gloo_workers import assert_passed, spawn_checks
from torch.fx.experimental.proxy_tensor import make_fx

from sgraph._src import tree
from sgraph._src.passes.shard.bucketing import bucket, default_bucket_bytes
from sgraph._src.passes.shard.collectives import collectives, is_collective, is_wait
from sgraph._src.passes.shard.overlap import overlap
from sgraph._src.passes.shard.trivial import elide_trivial
from sgraph._src.program import Program, returned

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MIB = 1 << 20

# --------------------------------------------------------------------------- graphs


def _all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return c10d.wait_tensor.default(c10d.all_reduce.default(x, op, group))


def _all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, size, group))


def _reduce_scatter(x: torch.Tensor, group: str, size: int, op: str = "sum") -> torch.Tensor:
    return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(x, op, size, group))


# Functional collectives take a non-contiguous input from torch 2.13 on; 2.11's refuse
# one ("Expected input.is_contiguous()"), so there the transposed cases pass a copy.
_TAKES_STRIDED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """``x.t()``, as a collective's input (contiguous where this torch needs it)."""
    return x.t() if _TAKES_STRIDED else x.t().contiguous()


def _program(gm: torch.fx.GraphModule) -> Program:
    _, spec = tree.flatten(())
    return Program("test", gm, spec, spec, (), ())


def _trace(fn: Callable[..., list[torch.Tensor]], *args: torch.Tensor) -> Program:
    return _program(make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args))


def _one_rank_step(g: Any) -> Callable[..., list[torch.Tensor]]:
    """Collectives over the one-rank ``tp`` group around one over ``dp``; a: [4, 6], b: [3, 8]."""

    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        x = _all_gather(a * 2, g.tp, 1)
        y = _reduce_scatter(x + 1, g.tp, 1)
        z = _all_reduce(y * 3, g.tp, "avg")
        total = _all_reduce(z.sin(), g.dp)
        same = _all_reduce(b, g.tp)  # returned: must not become the input itself
        flat = _all_gather(_transposed(b), g.tp, 1).view(-1)  # `view` needs the result's contiguous layout
        return [total, same, flat]

    return step


def _gathers(g: Any) -> Callable[..., list[torch.Tensor]]:
    """a: [3, 4] (gathered transposed), b: [5], c: [2, 3, 2]."""

    def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        return [
            _all_gather(_transposed(a), g.dp, g.size),
            _all_gather(b * 2, g.dp, g.size),
            _all_gather(c, g.dp, g.size),
        ]

    return step


def _scatters(g: Any) -> Callable[..., list[torch.Tensor]]:
    """a: [3, 8] (scattered transposed), b: [8], c: [4, 5]."""

    def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        return [
            _reduce_scatter(_transposed(a), g.dp, g.size),
            _reduce_scatter(b * 2, g.dp, g.size),
            _reduce_scatter(c.exp(), g.dp, g.size),
        ]

    return step


def _reduces(g: Any) -> Callable[..., list[torch.Tensor]]:
    """Sums and averages; ``a`` is written after its first all-reduce. a, b, c: [6], d: [2, 3]."""

    def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> list[torch.Tensor]:
        first = _all_reduce(a, g.dp)
        a.mul_(3)  # a bucket holding `first` must be issued before this
        return [
            first,
            _all_reduce(a, g.dp),
            _all_reduce(b * 2, g.dp),
            _all_reduce(c, g.dp, "avg"),
            _all_reduce(d.cos(), g.dp, "avg"),
        ]

    return step


def _mixed(g: Any) -> Callable[..., list[torch.Tensor]]:
    """Compute between collectives of both groups, one fed by another; a: [4, 6], b: [8, 3]."""

    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        h = _all_gather(a, g.dp, g.size)
        u = b.sin().cos()
        v = (h @ a.t()).relu().sum(1)
        s = _reduce_scatter(_all_reduce(u, g.dp) * v[: u.shape[0], None], g.dp, g.size)
        t = _all_reduce(u.exp(), g.tp)
        return [s, t, v.tanh()]

    return step


def _fsdp_step(mesh: Any, heights: tuple[int, ...] = (2, 2, 1)) -> tuple[Callable[..., list[torch.Tensor]], list]:
    """An FSDP step over DTensors: each weight (dim 0 sharded) all-gathered, each grad reduce-scattered."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    size = mesh.size()
    widths = (6, 2 * size, 2 * size)

    def step(*leaves: torch.Tensor) -> list[torch.Tensor]:
        *local, x = leaves
        h = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        weights = []
        for w in local:
            rows, width = w.shape
            weights.append(
                DTensor.from_local(w, mesh, [Shard(0)], run_check=False, shape=(size * rows, width), stride=(width, 1))
            )
            h = (h @ weights[-1].redistribute(mesh, [Replicate()]).t()).tanh()
        loss = h.square().mean()
        grads = torch.autograd.grad(loss, weights)
        return [g.to_local() for g in grads] + [loss.redistribute(mesh, [Replicate()]).to_local()]

    example = [torch.randn(r, w, requires_grad=True) for r, w in zip(heights, widths)] + [torch.randn(3, 6)]
    return step, example


def _ddp_step(mesh: Any) -> tuple[Callable[..., list[torch.Tensor]], list]:
    """A DDP step over DTensors: replicated weights, one all-reduce per grad and one for the loss."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def step(*leaves: torch.Tensor) -> list[torch.Tensor]:
        *local, x = leaves
        h = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        weights = [DTensor.from_local(w, mesh, [Replicate()], run_check=False) for w in local]
        for w in weights:
            h = (h @ w.t()).tanh()
        loss = h.square().mean()
        grads = torch.autograd.grad(loss, weights)
        return [g.redistribute(mesh, [Replicate()]).to_local() for g in grads + (loss,)]

    example = [torch.randn(o, i, requires_grad=True) for o, i in ((5, 6), (4, 5), (4, 4), (2, 4))]
    return step, example + [torch.randn(3, 6)]


# --------------------------------------------------------------------------- inspection


def _kinds(program: Program) -> Counter[tuple[str, str]]:
    return Counter((c.kind, c.group) for c in collectives(program.graph))


def _count(program: Program, target: Any) -> int:
    return sum(n.target is target for n in program.graph.nodes)


def _assert_valid(program: Program) -> None:
    """Lint, and every node's inputs come before it."""
    program.graph.lint()
    seen: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        assert all(a in seen for a in node.all_input_nodes), node.format_node()
        seen.add(node)


def _shapes(program: Program) -> list[tuple[int, ...]]:
    return [tuple(v.meta["val"].shape) for v in returned(program.graph)]


def _position(program: Program) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(program.graph.nodes)}


# --------------------------------------------------------------------------- fake world (counts, orders)


@pytest.fixture(scope="module")
def fake() -> Any:
    """A fake process group of 4 ranks (this process is rank 0): a (dp=4, tp=1) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    yield SimpleNamespace(
        mesh=mesh["dp"], dp=mesh.get_group("dp").group_name, tp=mesh.get_group("tp").group_name, size=4
    )
    dist.destroy_process_group()


def test_elide_trivial_removes_one_rank_collectives(fake) -> None:
    program = _trace(_one_rank_step(fake), torch.randn(4, 6), torch.randn(3, 8))
    assert _kinds(program) == {("all_gather", fake.tp): 2, ("reduce_scatter", fake.tp): 1, ("all_reduce", fake.tp): 2,
                               ("all_reduce", fake.dp): 1}  # fmt: skip
    after = elide_trivial(program)
    assert _kinds(after) == {("all_reduce", fake.dp): 1}
    assert _count(after, c10d.wait_tensor.default) == 1
    # x, y, z become their inputs; `same` (a returned graph input) and `flat` (a transposed input) are copies
    made = 0 if _TAKES_STRIDED else 1  # the copy _transposed makes on torch 2.11
    assert (_count(program, aten.clone.default), _count(after, aten.clone.default)) == (made, 2)
    assert after.passes == ("elide_trivial",) and program.passes == ()
    assert _shapes(after) == _shapes(program)
    _assert_valid(after)


def test_elide_trivial_copies_an_input_that_is_written(fake) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        kept = _all_reduce(a, fake.tp) * 2
        a.copy_(b)
        return [kept, _all_reduce(b * 2, fake.tp) + 1]

    after = elide_trivial(_trace(step, torch.randn(5), torch.randn(5)))
    assert collectives(after.graph) == []
    assert _count(after, aten.clone.default) == 1  # of `a`; `b * 2` is read as it is
    _assert_valid(after)


def test_elide_trivial_drops_a_coalesced_collective(fake) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        outs = c10d.all_reduce_coalesced.default([a * 2, b + 1], "sum", fake.tp)
        return [c10d.wait_tensor.default(o) * 3 for o in outs]

    program = _trace(step, torch.randn(3), torch.randn(2, 2))
    after = elide_trivial(program)
    assert len(program.ops()) == 9
    assert [n.target for n in after.ops()] == [aten.mul.Tensor, aten.add.Tensor, aten.mul.Tensor, aten.mul.Tensor]
    _assert_valid(after)


def test_elide_trivial_without_one_rank_groups_returns_the_program(fake) -> None:
    program = _trace(_gathers(fake), torch.randn(3, 4), torch.randn(5), torch.randn(2, 3, 2))
    assert elide_trivial(program) is program


def test_bucket_merges_independent_all_reduces_into_one(fake) -> None:
    def step(*grads: torch.Tensor) -> list[torch.Tensor]:
        return [_all_reduce(g * 2, fake.dp) for g in grads]

    program = _trace(step, torch.randn(3, 4), torch.randn(5), torch.randn(()), torch.randn(2, 2, 2))
    after = bucket(program, MIB)
    assert (_kinds(program), _kinds(after)) == ({("all_reduce", fake.dp): 4}, {("all_reduce", fake.dp): 1})
    assert _count(after, c10d.wait_tensor.default) == 1
    [merged] = collectives(after.graph)
    assert merged.input_bytes == 4 * (12 + 5 + 1 + 8)
    assert _shapes(after) == _shapes(program) == [(3, 4), (5,), (), (2, 2, 2)]
    assert after.passes == ("bucket",)
    _assert_valid(after)


def test_bucket_holds_at_most_bucket_bytes(fake) -> None:
    def step(*grads: torch.Tensor) -> list[torch.Tensor]:
        return [_all_reduce(g, fake.dp) for g in grads]

    program = _trace(step, *[torch.randn(64) for _ in range(5)])  # 256 bytes each
    assert [len(collectives(bucket(program, n).graph)) for n in (256 * 5, 256 * 4, 512, 511)] == [1, 2, 3, 5]
    assert bucket(program, 255) is program


def test_bucket_keeps_a_dependent_collective_out(fake) -> None:
    def step(a: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        x = _all_reduce(a, fake.dp)
        y = _all_reduce(x * 2, fake.dp)  # reads x's result: cannot share x's bucket
        return [y, _all_reduce(c, fake.dp)]  # joins y's

    after = bucket(_trace(step, torch.randn(7), torch.randn(3)), MIB)
    assert sorted(c.input_bytes // 4 for c in collectives(after.graph)) == [7, 10]
    _assert_valid(after)


def test_bucket_merges_only_same_kind_group_dtype_and_op(fake) -> None:
    def step(*xs: torch.Tensor) -> list[torch.Tensor]:
        f32, f32_avg, bf16, gather, scatter, tp = (xs[i : i + 2] for i in range(0, 12, 2))
        return [
            *[_all_reduce(x, fake.dp) for x in f32],
            *[_all_reduce(x, fake.dp, "avg") for x in f32_avg],
            *[_all_reduce(x, fake.dp) for x in bf16],
            *[_all_gather(x, fake.dp, 4) for x in gather],
            *[_reduce_scatter(x, fake.dp, 4) for x in scatter],
            *[_all_reduce(x, fake.tp) for x in tp],
        ]

    args = [torch.randn(4, dtype=torch.bfloat16 if 4 <= i < 6 else torch.float32) for i in range(12)]
    program = _trace(step, *args)
    after = bucket(program, MIB)
    assert len(collectives(program.graph)) == 12
    assert _kinds(after) == {("all_reduce", fake.dp): 3, ("all_gather", fake.dp): 1, ("reduce_scatter", fake.dp): 1,
                             ("all_reduce", fake.tp): 1}  # fmt: skip
    reduces = {(c.group, c.node.args[1], c.node.meta["val"].dtype, c.input_bytes) for c in collectives(after.graph)
               if c.kind == "all_reduce"}  # fmt: skip
    assert reduces == {(fake.dp, "sum", torch.float32, 32), (fake.dp, "avg", torch.float32, 32),
                       (fake.dp, "sum", torch.bfloat16, 16), (fake.tp, "sum", torch.float32, 32)}  # fmt: skip


def test_bucket_never_merges_two_buckets_into_a_cycle(fake) -> None:
    """Merging the all-reduces makes the second all-gather depend on the first: those two stay apart."""

    def step(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        a = _all_gather(x, fake.dp, 4)
        m2 = _all_reduce(y, fake.dp)
        m1 = _all_reduce(a.sum(0), fake.dp)
        b = _all_gather(m2 * 2, fake.dp, 4)
        return [m1, b]

    after = bucket(_trace(step, torch.randn(2, 3), torch.randn(5)), MIB)
    assert _kinds(after) == {("all_gather", fake.dp): 2, ("all_reduce", fake.dp): 1}
    _assert_valid(after)


def test_bucket_merges_a_traced_fsdp_step(fake) -> None:
    step, example = _fsdp_step(fake.mesh)
    program = _trace(step, *example)
    after = bucket(program, MIB)
    assert _kinds(program) == {("all_gather", fake.dp): 3, ("reduce_scatter", fake.dp): 3, ("all_reduce", fake.dp): 1}
    assert _kinds(after) == {("all_gather", fake.dp): 1, ("reduce_scatter", fake.dp): 1, ("all_reduce", fake.dp): 1}
    assert _shapes(after) == _shapes(program)
    _assert_valid(after)


def test_bucket_merges_a_traced_ddp_step(fake) -> None:
    step, example = _ddp_step(fake.mesh)
    program = _trace(step, *example)
    after = bucket(program, MIB)
    assert _kinds(program) == {("all_reduce", fake.dp): 5}
    assert _kinds(after) == {("all_reduce", fake.dp): 2}  # the grads' sums; the loss's average
    assert _shapes(after) == _shapes(program)
    _assert_valid(after)


def test_bucket_refuses_a_bad_size(fake) -> None:
    program = _trace(_gathers(fake), torch.randn(3, 4), torch.randn(5), torch.randn(2, 3, 2))
    for size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"bucket: bucket_bytes must be a positive int \(bytes per bucket\)"):
            bucket(program, size)  # type: ignore[arg-type]


def test_default_bucket_bytes_follows_the_alpha_beta_model() -> None:
    assert default_bucket_bytes(10e-6, 100e9) == 9_000_000  # 9 * alpha * beta
    assert default_bucket_bytes(50e-6, 25e9) == 11_250_000
    assert default_bucket_bytes(1e-6, 10e9) == MIB  # 90 kB: clamped up
    assert default_bucket_bytes(1e-3, 100e9) == 256 * MIB  # 900 MB: clamped down
    with pytest.raises(ValueError, match=r"default_bucket_bytes: bytes_per_second must be a positive finite number"):
        default_bucket_bytes(1e-5, 0.0)
    with pytest.raises(ValueError, match=r"default_bucket_bytes: alpha_seconds must be .*found inf"):
        default_bucket_bytes(float("inf"), 1e9)


def test_overlap_issues_after_the_last_input_and_waits_before_the_first_reader(fake) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        x = a + 1
        z = (b * 2).exp()
        return [_all_reduce(x, fake.dp) + z]

    program = _trace(step, torch.randn(4), torch.randn(4))
    names = [n.name for n in program.graph.nodes]
    assert names == ["a_1", "b_1", "add", "mul", "exp", "all_reduce", "wait_tensor", "add_1", "output"]
    after = overlap(program)
    assert [n.name for n in after.graph.nodes] == [
        "a_1", "b_1", "add", "all_reduce", "mul", "exp", "wait_tensor", "add_1", "output"]  # fmt: skip
    assert after.passes == ("overlap",)
    assert overlap(after) is after


def test_overlap_issues_a_lane_as_inputs_are_ready_one_in_flight(fake) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        early = b * 2
        ready = early + 1
        late = a.exp().sin()
        first = _all_reduce(late, fake.dp)
        second = _all_reduce(early, fake.dp)  # ready first: issued first (the same on every rank)
        other = _all_reduce(ready, fake.tp)  # another group: its own lane
        return [first + second + other]

    after = overlap(_trace(step, torch.randn(4), torch.randn(4)))
    at = _position(after)
    assert at["all_reduce_1"] == at["mul"] + 1  # `second`, as soon as `early` exists
    assert at["all_reduce_2"] == at["add"] + 1 < at["exp"]
    # one in flight per lane: `first` waits on `second` before it is issued, after `sin`
    assert at["sin"] < at["wait_tensor_1"] < at["all_reduce"] == at["wait_tensor_1"] + 1
    _assert_valid(after)


def test_overlap_prefetches_parameters_one_use_ahead(fake) -> None:
    """FSDP's gathers of graph inputs: each issued when the previous one is used, so the
    gathered parameters are not all alive at once, and each overlaps one use."""

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> list[torch.Tensor]:
        for w in (w1, w2, w3):
            x = (x * _all_gather(w, fake.dp, 4)).tanh()
        return [x]

    after = overlap(_trace(step, torch.randn(16), torch.randn(4), torch.randn(4), torch.randn(4)))
    at = _position(after)
    gathers = ["all_gather_into_tensor", "all_gather_into_tensor_1", "all_gather_into_tensor_2"]
    waits = ["wait_tensor", "wait_tensor_1", "wait_tensor_2"]
    uses = ["mul", "mul_1", "mul_2"]
    assert at[gathers[0]] < at[waits[0]] < at[gathers[1]] < at[uses[0]] < at[waits[1]] < at[gathers[2]] < at[uses[1]]
    for wait, use in zip(waits, uses):
        assert at[wait] == at[use] - 1 or at[wait] == at[use] - 2  # the wait just before its use
    _assert_valid(after)


def test_overlap_keeps_writes_between_a_collective_and_what_it_reads(fake) -> None:
    """A write into a collective's input stays before its issue, and after its wait."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    write = graph.call_function(aten.copy_.default, (a, b))
    gathered = graph.call_function(c10d.all_gather_into_tensor.default, (a, 4, fake.dp))
    wait = graph.call_function(c10d.wait_tensor.default, (gathered,))
    sin = graph.call_function(aten.sin.default, (b,))
    rewrite = graph.call_function(aten.copy_.default, (a, sin))
    mul = graph.call_function(aten.mul.Tensor, (wait, 2))
    out = graph.output([mul])
    after = overlap(_program(torch.fx.GraphModule({}, graph)))
    # free of the writes, the all-gather would go first and its wait just before `mul`
    assert [n.name for n in after.graph.nodes] == [
        n.name for n in (a, b, write, gathered, sin, wait, rewrite, mul, out)]  # fmt: skip


def test_overlap_spreads_a_traced_fsdp_step(fake) -> None:
    step, example = _fsdp_step(fake.mesh)
    program = _trace(step, *example)
    after = overlap(program)

    def spans(p: Program) -> list[int]:
        at = {n: i for i, n in enumerate(p.graph.nodes)}
        return [at[c.wait] - at[c.node] for c in collectives(p.graph)]

    def compute(p: Program) -> list[str]:
        return [n.name for n in p.graph.nodes if n.op == "call_function" and not (is_collective(n) or is_wait(n))]

    before_spans, after_spans = spans(program), spans(after)
    assert before_spans == [1] * 7  # traced: each wait right after its collective
    assert all(a >= b for a, b in zip(after_spans, before_spans)) and sum(after_spans) > 3 * sum(before_spans)
    assert sorted(c.node.name for c in collectives(after.graph)) == sorted(
        c.node.name for c in collectives(program.graph)
    )
    assert sorted(compute(after)) == sorted(compute(program))
    _assert_valid(after)


def test_all_passes_compose_on_a_traced_fsdp_step(fake) -> None:
    step, example = _fsdp_step(fake.mesh)
    program = _trace(step, *example)
    after = overlap(bucket(elide_trivial(program), MIB))
    assert after.passes == ("bucket", "overlap")
    assert len(collectives(after.graph)) == 3
    _assert_valid(after)


# --------------------------------------------------------------------------- numbers (2 processes, gloo)

WORLD = 2
_CHECKS: dict[str, Callable[[int, Any], None]] = {}


def _check(fn: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    _CHECKS[fn.__name__] = fn
    return fn


def _inputs(rank: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank + 1)
    return [torch.randn(s, generator=generator) for s in shapes]


def _assert_bitwise(before: Program, after: Program, inputs: list[torch.Tensor]) -> None:
    expected = before.graph_module(*[x.clone() for x in inputs])
    found = after.graph_module(*[x.clone() for x in inputs])
    assert len(found) == len(expected)
    for i, (e, f) in enumerate(zip(expected, found)):
        assert e.shape == f.shape and e.dtype == f.dtype, (i, e.shape, f.shape)
        assert torch.equal(e, f), (i, (e - f).abs().max())


@_check
def elide_trivial_is_bitwise(rank: int, g: Any) -> None:
    inputs = _inputs(rank, (4, 6), (3, 8))
    program = _trace(_one_rank_step(g), *inputs)
    after = elide_trivial(program)
    assert _kinds(after) == {("all_reduce", g.dp): 1}
    _assert_bitwise(program, after, inputs)


@_check
def bucketed_all_gather_is_bitwise(rank: int, g: Any) -> None:
    inputs = _inputs(rank, (3, 4), (5,), (2, 3, 2))
    program = _trace(_gathers(g), *inputs)
    after = bucket(program, MIB)
    assert _kinds(after) == {("all_gather", g.dp): 1}
    _assert_bitwise(program, after, inputs)


@_check
def bucketed_reduce_scatter_is_bitwise(rank: int, g: Any) -> None:
    inputs = _inputs(rank, (3, 8), (8,), (4, 5))
    program = _trace(_scatters(g), *inputs)
    after = bucket(program, MIB)
    assert _kinds(after) == {("reduce_scatter", g.dp): 1}
    _assert_bitwise(program, after, inputs)


@_check
def bucketed_all_reduce_is_bitwise(rank: int, g: Any) -> None:
    inputs = _inputs(rank, (6,), (6,), (6,), (2, 3))
    program = _trace(_reduces(g), *inputs)
    after = bucket(program, MIB)
    assert _kinds(after) == {("all_reduce", g.dp): 3}  # first alone (a is written); sums; averages
    _assert_bitwise(program, after, inputs)


@_check
def overlapped_is_bitwise(rank: int, g: Any) -> None:
    inputs = _inputs(rank, (4, 6), (8, 3))
    program = _trace(_mixed(g), *inputs)
    after = overlap(program)
    assert [n.name for n in after.graph.nodes] != [n.name for n in program.graph.nodes]
    _assert_bitwise(program, after, inputs)


@_check
def all_passes_on_a_traced_fsdp_step_are_bitwise(rank: int, g: Any) -> None:
    step, example = _fsdp_step(g.mesh)
    program = _trace(step, *example)
    after = overlap(bucket(elide_trivial(program), MIB))
    assert len(collectives(after.graph)) == 3 < len(collectives(program.graph))
    _assert_bitwise(program, after, _inputs(rank, *[tuple(x.shape) for x in example]))


@_check
def all_passes_on_a_traced_ddp_step_are_bitwise(rank: int, g: Any) -> None:
    step, example = _ddp_step(g.mesh)
    program = _trace(step, *example)
    after = overlap(bucket(program, MIB))
    assert len(collectives(after.graph)) == 2 < len(collectives(program.graph))
    _assert_bitwise(program, after, _inputs(rank, *[tuple(x.shape) for x in example]))


def _groups(rank: int, world: int) -> SimpleNamespace:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    return SimpleNamespace(
        mesh=mesh["dp"], dp=mesh.get_group("dp").group_name, tp=mesh.get_group("tp").group_name, size=world
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, str]]:
    return spawn_checks(_CHECKS, WORLD, tmp_path_factory.mktemp("shard_passes"), _groups, seconds=120)


@pytest.mark.parametrize("check", list(_CHECKS))
def test_numbers_over_gloo(results: list[dict[str, str]], check: str) -> None:
    assert_passed(results, check)


def test_the_memory_analysis_keeps_a_collectives_input_until_its_wait(fake) -> None:
    """The communication reads its input between the issue and the wait: overlap puts
    compute there, and the input is alive through it."""
    from sgraph._src.passes.memory.analysis import memory_analysis

    def step(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        sent = a * 2
        total = _all_reduce(sent, fake.dp)
        return [total, b.exp()]

    n = 4 * 4096  # bytes of each tensor
    program = _trace(step, torch.randn(4096), torch.randn(4096))
    after = overlap(program)
    at = _position(after)
    assert at["all_reduce"] < at["exp"] < at["wait_tensor"]
    # at exp: the inputs, `sent` (still being sent), the all-reduce's result (which its
    # wait returns: one buffer, not two) and exp's
    assert memory_analysis(after).peak_bytes == 5 * n
    assert memory_analysis(program).peak_bytes == 4 * n  # traced: sent dies at the wait, before exp


def test_cleanup_drops_dead_ops_on_uninitialized_memory() -> None:
    """DTensor's sharding propagation records ops on empty tensors while it works out an
    op's output (GPU attention); nothing reads them, and they must not run."""
    from sgraph._src.passes.cleanup import cleanup

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.empty_strided.default, ([4, 4], [4, 1]))
    b = graph.call_function(aten.empty_strided.default, ([4, 4], [4, 1]))
    graph.call_function(aten.bernoulli.p, (a, 0.5))  # random: kept by plain dead-code removal
    graph.call_function(aten.mm.default, (a, b))
    kept = graph.call_function(aten.bernoulli.p, (x, 0.5))  # dead, random, but on real data: stays
    graph.output([graph.call_function(aten.sin.default, (x,))])
    after = cleanup(_program(torch.fx.GraphModule(torch.nn.Module(), graph)))
    targets = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert aten.empty_strided.default not in targets and aten.mm.default not in targets
    assert targets.count(aten.bernoulli.p) == 1 and kept.name in [n.name for n in after.graph.nodes]
