"""sg.fuse on model shapes other than the benchmarks' GPT and MLP, against eager (CPU, fp32).

A Llama-style decoder (RMSNorm written out, rotary embeddings from buffers, a SwiGLU
MLP, no biases, the head tied to the embedding) and a small CNN whose BatchNorm
layers update their running statistics. Each runs four donated steps under
``sg.static(sg.fuse(step))`` next to the same step run eagerly, fed back call after
call; losses, params, optimizer state and buffers must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import RMSNorm

import sgraph as sg

pytestmark = pytest.mark.slow  # compiles with Inductor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs of the last dimension."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        half = d // heads
        angles = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, half, 2).float() / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(kind: str, device: str, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "decoder":
        made = [
            (torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(n)
        ]
    else:
        made = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]
    return [(x.to(device), y.to(device)) for x, y in made]


def make_step(apply, loss, opt):  # type: ignore[no-untyped-def]
    def loss_fn(params, buffers, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        if apply.return_buffers:
            out, buffers = apply(params, buffers, x)
        else:
            out = apply(params, buffers, x)
        return loss(out, y), buffers

    def step(params, buffers, opt_state, batch):  # type: ignore[no-untyped-def]
        (value, buffers), grads = sg.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), buffers, opt_state, {"loss": value}

    return step


def _cuda(kind: str) -> object:
    return pytest.param(
        (kind, "cuda"),
        id=f"{kind}-cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    )


CASES = [
    pytest.param(("decoder", "cpu"), id="decoder"),
    pytest.param(("convnet", "cpu"), id="convnet"),
    _cuda("decoder"),
    _cuda("convnet"),
]


@pytest.fixture(scope="module", params=CASES)
def run(request):  # type: ignore[no-untyped-def]
    """Four donated steps of the model under sg.static(sg.fuse) and the same four eagerly
    (on a GPU: in a CUDA graph, fp32 matmuls without TF32)."""
    kind, device = request.param
    torch.manual_seed(0)
    model, loss = (Decoder(), token_loss) if kind == "decoder" else (ConvNet(), F.cross_entropy)
    model.to(device)
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(1e-2, weight_decay=0.01)
    step = make_step(apply, loss, opt)
    fused = sg.static(sg.fuse(step), donate=("params", "buffers", "opt_state"))
    mine = [sg.tree.map(torch.clone, params), sg.tree.map(torch.clone, buffers)]
    mine.append(opt.init(mine[0]))
    ref = [sg.tree.map(torch.clone, params), sg.tree.map(torch.clone, buffers)]
    ref.append(opt.init(ref[0]))
    calls = []
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for batch in batches(kind, device):
            *mine, metrics = fused(*mine, batch)
            *ref, ref_metrics = step(*ref, batch)
            calls.append((metrics["loss"], ref_metrics["loss"]))
    return {"kind": kind, "device": device, "model": model, "fused": fused, "mine": mine, "ref": ref, "calls": calls}


def test_losses_match_eager_over_four_steps(run):
    for call, (got, want) in enumerate(run["calls"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=f"call {call}")


def test_params_state_and_buffers_match_eager(run):
    (params, buffers, state), (ref_params, ref_buffers, ref_state) = run["mine"], run["ref"]
    for name, (got, want) in {"params": (params, ref_params), "mu": (state.mu, ref_state.mu)}.items():
        assert got.keys() == want.keys()
        for k in got:
            scale = want[k].abs().max().item()
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4 * max(scale, 1e-3), msg=f"{name}[{k!r}]")
    assert buffers.keys() == ref_buffers.keys()
    for k in buffers:
        torch.testing.assert_close(buffers[k], ref_buffers[k], rtol=1e-5, atol=1e-6, msg=f"buffers[{k!r}]")
    assert int(state.count) == int(ref_state.count) == 4


def test_the_step_was_compiled_once_and_fused(run):
    fused = run["fused"]
    assert fused.trace_count == 1
    stats = fused.last_compiled.stats
    assert stats.runtime == ("inductor+cudagraph" if run["device"] == "cuda" else "inductor")
    assert stats.calls == 4
    assert 0 < stats.kernels_fused < stats.kernels_unfused, stats


def test_the_model_itself_is_untouched(run):
    """The module's own tensors are not the donated ones: nothing of the user's changed."""
    model = run["model"]
    torch.manual_seed(0)
    fresh = Decoder() if run["kind"] == "decoder" else ConvNet()
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, msg=name)


def test_each_parameter_is_one_leaf(run):
    """A tied tensor is named once (the decoder's head is its embedding); the parity
    test above then checks that both uses reach its gradient."""
    model, params = run["model"], run["mine"][0]
    assert set(params) == {name for name, _ in model.named_parameters()}
    if run["kind"] == "decoder":
        assert "head.weight" not in params and "embed.weight" in params
