"""sg.fuse runs 2-D convolutions channels-last, forward and backward, without changing
what the user sees: values as eagerly, weight gradients and outputs in their layouts."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sgraph as sg

aten = torch.ops.aten
CONVS = (aten.convolution.default, aten.convolution_backward.default)


class Net(nn.Module):
    """Three convolutions up to 96 channels (not all small: Inductor's layout rule picks
    channels-last), BatchNorm, a residual, a head; ``groups`` for the last convolution."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 96, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(96)
        self.conv3 = nn.Conv2d(96, 96, 3, padding=1, bias=False, groups=groups)
        self.bn3 = nn.BatchNorm2d(96)
        self.fc = nn.Linear(96, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        features = F.relu(x + self.bn3(self.conv3(x)))
        return self.fc(features.mean((2, 3))), features


def make(groups: int = 1, device: str = "cpu", autocast: bool = False, adam: bool = True):  # type: ignore[no-untyped-def]
    """The step (returning the last block's feature map as a metric), its state, and four
    batches. With ``adam=False`` the update is SGD with momentum, whose params follow
    their gradients' rounding linearly (Adam's first steps move a param whose gradient is
    rounding noise by +-lr: no test of a few ulps)."""
    torch.manual_seed(0)
    model = Net(groups).to(device)
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(1e-2, weight_decay=0.01) if adam else sg.optim.sgd(0.05, momentum=0.9)
    cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def loss_fn(params, buffers, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        with cast():
            (logits, features), buffers = apply(params, buffers, x)
        return F.cross_entropy(logits.float(), y), (buffers, features)

    def step(params, buffers, opt_state, batch):  # type: ignore[no-untyped-def]
        (value, (buffers, features)), grads = sg.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), buffers, opt_state, {"loss": value, "features": features}

    g = torch.Generator().manual_seed(1)
    n = 8 if device == "cpu" else 32
    batches = [
        (torch.randn(n, 3, 8, 8, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device))
        for _ in range(4)
    ]
    return step, [params, buffers, opt.init(params)], batches


def clone(state):  # type: ignore[no-untyped-def]
    return [sg.tree.map(torch.clone, s) for s in state]


def conv_args(program) -> list[bool]:  # type: ignore[no-untyped-def]
    """Per convolution (forward and backward) in the program: its tensors' layouts, True
    where channels-last."""
    return [
        a.meta["val"].is_contiguous(memory_format=torch.channels_last)
        for n in program.graph.nodes
        if n.target in CONVS
        for a in n.args[: 2 if n.target is CONVS[0] else 3]
        if isinstance(a, torch.fx.Node)
    ]


def lowered(step, state, batch, **options):  # type: ignore[no-untyped-def]
    return sg.fuse(**options)(step).lower(*state, batch).program


def test_every_convolution_reads_channels_last_tensors_forward_and_backward():
    step, state, batches = make()
    with torch.backends.mkldnn.flags(enabled=False):  # Inductor's GPU rule, not its CPU one
        program = lowered(step, state, batches[0])
    assert "channels_last" in program.passes
    layouts = conv_args(program)
    assert len(layouts) == 3 * 2 + 3 * 3 and all(layouts)


def test_off_keeps_the_traced_layouts():
    step, state, batches = make()
    program = lowered(step, state, batches[0], channels_last=False)
    assert "channels_last" not in program.passes
    assert not all(conv_args(program))


def test_grouped_convolutions_keep_the_traced_layouts():
    """Inductor's rule: channels-last slows grouped convolutions down; the pass follows it."""
    step, state, batches = make(groups=2)
    with torch.backends.mkldnn.flags(enabled=False):
        program = lowered(step, state, batches[0])
    assert "channels_last" not in program.passes


def outputs(program) -> list:  # type: ignore[no-untyped-def]
    return [v.meta["val"] for v in program.graph.find_nodes(op="output")[0].args[0] if isinstance(v, torch.fx.Node)]


def test_the_update_reads_each_gradient_in_its_params_layout_and_outputs_keep_theirs():
    step, state, batches = make()
    with torch.backends.mkldnn.flags(enabled=False):
        traced = sg.fuse(step).trace(*state, batches[0]).program
        program = lowered(step, state, batches[0])
    assert "channels_last" in program.passes
    adamw = (torch.ops.sgraph.adamw.default, torch.ops.sgraph.adamw_.default)
    updates = [n for n in program.graph.nodes if n.target in adamw]
    assert updates
    for update in updates:
        for param, grad in zip(update.args[0], update.args[1]):
            assert grad.meta["val"].stride() == param.meta["val"].stride(), (param, grad)
    before, after = outputs(traced), outputs(program)
    assert [v.shape for v in before] == [v.shape for v in after]
    assert [v.stride() for v in before] == [v.stride() for v in after]


@pytest.fixture(scope="module")
def cpu_run():
    """Four donated steps under sg.fuse against the same four eagerly (CPU)."""
    step, state, batches = make(adam=False)
    fused = sg.fuse(step)
    mine, ref, calls = clone(state), clone(state), []
    addresses = [t.data_ptr() for t in sg.tree.leaves(mine[0])]
    for batch in batches:
        *mine, metrics = fused(*mine, batch)
        *ref, ref_metrics = step(*ref, batch)
        calls.append((metrics, ref_metrics))
    return {"fused": fused, "mine": mine, "ref": ref, "calls": calls, "addresses": addresses}


def test_losses_params_and_statistics_match_eager_over_four_steps(cpu_run):
    assert "channels_last" in cpu_run["fused"].last_compiled.program.passes
    for metrics, ref in cpu_run["calls"]:
        torch.testing.assert_close(metrics["loss"], ref["loss"], rtol=1e-5, atol=0)
        scale = float(ref["features"].abs().max())
        torch.testing.assert_close(metrics["features"], ref["features"], rtol=0, atol=1e-5 * scale)
    for mine, ref in zip(sg.tree.leaves(cpu_run["mine"]), sg.tree.leaves(cpu_run["ref"])):
        scale = float(ref.abs().max()) if ref.is_floating_point() else 1.0
        torch.testing.assert_close(mine.float(), ref.float(), rtol=0, atol=1e-5 * max(scale, 1e-3))


def test_returned_tensors_have_the_layouts_eager_gives_them(cpu_run):
    for metrics, ref in cpu_run["calls"]:
        assert metrics["features"].stride() == ref["features"].stride()
    for mine, ref in zip(sg.tree.leaves(cpu_run["mine"]), sg.tree.leaves(cpu_run["ref"])):
        assert mine.stride() == ref.stride()
    assert cpu_run["fused"].last_compiled.stats.traces == 1


def test_a_batch_already_channels_last_is_not_copied_and_its_feature_map_stays_channels_last():
    """The user's own channels-last batch: nothing copies it into the layout it has, and
    the feature map comes back channels-last, as eagerly."""
    step, state, batches = make()
    x, y = batches[0]
    batch = (x.contiguous(memory_format=torch.channels_last), y)
    with torch.backends.mkldnn.flags(enabled=False):
        program = lowered(step, state, batch)
    assert "channels_last" in program.passes
    image = next(n for n in program.graph.nodes if n.op == "placeholder" and n.meta["val"].shape == x.shape)
    assert not any(u.target is aten.clone.default for u in image.users)
    features = step(*clone(state), batch)[-1]["features"]
    assert features.is_contiguous(memory_format=torch.channels_last)
    assert any(v.shape == features.shape and v.stride() == features.stride() for v in outputs(program))


def _other_model(kind: str) -> nn.Module:
    layers: dict[str, list[nn.Module]] = {
        # a transposed convolution after a plain one
        "transposed": [nn.Conv2d(3, 96, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(96, 80, 2, stride=2, bias=False)],
        # a reshape between two convolutions: the second one's input is copied again
        "reshaped": [nn.Conv2d(3, 96, 3, padding=1), nn.ReLU(), nn.Unflatten(1, (96, 1)), nn.Flatten(1, 2)],
        # BatchNorm in eval mode (its running statistics only read)
        "eval-batchnorm": [nn.Conv2d(3, 96, 3, padding=1, bias=False), nn.BatchNorm2d(96).eval(), nn.ReLU()],
        # the feature map flattened into a linear layer: a view of a channels-last tensor
        "flattened": [nn.Conv2d(3, 96, 3, padding=1), nn.ReLU()],
    }[kind]
    channels = 80 if kind == "transposed" else 96
    head = [nn.Conv2d(channels, 96, 3, bias=False), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 10)]
    if kind == "flattened":
        head = [nn.Conv2d(96, 96, 3, bias=False), nn.BatchNorm2d(96), nn.ReLU(), nn.Flatten(), nn.Linear(96 * 36, 10)]
    return nn.Sequential(*layers, *head)


@pytest.mark.parametrize("kind", ["transposed", "reshaped", "eval-batchnorm", "flattened", "planned"])
def test_other_convolution_steps_match_eager_over_three_steps(kind):
    """Steps the pass rewrites differently: each against the same step run eagerly."""
    torch.manual_seed(0)
    model = _other_model("reshaped" if kind == "planned" else kind)
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.sgd(0.05, momentum=0.9)

    def loss_fn(params, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        out = apply(params, buffers, x)
        return F.cross_entropy(out[0] if apply.return_buffers else out, y)

    def step(params, opt_state, batch):  # type: ignore[no-untyped-def]
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    fused = sg.fuse(step)
    if kind == "planned":
        fused = sg.plan_memory(budget=1 << 40)(fused)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
    with torch.backends.mkldnn.flags(enabled=False):  # Inductor's GPU rule, not its CPU one
        mine, ref = clone([params, opt.init(params)]), clone([params, opt.init(params)])
        for _ in range(3):
            *mine, metrics = fused(*mine, batch)
            *ref, ref_metrics = step(*ref, batch)
            torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=0)
    assert "channels_last" in fused.last_compiled.program.passes
    assert all(conv_args(fused.last_compiled.program))
    for p, q in zip(sg.tree.leaves(mine), sg.tree.leaves(ref)):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5 * max(float(q.abs().max()), 1e-3))
        assert p.stride() == q.stride()


def test_channels_last_must_be_a_bool_and_shows_in_the_repr_when_off():
    with pytest.raises(sg.ArgumentTypeError, match=r"channels_last must be True or False; found 'yes'"):
        sg.fuse(channels_last="yes")(lambda x: x)
    assert "channels_last=False" in repr(sg.static(sg.fuse(channels_last=False)(lambda x: x)))
    assert "channels_last=" not in repr(sg.fuse(lambda x: x))


def _transposes(fn, state, batch) -> int:  # type: ignore[no-untyped-def]
    """cuDNN's layout transposes in one replay of the captured step (``state``: what the
    step returned last, passed back as it must be for a replay)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        *state, _ = fn(*state, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*state, batch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum("nchwToNhwc" in n or "nhwcToNchw" in n for n in names)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_cudnn_transposes_nothing_and_bf16_losses_match_eager():
    step, state, batches = make(device="cuda", autocast=True)
    names = ("params", "buffers", "opt_state")
    on = sg.static(sg.fuse(step), donate=names)
    mine, ref = clone(state), clone(state)
    for batch in batches:
        *mine, metrics = on(*mine, batch)
        *ref, ref_metrics = step(*ref, batch)
        torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=1e-2, atol=0)
        assert metrics["features"].stride() == ref_metrics["features"].stride()
    for p, q in zip(sg.tree.leaves(mine[0]), sg.tree.leaves(ref[0])):
        assert p.stride() == q.stride()
    off = sg.static(sg.fuse(channels_last=False)(step), donate=names)
    with_pass, without = _transposes(on, mine, batches[0]), _transposes(off, clone(state), batches[0])
    print(f"cuDNN layout transposes per step: {with_pass} with the pass, {without} without")
    assert without >= 6 and with_pass == 0, (with_pass, without)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_fp32_losses_match_eager_over_four_steps():
    step, state, batches = make(device="cuda")
    fused = sg.static(sg.fuse(step), donate=("params", "buffers", "opt_state"))
    mine, ref = clone(state), clone(state)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for batch in batches:
            *mine, metrics = fused(*mine, batch)
            *ref, ref_metrics = step(*ref, batch)
            torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=1e-4, atol=0)
    assert "channels_last" in fused.last_compiled.program.passes
