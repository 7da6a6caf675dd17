"""sg.fuse(reuse_blocks=True): repeated blocks taken out into one subgraph, called per copy.

The pass is checked on traced steps and hand-built graphs, run eagerly before and after
(the same ATen ops: results bitwise equal); one tiny GPT is compiled by Inductor and
trained against eager.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import tiny_gpt, token_batches
from torch.fx.experimental.proxy_tensor import make_fx

import sgraph as sg
from sgraph._src.runtime.regions import outline_blocks
from sgraph._src.source import GRAD_MODULE_KEY, MODULE_KEY

SUBGRAPH_CALL = torch.ops.higher_order.invoke_subgraph


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, hidden: tuple[int, ...] = (16, 16, 16), d: int = 8, between: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for h in hidden)
        self.head = nn.Linear(d, 4)
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if self.between != 1.0:
                x = x * self.between  # an op of no submodule, between two blocks
        return self.head(x)


def grads_program(model: nn.Module):
    """The lowered program of a gradient step over ``model``, and its flat inputs."""
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(model)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def step(params, x, y):
        return sg.grad(lambda p: F.cross_entropy(apply(p, buffers, x), y))(params)

    program = sg.static(step).lower(params, x, y).program
    return program, sg.tree.leaves((params, x, y))


def run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = gm(*inputs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is SUBGRAPH_CALL)


def test_blocks_of_a_module_list_call_one_forward_and_one_backward_subgraph():
    program, inputs = grads_program(Net())
    gm = program.copy_graph_module()
    outlined = outline_blocks(gm, min_ops=4)
    # The first block's backward computes no gradient for the step's input x: it is
    # another region, left inline; the other two share one subgraph.
    assert (outlined.calls, outlined.subgraphs) == (5, 2)
    assert calls(outlined.gm) == 5
    assert len({n.args[0].target for n in outlined.gm.graph.nodes if n.target is SUBGRAPH_CALL}) == 2
    assert [m[1] for m in outlined.members] == ["sgraph_block_0"] * 3 + ["sgraph_block_1"] * 2
    for expected, found in zip(run(gm, inputs), run(outlined.gm, inputs), strict=True):
        assert torch.equal(expected, found)


def test_backward_ops_carry_the_block_they_differentiate():
    program, _ = grads_program(Net(between=3.0))
    backward = {n.meta[GRAD_MODULE_KEY] for n in program.graph.nodes if GRAD_MODULE_KEY in n.meta}
    assert {path.split(".")[1] for path in backward if path.startswith("blocks.")} == {"0", "1", "2"}
    assert not any(MODULE_KEY in n.meta and GRAD_MODULE_KEY in n.meta for n in program.graph.nodes)
    # The backward of the scaling between blocks belongs to no block.
    scalings = [n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor and 3.0 in n.args]
    backward_scalings = [n for n in scalings if MODULE_KEY not in n.meta]
    assert len(scalings) == 6 and len(backward_scalings) == 3
    assert not any(GRAD_MODULE_KEY in n.meta for n in backward_scalings)


def test_blocks_of_other_shapes_share_nothing():
    program, _ = grads_program(Net(hidden=(16, 16, 32)))
    outlined = outline_blocks(program.copy_graph_module(), min_ops=4)
    assert (outlined.calls, outlined.subgraphs) == (2, 1)  # the forwards of blocks 0 and 1; the rest inline


def test_small_blocks_stay_inline():
    program, _ = grads_program(Net())
    gm = program.copy_graph_module()
    assert outline_blocks(gm, min_ops=10_000).gm is gm


def _stamped(fn, *examples: torch.Tensor, blocks: int, per_block: int):
    """``fn`` traced, its first ``blocks * per_block`` ops stamped as ``layers.<i>``."""
    gm = make_fx(fn, tracing_mode="fake")(*examples)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    for i, node in enumerate(ops[: blocks * per_block]):
        node.meta[MODULE_KEY] = f"layers.{i // per_block}.f"
    return gm


def test_a_region_an_outside_op_both_reads_and_feeds_is_left_inline():
    def fn(x):
        for _ in range(2):
            a = x.sin()  # in the block
            b = a.exp()  # in the block
            c = (a * 3).cos()  # outside: reads the block, feeds it
            x = (b + c).tanh()  # in the block
        return x

    gm = _stamped(fn, torch.randn(4), blocks=2, per_block=6)
    for node in gm.graph.nodes:
        if node.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.cos.default):
            del node.meta[MODULE_KEY]
    assert outline_blocks(gm, min_ops=1).calls == 0


def test_a_block_writing_into_its_input_is_left_inline():
    def fn(x):
        for _ in range(2):
            y = x.sin()
            y.add_(1)
            x = y.cos()
        return x

    gm = _stamped(fn, torch.randn(4), blocks=2, per_block=3)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    assert outline_blocks(gm, min_ops=1).calls == 0


def test_a_block_drawing_random_numbers_is_left_inline():
    """Shared code would draw the same dropout mask in every copy."""

    def fn(x):
        for _ in range(2):
            y, _ = torch.ops.aten.native_dropout(x.sin(), 0.5, True)
            x = y.cos()
        return x

    gm = _stamped(fn, torch.randn(4), blocks=2, per_block=5)
    assert outline_blocks(gm, min_ops=1).calls == 0

    def no_dropout(x):  # the same with p = 0 draws nothing: shared
        for _ in range(2):
            y, _ = torch.ops.aten.native_dropout(x.sin(), 0.0, True)
            x = y.cos()
        return x

    assert outline_blocks(_stamped(no_dropout, torch.randn(4), blocks=2, per_block=5), min_ops=1).calls == 2


@pytest.mark.parametrize("collective", [True, False])
def test_a_block_with_a_collective_is_left_inline(collective):
    """Collectives stay where sg.shard's overlap pass put them."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    with torch._subclasses.FakeTensorMode():
        val = torch.empty(4)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = val
    for b in range(2):
        a = graph.call_function(aten.sin.default, (x,))
        if collective:
            r = graph.call_function(c10d.all_reduce.default, (a, "sum", "0"))
            w = graph.call_function(c10d.wait_tensor.default, (r,))
        else:
            r = graph.call_function(aten.exp.default, (a,))
            w = graph.call_function(aten.tanh.default, (r,))
        x = graph.call_function(aten.cos.default, (w,))
        for node in (a, r, w, x):
            node.meta.update({"val": val, MODULE_KEY: f"layers.{b}.f"})
    graph.output(x)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert outline_blocks(gm, min_ops=1).calls == (0 if collective else 2)


def test_a_view_read_outside_is_taken_again_outside_the_call():
    def fn(x):
        views = []
        for _ in range(2):
            t = (x.sin() * 2).exp()
            views.append(t.t())  # a view of the block's value, read outside
            x = t.cos()
        return x, views[0] + 1, views[1] * 2

    x = torch.randn(3, 5)
    gm = _stamped(fn, x, blocks=2, per_block=5)
    outlined = outline_blocks(gm, min_ops=1)
    assert outlined.calls == 2
    body = next(n.args[0].target for n in outlined.gm.graph.nodes if n.target is SUBGRAPH_CALL)
    sub = getattr(outlined.gm, body)
    returned = [a for a in sub.graph.output_node().args[0]]
    assert not any(a.target is torch.ops.aten.t.default for a in returned)  # no output is a view
    outside = [n for n in outlined.gm.graph.nodes if n.target is torch.ops.aten.t.default]
    assert len(outside) == 2
    for expected, found in zip(run(gm, [x]), run(outlined.gm, [x]), strict=True):
        assert torch.equal(expected, found)


def test_short_op_text_while_compiling_and_the_full_text_elsewhere():
    from torch._inductor import exc

    from sgraph._src.runtime.inductor import _short_op_text

    class Deep:  # an IR-like value whose text is long
        def __str__(self) -> str:
            return "x" * 10_000

    full = exc.OperatorIssue.operator_str
    with _short_op_text():
        short = exc.OperatorIssue.operator_str(torch.ops.aten.add.Tensor, [Deep()], {})
        other: list[str] = []
        thread = threading.Thread(
            target=lambda: other.append(exc.OperatorIssue.operator_str(torch.ops.aten.add.Tensor, [Deep()], {}))
        )
        thread.start()
        thread.join()
    assert len(short) < 300 and "aten.add.Tensor" in short
    assert len(other[0]) > 10_000  # another thread's compile keeps Inductor's own text
    assert exc.OperatorIssue.operator_str is full


@pytest.mark.slow
def test_tiny_gpt_with_reused_blocks_trains_like_eager():
    """Two GPT blocks: forward and backward each compiled once and called twice; three
    donated momentum-SGD steps against the same step run eagerly (SGD: Adam would turn
    the rounding noise of the key bias's zero gradient into lr-sized updates)."""
    from models_for_tests import gpt_loss

    apply, params, buffers = sg.functional(tiny_gpt())
    opt = sg.optim.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: gpt_loss(apply(p, buffers, x), y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    fused = sg.static(sg.fuse(reuse_blocks=True)(step), donate=("params", "opt_state"))
    mine = [{k: v.clone() for k, v in params.items()}, None]
    mine[1] = opt.init(mine[0])
    ref = [{k: v.clone() for k, v in params.items()}, None]
    ref[1] = opt.init(ref[0])
    for batch in token_batches(3, 2):
        mine[0], mine[1], loss = fused(mine[0], mine[1], batch)
        ref[0], ref[1], ref_loss = step(ref[0], ref[1], batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for k in mine[0]:
        torch.testing.assert_close(mine[0][k], ref[0][k], rtol=1e-5, atol=1e-6, msg=k)
    compiled = fused.last_compiled
    stats = compiled.stats
    assert (stats.block_calls, stats.block_subgraphs) == (4, 2)
    # the momentum and param updates stay functional ATen ops (Inductor writes them into
    # the donated buffers): no in-place ATen op keeps the step from entering below AOTAutograd
    assert stats.inductor_entry == "direct"
    text = compiled.as_text()
    listing = text[text.index("kernels (") : text.index("  block code")].splitlines()[1:]
    blocks = [line for line in listing if "subgraph" in line]
    assert len(blocks) == 4, text[-2000:]
    inner = sum(int(line.split("(")[1].split()[0]) for line in blocks)  # "#2 repeated_subgraph0 (8 kernels): ..."
    assert stats.kernels_fused is not None and stats.kernels_fused > inner
    # each block's shared code is listed once, with its kernel calls: as many as each call of it counts
    codes = text[text.index("  block code") :].split("  block code ")[1:]
    assert len(codes) == 2, text[-3000:]
    for code in codes:
        head, *calls = code.strip().splitlines()
        name = head.split()[0]
        assert head.startswith(f"{name} (2 calls per step)"), head
        per_call = {int(line.split("(")[1].split()[0]) for line in blocks if f" {name} (" in line}
        assert per_call == {len(calls)}, (per_call, calls)
        assert all(line.split()[0] == f"{name}.{i}" for i, line in enumerate(calls, 1)), calls
        assert any(line.split()[1].startswith(("cpp_fused", "triton_")) for line in calls), calls
    # library ops whose result the generated code assigns (``buf8 = torch.ops.aten...``) count as calls
    called = [line.split()[1] for code in codes for line in code.strip().splitlines()[1:]]
    assert sum(name.startswith("torch.ops.aten._scaled_dot_product") for name in called) == 2, called
    assert "reuse_blocks=False" in repr(sg.fuse(reuse_blocks=False)(step))
    with pytest.raises(sg.ArgumentTypeError, match="reuse_blocks must be True or False"):
        sg.fuse(reuse_blocks=1)(step)
    assert sg.fuse(step).options.fuse.reuse_blocks  # on by default
