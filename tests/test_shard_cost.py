"""cost_analysis(): the alpha-beta communication model, checked by hand, on a fake
1024-rank (128 nodes x 8 GPUs) mesh: "tp" holds 8 contiguous ranks, "dp" every 8th."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from sgraph._src import tree
from sgraph._src.capture import SOURCE_KEY, Source, SourceMode
from sgraph._src.errors import ArgumentError, ArgumentTypeError, UnsupportedError
from sgraph._src.passes.memory.analysis import memory_analysis
from sgraph._src.passes.shard.collectives import group_ranks
from sgraph._src.passes.shard.cost import Links, collective_seconds, cost_analysis
from sgraph._src.program import LeafInfo, Program
from sgraph._src.source import user_source

c10d = torch.ops._c10d_functional
# Round numbers, so the expected times below are easy to work out by hand.
LINKS = Links(intra_node_alpha=1e-6, intra_node_bandwidth=1e11, inter_node_alpha=1e-5, inter_node_bandwidth=1e9)


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process; the fake 1024-rank one cannot be made")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    yield init_device_mesh("cpu", (128, 8), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


def _program(graph_module: torch.fx.GraphModule, inputs: dict[str, torch.Tensor]) -> Program:
    leaves = [LeafInfo(path, i, tuple(t.shape), t.dtype, t.device) for i, (path, t) in enumerate(inputs.items())]
    return Program(
        name="step",
        graph_module=graph_module,
        in_spec=tree.structure((tuple(inputs.values()), {})),
        out_spec=tree.structure([0]),
        inputs=tuple(leaves),
        outputs=(LeafInfo("[0]", 0),),
    )


def _one_collective(op, args: tuple, shape: tuple[int, ...], source: Source | None = None) -> Program:
    """A graph ``x -> comm = op(x, *args) -> wait_tensor -> output`` on meta tensors."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(1000, 250, device="meta")
    issued = graph.create_node("call_function", op, (x, *args), name="comm")
    issued.meta["val"] = torch.empty(shape, device="meta")
    if source is not None:
        issued.meta[SOURCE_KEY] = source
    waited = graph.call_function(c10d.wait_tensor.default, (issued,))
    waited.meta["val"] = issued.meta["val"]
    graph.output([waited])
    return _program(torch.fx.GraphModule(torch.nn.Module(), graph), {"x": torch.empty(1000, 250)})


@pytest.mark.parametrize(
    "kind, nbytes, size, alpha, bandwidth, expected",
    [
        # 7 steps of 10 us, and 7/8 of 8 MB at 1 GB/s.
        ("all_gather", 8_000_000, 8, 1e-5, 1e9, 7e-5 + 7e-3),
        ("reduce_scatter", 8_000_000, 8, 1e-5, 1e9, 7e-5 + 7e-3),
        # Twice 3 steps of 20 us, and twice 3/4 of 4 MB at 10 GB/s.
        ("all_reduce", 4_000_000, 4, 2e-5, 1e10, 1.2e-4 + 6e-4),
        ("all_to_all", 1_000_000_000, 2, 1e-6, 1e9, 1e-6 + 0.5),
        # A chain of 5: 4 steps of latency, then every byte once.
        ("broadcast", 2_000_000_000, 5, 1e-6, 1e9, 4e-6 + 2.0),
    ],
)
def test_ring_formulas_on_hand_computed_cases(kind, nbytes, size, alpha, bandwidth, expected):
    found = collective_seconds(kind, nbytes, size, alpha=alpha, bandwidth=bandwidth)
    assert found == pytest.approx(expected, rel=1e-12, abs=0)
    assert collective_seconds(kind, nbytes, 1, alpha=alpha, bandwidth=bandwidth) == 0.0


def test_an_unknown_kind_is_named():
    with pytest.raises(ArgumentError, match=r"kind='gather' is not one of 'all_gather'"):
        collective_seconds("gather", 1, 2, alpha=1.0, bandwidth=1.0)


def test_the_link_class_follows_the_nodes_the_ranks_sit_on():
    links = Links()
    assert links.link(range(8)) == "intra-node"
    assert links.link(range(8, 16)) == "intra-node"
    assert links.link(range(4, 12)) == "inter-node"  # contiguous, but across nodes 0 and 1
    assert links.link([0, 8]) == "inter-node"
    assert Links(ranks_per_node=16).link(range(4, 12)) == "intra-node"
    assert LINKS.seconds("all_gather", 8_000_000, ranks=[0, 8]) == pytest.approx(1e-5 + 4e-3, rel=1e-12)
    assert LINKS.seconds("all_gather", 8_000_000, ranks=[0, 1]) == pytest.approx(1e-6 + 4e-5, rel=1e-12)


def test_tp_is_intra_node_and_dp_inter_node_on_a_128_by_8_mesh(mesh):
    tp, dp = mesh.get_group("tp").group_name, mesh.get_group("dp").group_name
    assert group_ranks(tp) == list(range(8))
    assert group_ranks(dp) == list(range(0, 1024, 8))
    on_tp = cost_analysis(_one_collective(c10d.all_reduce.default, ("sum", tp), (1000, 250)), LINKS)
    on_dp = cost_analysis(_one_collective(c10d.all_reduce.default, ("sum", dp), (1000, 250)), LINKS)
    (tp_row,), (dp_row,) = on_tp.collectives, on_dp.collectives
    assert (tp_row.kind, tp_row.size, tp_row.link, tp_row.nbytes) == ("all_reduce", 8, "intra-node", 1_000_000)
    assert (dp_row.kind, dp_row.size, dp_row.link, dp_row.nbytes) == ("all_reduce", 128, "inter-node", 1_000_000)
    # 2 * 7 steps of 1 us + 2 * 7/8 of 1 MB at 100 GB/s; 2 * 127 steps of 10 us + 2 * 127/128 of 1 MB at 1 GB/s.
    assert tp_row.seconds == pytest.approx(1.4e-5 + 1.75e-5, rel=1e-12)
    assert dp_row.seconds == pytest.approx(2.54e-3 + 1.984375e-3, rel=1e-12)
    one_node = Links(ranks_per_node=1024)
    (row,) = cost_analysis(_one_collective(c10d.all_reduce.default, ("sum", dp), (1000, 250)), one_node).collectives
    assert row.link == "intra-node"


def test_a_row_names_the_users_source_line(mesh):
    tp = mesh.get_group("tp").group_name
    source = Source("train.py", 12, "step")
    program = _one_collective(c10d.all_gather_into_tensor.default, (8, tp), (8000, 250), source)
    cost = cost_analysis(program, LINKS)
    (row,) = cost.collectives
    assert (row.node, row.group, row.nbytes) == ("comm", tp, 8_000_000)
    assert row.source == source.short() == "train.py:12 in step"
    assert "%comm " in str(cost) and "# train.py:12 in step" in cost.as_text()


def test_a_group_missing_from_this_process_is_named(mesh):
    gather = _one_collective(c10d.all_gather_into_tensor.default, (8, "no-such-group"), (8000, 250))
    with pytest.raises(UnsupportedError, match=r"%comm runs on a process group that does not exist"):
        cost_analysis(gather, LINKS)
    reduce = _one_collective(c10d.all_reduce.default, ("sum", "no-such-group"), (1000, 250))
    with pytest.raises(UnsupportedError, match=r"a collective of step runs on a process group that does not exist"):
        cost_analysis(reduce, LINKS)


B, D, H = 1024, 256, 512  # batch, model width, hidden width (global shapes)


def _fsdp_tp_step(mesh):
    """A 2-layer MLP: a colwise then a rowwise TP linear, weights also sharded over dp
    (gathered before use, gradients reduce-scattered), the loss all-reduced over dp."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def dtensor(local, placements, shape):
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    def step(x, w1, w2):
        x = dtensor(x, [Shard(0), Replicate()], (B, D))
        w1 = dtensor(w1.requires_grad_(), [Shard(1), Shard(0)], (H, D))  # colwise over tp
        w2 = dtensor(w2.requires_grad_(), [Shard(0), Shard(1)], (D, H))  # rowwise over tp
        h = torch.relu(x @ w1.redistribute(mesh, [Replicate(), Shard(0)]).t())
        y = h @ w2.redistribute(mesh, [Replicate(), Shard(1)]).t()
        y = y.redistribute(mesh, [Shard(0), Replicate()])  # the rowwise partial sums
        loss = (y * y).sum().redistribute(mesh, [Replicate(), Replicate()])
        g1, g2 = torch.autograd.grad(loss, [w1, w2])
        return [loss.to_local(), g1.to_local(), g2.to_local()]

    def traced(*args):
        with SourceMode("test", context=user_source):
            return step(*args)

    inputs = {"x": torch.randn(B // 128, D), "w1": torch.randn(H // 8, D // 128), "w2": torch.randn(D // 128, H // 8)}
    graph_module = make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs.values())
    return _program(graph_module, inputs)


def test_an_fsdp_by_tp_step_on_1024_ranks(mesh):
    start = time.perf_counter()
    program = _fsdp_tp_step(mesh)
    cost = cost_analysis(program, LINKS)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, elapsed

    tp, dp = mesh.get_group("tp").group_name, mesh.get_group("dp").group_name
    assert cost.counts == {"all_gather": 2, "all_reduce": 2, "reduce_scatter": 2}
    weight = H * D * 4 // 8  # one tp shard of a weight, gathered over dp: 64 KiB
    expected = [
        ("all_gather", dp, 128, "inter-node", weight),  # w1, before the colwise linear
        ("all_gather", dp, 128, "inter-node", weight),  # w2, before the rowwise linear
        ("all_reduce", tp, 8, "intra-node", B // 128 * D * 4),  # the rowwise linear's output
        ("all_reduce", dp, 128, "inter-node", 4),  # the loss
        ("reduce_scatter", dp, 128, "inter-node", weight),  # the weights' gradients
        ("reduce_scatter", dp, 128, "inter-node", weight),
    ]
    assert [(r.kind, r.group, r.size, r.link, r.nbytes) for r in cost.collectives] == expected
    assert cost.total_bytes == 4 * weight + 8192 + 4

    gathers = 4 * (127 * 1e-5 + 127 / 128 * 65536 / 1e9)  # the all_gathers and reduce_scatters
    activation = 2 * 7 * 1e-6 + 2 * 7 / 8 * 8192 / 1e11
    loss = 2 * 127 * 1e-5 + 2 * 127 / 128 * 4 / 1e9
    assert cost.total_seconds == pytest.approx(gathers + activation + loss, rel=1e-12)
    assert math.isclose(cost.total_seconds, sum(r.seconds for r in cost.collectives))

    assert all(r.source.endswith("in step") for r in cost.collectives)
    assert cost.memory_bytes == memory_analysis(program).peak_bytes
    assert cost.memory_bytes > (B // 128 * D + 2 * H * D // 1024) * 4 + weight  # the inputs and a gathered weight
    text = cost.as_text()
    assert "6 collectives" in text and "by kind: all_gather 2, all_reduce 2, reduce_scatter 2" in text
    assert f"group {dp:<8}    128 ranks  inter-node    5 collectives" in text
    assert f"group {tp:<8}      8 ranks  intra-node     1 collective " in text


def test_a_given_memory_analysis_is_used_not_recomputed(mesh):
    program = _one_collective(c10d.all_reduce.default, ("sum", mesh.get_group("tp").group_name), (1000, 250))
    memory = dataclasses.replace(memory_analysis(program), peak_bytes=123)
    assert cost_analysis(program, memory=memory).memory_bytes == 123
    assert cost_analysis(program).memory_bytes == 2_000_000  # x and the all_reduce's result, which its wait returns
    with pytest.raises(ArgumentTypeError, match=r"memory must be the program's MemoryAnalysis or None; found int"):
        cost_analysis(program, memory=123)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"links must be an sg.Links or None; found dict"):
        cost_analysis(program, {"ranks_per_node": 4})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("intra_node_alpha", 0.0, ArgumentError, r"intra_node_alpha must be a positive, finite number of seconds"),
        ("inter_node_alpha", -1e-6, ArgumentError, r"inter_node_alpha must be a positive, finite number of seconds"),
        ("intra_node_bandwidth", math.inf, ArgumentError, r"intra_node_bandwidth must be a positive, finite number"),
        ("inter_node_bandwidth", math.nan, ArgumentError, r"inter_node_bandwidth must be .* bytes per second per rank"),
        ("inter_node_bandwidth", "40GB/s", ArgumentTypeError, r"inter_node_bandwidth must be a number of bytes"),
        ("intra_node_alpha", True, ArgumentTypeError, r"intra_node_alpha must be a number of seconds .*; found True"),
        ("ranks_per_node", 0, ArgumentError, r"ranks_per_node must be at least 1 \(GPUs per node\); found 0"),
        ("ranks_per_node", 8.0, ArgumentTypeError, r"ranks_per_node must be an int \(GPUs per node\); found 8.0"),
    ],
)
def test_bad_links_raise_naming_the_field(field, value, error, message):
    with pytest.raises(error, match=f"^sg.Links: {message}"):
        Links(**{field: value})
