"""The models of the examples, tests and benchmark: an MLP and a small GPT.

Sizes default to the benchmark workloads of PERFORMANCE-ANCHORS (``mlp-small``,
``gpt-mini``, ``gpt-med``); tests build tiny ones with the same code.
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
