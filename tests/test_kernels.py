"""sgraph's own kernels against the ATen reference.

The Triton kernel runs in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported) and compiled
on a GPU. fp32 is compared tightly; bf16 within 1e-2 of the largest element (one
bf16 rounding of the logits' gradient, and grad_W summed over chunks in fp32 from
bf16 partial products, which loses relative precision where the chunks cancel).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sgraph._src.kernels import linear_cross_entropy as lce
from sgraph._src.kernels.cross_entropy_rows import cross_entropy_rows_, cross_entropy_rows_reference


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels on CPU tensors here; None if it can.

    Triton 3.6's interpreter (torch 2.11's) turns a loop bound given at run time into
    an int through a one-element NumPy array, which NumPy 2.4 refuses: a kernel looping
    up to a runtime size then fails in the interpreter (compiled, it runs). A probe
    kernel with such a loop tells."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "needs TRITON_INTERPRET=1"
    try:
        import numpy
        import triton
    except ImportError:
        return "needs triton"
    try:
        _probe[(1,)](torch.zeros(8), 8, BLOCK=4)
    except Exception as error:  # noqa: BLE001 - any failure of the probe means the interpreter cannot be used
        return (
            f"Triton {triton.__version__}'s interpreter cannot loop to a runtime bound with NumPy "
            f"{numpy.__version__} ({type(error).__name__}); the GPU runs the kernels compiled"
        )
    return None


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(out, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        for start in range(0, n, BLOCK):
            tl.store(out + start + tl.arange(0, BLOCK), tl.full([BLOCK], 1.0, tl.float32))
except ImportError:
    pass

_INTERPRETER = _interpreter_problem()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(_INTERPRETER is not None, reason=str(_INTERPRETER))),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=1e-2 * scale)


def rows_case(device, dtype, classes, smoothing):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(classes)
    z = (3 * torch.randn(6, classes, generator=g)).to(device=device, dtype=dtype)
    target = torch.tensor([0, classes - 1, -100, 5, 17, -100], device=device)
    scale = torch.tensor([0.25], device=device)
    return z, target, scale, smoothing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("classes,smoothing", [(1000, 0.0), (5000, 0.1), (4096, 0.0)])
def test_cross_entropy_rows_kernel_matches_aten(device, dtype, classes, smoothing):
    z, target, scale, eps = rows_case(device, dtype, classes, smoothing)
    logits = z.float().clone().requires_grad_()
    expected = F.cross_entropy(logits, target, reduction="none", label_smoothing=eps)
    (expected.sum() * scale[0]).backward()
    out = z.clone()
    losses = cross_entropy_rows_(out, target, scale, -100, eps)
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5)
    close(out, logits.grad.to(dtype), dtype)
    ref = z.clone()
    torch.testing.assert_close(cross_entropy_rows_reference(ref, target, scale, -100, eps), expected.detach())
    close(ref, out, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_rows_with_masked_classes_match_aten(device, dtype):
    """Logits masked to -inf (classes a model rules out): whole blocks of columns at the
    start of a row, one at the end, single columns. Their probabilities and gradients are
    zero and the rest of the row is as if they were not there, as in ATen."""
    z, target, scale, eps = rows_case(device, dtype, 5000, 0.0)
    z[0, :2500] = float("-inf")  # the row's first blocks all -inf, its target (0) too: an infinite loss
    z[1, :2048] = float("-inf")
    z[3, 4096:] = float("-inf")
    z[4, ::3] = float("-inf")
    target[4] = 16  # not a masked class
    logits = z.float().clone().requires_grad_()
    expected = F.cross_entropy(logits, target, reduction="none")
    (expected[1:].sum() * scale[0]).backward()
    out = z.clone()
    losses = cross_entropy_rows_(out, target, scale, -100, eps)
    assert losses[0].isinf() and expected[0].isinf()
    torch.testing.assert_close(losses[1:], expected[1:].detach(), rtol=1e-5, atol=1e-5)
    close(out[1:], logits.grad[1:].to(dtype), dtype)
    assert not out[1, :2048].any() and not out[3, 4096:].any() and not out[4, ::3].any()
    ref = z.clone()
    ref_losses = cross_entropy_rows_reference(ref, target, scale, -100, eps)
    torch.testing.assert_close(ref_losses[1:], losses[1:])
    close(ref[1:], out[1:], dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.0), ("mean", 0.1)])
def test_linear_cross_entropy_matches_aten_in_several_chunks(monkeypatch, device, dtype, reduction, smoothing):
    monkeypatch.setattr(lce, "_CHUNK_ELEMENTS", 128 * 1000)  # 300 rows in 3 chunks of 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (0.2 * torch.randn(1000, 32, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, 1000, (300,), generator=g).to(device)
    y[::7] = -100
    expected = F.cross_entropy((x @ w.T).float(), y, reduction=reduction, label_smoothing=smoothing)
    grads = torch.autograd.grad(expected * 3, (x, w))
    loss = lce.linear_cross_entropy(x, w, y, reduction=reduction, label_smoothing=smoothing)
    mine = torch.autograd.grad(loss * 3, (x, w))
    assert loss.dtype == torch.float32 and mine[0].dtype == dtype and mine[1].dtype == dtype
    torch.testing.assert_close(loss, expected, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=0)
    for a, b in zip(mine, grads):
        close(a, b, dtype)


def test_linear_cross_entropy_all_ignored_and_checks():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(1024, 8, requires_grad=True)
    y = torch.full((4,), -100)
    loss = lce.linear_cross_entropy(x, w, y)
    expected = F.cross_entropy(x @ w.T, y)
    assert torch.isnan(loss) and torch.isnan(expected)  # a mean over no rows, as in PyTorch
    gx, gw = torch.autograd.grad(lce.linear_cross_entropy(x, w, y, reduction="sum"), (x, w))
    assert not gx.any() and not gw.any()
    with pytest.raises(ValueError, match=r"reduction='none'; use 'mean' or 'sum'"):
        lce.linear_cross_entropy(x, w, y, reduction="none")
    assert lce.chunk_rows(16384, 32768) == 4096 and lce.chunk_rows(10, 50000) == 10


@pytest.mark.parametrize("device", DEVICES)
def test_a_target_out_of_range_makes_its_row_nan_not_a_wrong_number(device):
    z, target, scale, eps = rows_case(device, torch.float32, 1000, 0.0)
    target[0], target[3] = 1000, -7  # out of range; rows 2 and 5 stay ignored (-100)
    losses = cross_entropy_rows_(z, target, scale, -100, eps)
    assert losses[0].isnan() and losses[3].isnan() and z[0].isnan().all() and z[3].isnan().all()
    assert losses[2] == 0 and not z[2].any()  # ignored
    assert losses[[1, 4]].isfinite().all() and z[[1, 4]].isfinite().all()
    if device == "cpu":  # on CUDA, ATen's gather asserts on the device, poisoning the process
        with pytest.raises((RuntimeError, IndexError)):
            cross_entropy_rows_reference(z.clone(), target, scale, -100, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_holds_inside_what_the_memory_analysis_counts(dtype):
    rows, features, classes = 8192, 256, 32768  # two chunks of 4096 rows
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, features, device="cuda", generator=g).to(dtype)
    w = torch.randn(classes, features, device="cuda", generator=g).to(dtype)
    y = torch.randint(0, classes, (rows,), device="cuda", generator=g)
    torch.mm(x[:8], w[:8].t())  # this stream's cuBLAS workspace exists before the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outputs = torch.ops.sgraph.linear_cross_entropy(x, w, y, -100, 0.0, True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before

    def blocks(nbytes):
        return -(-nbytes // 512) * 512

    counted = sum(blocks(t.untyped_storage().nbytes()) for t in outputs)
    counted += sum(blocks(nbytes) for nbytes, _ in lce.scratch_bytes(x, w))
    assert counted <= peak <= counted + 2**20, (peak / 2**20, counted / 2**20)  # + per-row losses, scalars


def adamw_leaves(device, grad_dtypes, seed=0):
    """Leaves of odd sizes (a tail in each chunk, one chunk past 4096, a scalar) with
    grads in the given dtypes, cycled."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3,), (1000, 7), (5000,), (64, 65), (), (4096,)]
    params = [torch.randn(s, generator=g).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device, grad_dtypes[i % len(grad_dtypes)]) for i, s in enumerate(shapes)]
    mu = [(0.1 * torch.randn(s, generator=g)).to(device) for s in shapes]
    nu = [(0.1 * torch.rand(s, generator=g)).to(device) for s in shapes]
    return params, grads, mu, nu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtypes", [(torch.bfloat16,), (torch.bfloat16, torch.float32), (torch.float16,)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_lists_kernel_matches_atens_fused_adamw(device, grad_dtypes, weight_decay):
    # On the H200 a few elements differ from ATen's by up to 2.6e-7 (the two kernels
    # round the same arithmetic differently, fused multiply-adds and powers): within 1e-6,
    # against updates of about lr = 1e-2, by which a wrong update would be off.
    pytest.importorskip("triton")
    from sgraph._src.kernels.adamw_lists import adamw_lists_

    params, grads, mu, nu = adamw_leaves(device, grad_dtypes)
    expected = [[t.clone() for t in ts] for ts in (params, mu, nu)]
    step, lr = torch.tensor(3.0, device=device), torch.tensor(1e-2, device=device)
    for _ in range(2):  # a second step over the first one's moments
        torch._fused_adamw_(
            *expected[:1], [g.float() for g in grads], *expected[1:], [], [step] * len(params),
            lr=lr, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
        adamw_lists_(params, grads, mu, nu, step, lr, 0.9, 0.999, 1e-8, weight_decay)
        step += 1
    for actual, reference in zip((params, mu, nu), expected):
        for a, e in zip(actual, reference):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_lists_kernel_writes_out_of_place_as_in_place(device):
    """With ``out`` the kernel leaves its inputs alone and writes exactly what the
    in-place update writes (the new tensors allocated in the reverse order of the
    leaves, so their places from the first leaf's are negative)."""
    pytest.importorskip("triton")
    from sgraph._src.kernels.adamw_lists import adamw_lists_

    params, grads, mu, nu = adamw_leaves(device, (torch.bfloat16, torch.float32), seed=2)
    inputs = [[t.clone() for t in ts] for ts in (params, grads, mu, nu)]
    out = tuple([torch.empty_like(t) for t in reversed(ts)][::-1] for ts in (params, mu, nu))
    step, lr = torch.tensor(2.0, device=device), torch.tensor(1e-2, device=device)
    adamw_lists_(params, grads, mu, nu, step, lr, 0.9, 0.999, 1e-8, 0.1, out=out)
    for actual, before in zip((params, grads, mu, nu), inputs):
        for a, b in zip(actual, before):
            assert torch.equal(a, b)
    adamw_lists_(params, grads, mu, nu, step, lr, 0.9, 0.999, 1e-8, 0.1)
    for written, in_place in zip(out, (params, mu, nu)):
        for a, b in zip(written, in_place):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_the_functional_adamw_op_writes_new_tensors_without_copying_its_inputs(device, monkeypatch):
    """``sgraph::adamw`` (an update of inputs not donated) with bf16 grads: one launch
    of the own kernel per grad dtype, writing the new tensors (no clones updated in
    place); the inputs unchanged, the result ATen's fused AdamW's over fp32 grads."""
    pytest.importorskip("triton")
    from sgraph._src.kernels import adamw as op
    from sgraph._src.kernels import adamw_lists

    if device == "cpu":
        monkeypatch.setattr(adamw_lists, "runs_here", lambda *leaves: True)
    calls = []
    original = adamw_lists.adamw_lists_
    monkeypatch.setattr(adamw_lists, "adamw_lists_", lambda *a, **k: calls.append(k) or original(*a, **k))
    params, grads, mu, nu = adamw_leaves(device, (torch.bfloat16, torch.float32), seed=3)
    inputs = [[t.clone() for t in ts] for ts in (params, grads, mu, nu)]
    expected = [[t.clone() for t in ts] for ts in (params, mu, nu)]
    step, lr = torch.tensor(1.0, device=device), torch.tensor(1e-3, device=device)
    op.adamw_(expected[0], [g.float() for g in grads], expected[1], expected[2], step, lr, 0.9, 0.99, 1e-8, 0.01)
    calls.clear()
    new = op.adamw(params, grads, mu, nu, step, lr, 0.9, 0.99, 1e-8, 0.01)
    assert len(calls) == 1 and "out" in calls[0]
    for actual, before in zip((params, grads, mu, nu), inputs):
        for a, b in zip(actual, before):
            assert torch.equal(a, b)
    n = len(params)
    for actual, reference in zip((new[:n], new[n : 2 * n], new[2 * n :]), expected):
        for a, e in zip(actual, reference):
            assert a.stride() == e.stride()
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_adamw_op_takes_low_precision_grads(device):
    """``sgraph::adamw_`` with bf16 grads for fp32 params (what sg.fuse hands it): the
    own kernel on a GPU, ATen's after a cast elsewhere; the same result as fp32 grads."""
    from sgraph._src.kernels.adamw import adamw_

    params, grads, mu, nu = adamw_leaves(device, (torch.bfloat16, torch.float32), seed=1)
    # a transposed grad: paired into its param's layout first
    params.append(torch.randn(6, 5, device=device))
    grads.append(torch.randn(5, 6, device=device).to(torch.bfloat16).t())
    mu.append(torch.zeros(6, 5, device=device))
    nu.append(torch.zeros(6, 5, device=device))
    expected = [[t.clone() for t in ts] for ts in (params, mu, nu)]
    step, lr = torch.tensor(1.0, device=device), torch.tensor(1e-3, device=device)
    adamw_(expected[0], [g.float() for g in grads], expected[1], expected[2], step, lr, 0.9, 0.99, 1e-8, 0.01)
    adamw_(params, grads, mu, nu, step, lr, 0.9, 0.99, 1e-8, 0.01)
    for actual, reference in zip((params, mu, nu), expected):
        for a, e in zip(actual, reference):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(_INTERPRETER is not None, reason=str(_INTERPRETER))
def test_the_adamw_op_runs_the_own_kernel_on_leaves_in_any_layouts(monkeypatch):
    """The op's own-kernel path (a GPU's) run on CPU tensors in the interpreter: leaves
    in other layouts than their params are paired first (a transposed bf16 grad, a
    channels-last param, a strided view of a param, written back), grads of three dtypes
    in three launches; the same as ATen's kernel over fp32 grads."""
    from test_optim_layouts import channels_last, strided, transposed

    from sgraph._src.kernels import adamw as op
    from sgraph._src.kernels import adamw_lists

    launches = []
    monkeypatch.setattr(adamw_lists, "runs_here", lambda *leaves: True)
    original = adamw_lists.adamw_lists_
    monkeypatch.setattr(adamw_lists, "adamw_lists_", lambda *a: launches.append(a) or original(*a))
    g = torch.Generator().manual_seed(4)
    shapes = [(4, 3, 2, 5), (6, 5), (7, 8), (9,)]
    params = [channels_last(torch.randn(shapes[0], generator=g)), torch.randn(6, 5, generator=g)]
    params += [strided(torch.randn(7, 8, generator=g)), torch.randn(9, generator=g)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    grads = [transposed(grads[0]).bfloat16(), grads[1].half(), transposed(grads[2]).bfloat16(), grads[3]]
    mu = [torch.randn(s, generator=g) for s in shapes]
    nu = [torch.rand(s, generator=g) for s in shapes]
    expected = [[t.clone() for t in ts] for ts in (params, mu, nu)]
    step, lr = torch.tensor(2.0), torch.tensor(1e-2)
    op.adamw_(*expected[:1], [gr.float() for gr in grads], *expected[1:], step, lr, 0.9, 0.99, 1e-8, 0.1)
    assert not launches  # fp32 grads: ATen's kernel, each leaf paired as the op does
    views = [p.stride() for p in params]
    op.adamw_(params, grads, mu, nu, step, lr, 0.9, 0.99, 1e-8, 0.1)
    assert len(launches) == 1  # the own kernel's path (a launch per grad dtype inside)
    assert [p.stride() for p in params] == views
    for actual, reference in zip((params, mu, nu), expected):
        for a, e in zip(actual, reference):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- fake layouts


def _layout_cases():
    """Each own op with inputs in odd layouts (transposed, a strided slice), as
    ``(name, op, args)``."""
    from test_optim_layouts import channels_last, strided, transposed

    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 12, generator=g).t()  # [12, 16], transposed in memory
    head_t = torch.randn(16, 1100, generator=g).t()  # [1100, 16]: a [features, classes] head, as x @ E
    target = torch.randint(0, 1100, (12,), generator=g)
    w1 = torch.randn(16, 24, generator=g).t()  # [24, 16]
    b1 = torch.randn(24, generator=g)
    w2 = torch.randn(16, 24, generator=g)
    pre = torch.randn(24, 12, generator=g).t()  # [12, 24]
    grad = torch.randn(16, 12, generator=g).t()  # [12, 16]
    shapes = [(4, 3, 2, 5), (7, 8), (6, 5)]
    params = [channels_last(torch.randn(shapes[0], generator=g)), strided(torch.randn(7, 8, generator=g))]
    params.append(transposed(torch.randn(6, 5, generator=g)))
    grads = [torch.randn(s, generator=g) for s in shapes]
    mu = [transposed(torch.randn(s, generator=g)) if len(s) == 2 else torch.randn(s, generator=g) for s in shapes]
    nu = [torch.rand(s, generator=g) for s in shapes]
    adam = (params, grads, mu, nu, torch.tensor(2.0), torch.tensor(1e-2), 0.9, 0.99, 1e-8, 0.1)
    ops = torch.ops.sgraph
    return [
        ("linear_cross_entropy, transposed weight", ops.linear_cross_entropy, (x, head_t, target, -100, 0.0, True)),
        (
            "linear_cross_entropy, dense weight",
            ops.linear_cross_entropy,
            (x.contiguous(), head_t.contiguous(), target, -100, 0.1, False),
        ),
        ("gelu_linear", ops.gelu_linear, (x, w1, b1)),
        ("gelu_linear_backward", ops.gelu_linear_backward, (grad, w2, pre)),
        ("adamw", ops.adamw, adam),
    ]


def _tensors(out):
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", range(5))
def test_each_own_op_returns_the_layouts_its_fake_says(case, device):
    """Inductor lays out the code around an own op by what its fake implementation
    returns; a real output in another layout is read wrongly (``x @ E`` with a
    ``[features, classes]`` head gave a wrong gradient through the fused loss)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sgraph._src.kernels  # noqa: F401 - registers the ops

    name, op, args = _layout_cases()[case]
    args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), args)
    real = _tensors(op(*args))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        fake = _tensors(op(*fake_args))
    assert len(real) == len(fake), name
    for i, (r, f) in enumerate(zip(real, fake)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), f"{name}: output {i}"
