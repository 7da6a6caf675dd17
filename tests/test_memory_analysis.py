"""Lowered.memory_analysis(): predicted peaks of small steps, checked by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import mlp

import sgraph as sg
from sgraph._src.passes.memory.analysis import _live, _nbytes

X = torch.randn(256)  # 1024 bytes


def test_a_chain_of_ops_frees_each_value_after_its_last_read():
    def step(x):
        a = x * 2
        b = a + 1
        return b.sum()

    m = sg.static(step).lower(X).memory_analysis()
    # x (1024) always; a at mul; b at add (a still read there); a freed, sum (4 B) returned.
    assert m.timeline == (1024, 2048, 3072, 2052, 1028)
    assert m.peak_bytes == 3072 and m.peak_node == "add" and "in step" in m.peak_source
    assert m.by_kind == {"input:x": 1024, "temporary": 2048}
    assert [b.name for b in m.top] == ["arg0_1", "mul", "add"]
    assert "predicted peak 3072 B at %add" in m.as_text()


def test_views_allocate_nothing_and_keep_their_base_alive():
    def step(x):
        a = x * 2
        v = a.view(16, 16).t()
        b = torch.tanh(x)
        return (v + b.view(16, 16)).sum()

    lowered = sg.static(step).lower(X)
    m = lowered.memory_analysis()
    names = [b.name for b in m.buffers]
    assert not any(n.startswith(("view", "t")) and not n.startswith("tanh") for n in names), names
    # a (through its view) lives until the add, so x, a, tanh and the sum's input are live there.
    assert m.peak_bytes == 4 * 1024 and m.peak_node == "add"


def test_each_tensor_of_a_multi_output_op_is_a_buffer_made_by_the_op():
    def step(xs):
        ys = torch._foreach_mul(xs, 2.0)
        return ys[0].sum() + ys[1].sum()

    xs = [torch.randn(256), torch.randn(512)]
    m = sg.static(step).lower(xs).memory_analysis()
    made = [b for b in m.buffers if b.kind != "input:xs" and b.nbytes >= 1024]
    assert sorted(b.nbytes for b in made) == [1024, 2048]
    assert len({b.start for b in made}) == 1  # both allocated where the foreach op runs
    assert m.peak_bytes == 2 * (1024 + 2048) + 4


def test_a_donated_update_written_in_place_allocates_nothing():
    def step(p, g):
        return p - 0.1 * g

    p, g = torch.randn(256), torch.randn(256)
    donated = sg.static(step, donate="p").lower(p, g).memory_analysis()
    kept = sg.static(step).lower(p, g).memory_analysis()
    assert donated.peak_bytes == 3 * 1024  # p, g, 0.1 * g; the result goes into p
    assert kept.peak_bytes == 4 * 1024  # plus a new output
    assert kept.by_kind["output"] == 1024


def test_a_train_step_splits_inputs_activations_and_gradients():
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(mlp(32, 2, 4))
    opt = sg.optim.adamw(1e-3)

    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, buffers, x), y)

    def step(params, opt_state, batch):
        loss, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, loss

    batch = (torch.randn(64, 32), torch.randint(0, 4, (64,)))
    lowered = sg.static(step, donate=("params", "opt_state")).lower(params, opt.init(params), batch)
    m = lowered.memory_analysis()
    param_bytes = sum(v.numel() * 4 for v in params.values())
    kinds = {b.kind for b in m.buffers}
    assert {"input:params", "input:opt_state", "input:batch", "activation", "gradient"} <= kinds
    inputs = sum(b.nbytes for b in m.buffers if b.kind.startswith("input:"))
    assert inputs == 3 * param_bytes + 8 + 64 * 32 * 4 + 64 * 8  # params, mu, nu, count; x, y
    assert m.peak_bytes > inputs and max(m.timeline) == m.peak_bytes
    assert all(b.start <= b.end for b in m.buffers)


def test_cuda_buffers_round_up_to_the_allocators_blocks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        small, large = torch.empty(3, device="cuda"), torch.empty(1000, 1000, device="cuda")
        host = torch.empty(3)
    assert (_nbytes(small), _nbytes(large), _nbytes(host)) == (512, 4000256, 12)


def test_the_plot_renders_a_png_with_every_kind_and_the_peak(tmp_path):
    pytest.importorskip("matplotlib")

    def step(x):
        a = x * 2
        b = a + 1
        return b.sum()

    m = sg.static(step).lower(X).memory_analysis()
    figure = m.plot(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = figure.axes[0]
    assert axes.get_legend_handles_labels()[1] == ["input:x", "temporary", "output"]
    assert "peak 3072 B at %add" in axes.texts[0].get_text() and "%mul 1024 B temporary" in axes.texts[0].get_text()
    assert m.by_kind_timeline()["temporary"] == [0, 1024, 2048, 1024, 0]
    assert "data:image/png;base64," in m._repr_html_()


def cuda_fakes(*shapes):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(*shape, device="cuda") for shape in shapes]


def test_a_cuda_step_holds_the_cublas_workspaces_from_its_first_matmul(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)

    def step(a, b):
        return (a.relu() @ b).sum()

    a, b = cuda_fakes((64, 32), (32, 16))  # fake CUDA tensors: analysed without a GPU
    lowered = sg.static(step).lower(a, b)
    m = lowered.memory_analysis()
    ops = [n.name for n in lowered.program.graph.nodes]
    spaces = {x.name: x for x in m.buffers if x.kind == "workspace"}
    assert set(spaces) == {"cublas_workspace", "cublaslt_workspace"}
    first_matmul = ops.index("mm")
    assert all((s.start, s.end) == (first_matmul, len(ops) - 1) for s in spaces.values())
    hopper = 32 * 2**20 if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9 else None
    if hopper is not None:
        assert spaces["cublas_workspace"].nbytes == hopper
    assert spaces["cublaslt_workspace"].nbytes == 2**20
    assert m.by_kind["workspace"] == sum(s.nbytes for s in spaces.values())
    assert m.timeline[first_matmul - 1] < 2**20 < m.timeline[first_matmul]  # not before the matmul

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # torch's syntax: KiB:count pairs
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")
    m = sg.static(step).lower(a, b).memory_analysis()
    sizes = {x.name: x.nbytes for x in m.buffers if x.kind == "workspace"}
    assert sizes == {"cublas_workspace": (4096 * 2 + 16 * 8) * 1024, "cublaslt_workspace": 2048 * 1024}


def test_a_cuda_step_without_matmuls_and_a_cpu_step_hold_no_workspace():
    def step(a):
        return (a * 2).sum()

    def matmul(a, b):
        return a @ b

    (a,) = cuda_fakes((64, 32))
    assert "workspace" not in sg.static(step).lower(a).memory_analysis().by_kind
    on_cpu = sg.static(matmul).lower(X.view(16, 16), X.view(16, 16)).memory_analysis()
    assert all(x.kind != "workspace" for x in on_cpu.buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cross_entropy_counts_the_logits_chunk_it_holds_inside(dtype):
    from sgraph._src.kernels.linear_cross_entropy import chunk_rows

    rows, features, classes = 256, 16, 1024
    params = {"head": torch.randn(classes, features, dtype=dtype)}
    batch = (torch.randn(rows, features, dtype=dtype), torch.randint(0, classes, (rows,)))

    def step(params, batch):
        x, y = batch
        loss, grads = sg.value_and_grad(lambda p: F.cross_entropy(x @ p["head"].T, y))(params)
        return {"head": params["head"] - 0.1 * grads["head"]}, loss

    lowered = sg.fuse(step).lower(params, batch)
    m = lowered.memory_analysis()
    nodes = list(lowered.program.graph.nodes)
    op = next(i for i, n in enumerate(nodes) if "linear_cross_entropy" in str(n.target))
    inside = [x for x in m.buffers if x.name.startswith(nodes[op].name + ".inside")]
    logits = chunk_rows(rows, classes) * classes * dtype.itemsize
    running_grad_w = [] if dtype == torch.float32 else [classes * features * 4]
    assert [x.nbytes for x in inside] == [logits, *running_grad_w]
    assert all((x.start, x.end, x.kind) == (op, op, "workspace") for x in inside)
    assert "test_memory_analysis.py" in inside[0].source  # the user's line of the loss
    without = [x for x in m.buffers if x not in inside]
    assert m.timeline[op] == _live(without, len(nodes))[op] + sum(x.nbytes for x in inside)


def test_a_step_on_generated_cuda_kernels_holds_the_l2_flush_of_their_first_timings():
    def step(a):
        return (a * 2).sum()

    (a,) = cuda_fakes((64, 32))
    fused = sg.fuse(step).lower(a).memory_analysis()
    flush = [x for x in fused.buffers if x.name == "autotuning_l2_flush"]
    expected = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 60 * 2**20
    assert [(x.nbytes, x.kind, x.start, x.end) for x in flush] == [(expected, "workspace", 0, len(fused.timeline) - 1)]
    assert fused.peak_bytes == sg.static(step).lower(a).memory_analysis().peak_bytes + expected
    assert all(x.name != "autotuning_l2_flush" for x in sg.fuse(step).lower(X).memory_analysis().buffers)  # CPU


def _adamw_step(leaves):
    opt = sg.optim.adamw(1e-3)

    def step(params, opt_state, x):  # gradients by hand: autograd on fake CUDA tensors needs a GPU
        grads = {k: (x @ w).mean(0).expand_as(w) * w for k, w in params.items()}
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, x.sum()

    shapes = [(32, 8 * (i + 1)) for i in range(leaves)]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        params = {f"w{i}": torch.empty(*s, device="cuda") for i, s in enumerate(shapes)}
        x = torch.empty(4, 32, device="cuda")
        opt_state = opt.init(params)
    return step, params, opt_state, x


@pytest.mark.parametrize("leaves", [3, 17])
def test_a_generated_in_place_adamw_holds_inductors_timing_copies_at_the_update(leaves):
    step, params, opt_state, x = _adamw_step(leaves)
    lowered = sg.static(sg.fuse(step), donate=("params", "opt_state")).lower(params, opt_state, x)
    nodes = list(lowered.program.graph.nodes)
    (update,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.sgraph.adamw_.default]
    m = lowered.memory_analysis()
    copies = [b for b in m.buffers if b.name.endswith(".timing_copies")]
    if leaves > 16:  # ATen's multi-tensor kernel runs the update: nothing timed, nothing copied
        assert copies == []
        return
    largest = max(_nbytes(p) for p in params.values()) * 3  # the param and both moments of one leaf
    assert [(b.nbytes, b.kind, b.start, b.end) for b in copies] == [(largest, "workspace", update, update)]
    without = [b for b in m.buffers if b not in copies]
    assert m.timeline[update] == _live(without, len(nodes))[update] + largest
    on_eager_kernels = sg.static(step, donate=("params", "opt_state")).lower(params, opt_state, x)
    assert not any(b.name.endswith(".timing_copies") for b in on_eager_kernels.memory_analysis().buffers)
    not_donated = sg.static(sg.fuse(step)).lower(params, opt_state, x)  # a new param: nothing written in place
    assert not any(b.name.endswith(".timing_copies") for b in not_donated.memory_analysis().buffers)
