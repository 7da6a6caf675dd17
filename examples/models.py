"""The models of the examples, tests and benchmark: an MLP, a small GPT, a Llama-style
decoder and a small ResNet.

Sizes default to the benchmark workloads: ``mlp-small``, ``gpt-mini`` and ``gpt-med`` of
PERFORMANCE-ANCHORS, and two models of other shapes, ``llama-mini`` and ``resnet-small``
(see benchmark.py); tests build tiny ones with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(width: int = 1024, depth: int = 4, classes: int = 10) -> nn.Sequential:
    """``depth`` x [Linear(width, width) + GELU], then Linear(width, classes)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    d: int = 512
    layers: int = 6
    heads: int = 8
    seq: int = 256


class Block(nn.Module):
    """Pre-LN transformer block: fused qkv, causal SDPA, tanh-GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, untied head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on logits cast to fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


@dataclass(frozen=True)
class LlamaConfig(GPTConfig):
    hidden: int = 1408  # the SwiGLU width: about 8/3 d, a multiple of 64


class RMSNorm(nn.Module):
    """Root-mean-square norm, written out as research code does."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, bias-free q / k / v / o with rotary embeddings, causal SDPA, SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = RMSNorm(cfg.d), RMSNorm(cfg.d)
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d, cfg.d, bias=False) for _ in range(4))
        self.gate = nn.Linear(cfg.d, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Token embeddings, rotary tables as buffers (not saved), Llama blocks, final RMSNorm, untied head."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        dim = cfg.d // cfg.heads
        inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        angles = torch.outer(torch.arange(cfg.seq).float(), inverse).repeat(1, 2)  # [seq, dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        t = idx.shape[1]
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.head(self.norm(x))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, a projected shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(width: int = 64, stages: tuple[int, ...] = (2, 2, 2), classes: int = 10) -> nn.Sequential:
    """A CIFAR-style ResNet: a 3x3 stem, ``stages`` of basic blocks (the width doubling
    and the image halving from the second on), global average pooling, a linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, count in enumerate(stages):
        cout = width * 2**i
        for j in range(count):
            layers.append(BasicBlock(cin, cout, 2 if i and not j else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)
