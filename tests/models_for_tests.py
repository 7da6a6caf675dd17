"""Tiny models and reference loops shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import GPT, GPTConfig, RMSNorm, gpt_loss, mlp  # noqa: E402

import sgraph as sg  # noqa: E402

__all__ = [
    "GPT",
    "GPTConfig",
    "RMSNorm",
    "SMALL_GPT",
    "bf16_gpt_steps",
    "cuda_bf16_autocast",
    "gpt_loss",
    "mlp",
    "small_model_and_batches",
    "tiny_gpt",
    "make_train_step",
    "run_steps",
    "torch_adamw_losses",
    "train_step_fn",
]

TINY_GPT = GPTConfig(vocab=64, d=32, layers=2, heads=2, seq=16)
SMALL_GPT = GPTConfig(vocab=512, d=128, layers=2, heads=4, seq=64)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY_GPT)


def small_model_and_batches(kind, n=8, device="cuda"):
    """The GPU tests' ``"mlp"`` or ``"gpt"`` (``SMALL_GPT``) model, ``n`` random batches and the loss.

    As many batches as steps: a loss driven towards zero by memorizing a few batches would
    make relative comparisons meaningless.
    """
    torch.manual_seed(0)
    if kind == "mlp":
        model = mlp(256, 3, 10).to(device)
        batches = [(torch.randn(32, 256, device=device), torch.randint(0, 10, (32,), device=device)) for _ in range(n)]
        return model, batches, F.cross_entropy
    model = GPT(SMALL_GPT).to(device)
    batches = [
        (torch.randint(0, 512, (4, 64), device=device), torch.randint(0, 512, (4, 64), device=device)) for _ in range(n)
    ]
    return model, batches, gpt_loss


def cuda_bf16_autocast(enabled):
    """For ``train_step_fn(autocast=...)``: ``torch.autocast`` to bfloat16 on CUDA, switched on or off."""
    return functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=enabled)


def bf16_gpt_steps(n):
    """The GPU tests' GPT under bf16 autocast, for comparing ``sg.static(sg.fuse(...))`` with eager:
    the model, ``n`` batches, cloned params, an AdamW, the plain train step and that step
    fused and captured, params and optimizer state donated."""
    model, batches, loss = small_model_and_batches("gpt", n)
    apply, params, _ = sg.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = sg.optim.adamw(1e-3, weight_decay=0.01)
    plain = train_step_fn(apply, loss, opt, autocast=cuda_bf16_autocast(True))
    return model, batches, params, opt, plain, sg.static(sg.fuse(plain), donate=("params", "opt_state"))


def train_step_fn(apply, loss, opt, *, autocast=contextlib.nullcontext):
    """The README's train step, untransformed, for a model applied as ``apply(params, {}, x)``.

    The forward and the loss run in a fresh ``autocast()`` context each call.
    """

    def loss_fn(params, batch):
        x, y = batch
        with autocast():
            return loss(apply(params, {}, x), y)

    def train_step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    return train_step


def make_train_step(apply, loss, opt, *, autocast=contextlib.nullcontext, **static_options):
    """The README's train step under ``sg.static``."""
    return sg.static(train_step_fn(apply, loss, opt, autocast=autocast), **static_options)


def run_steps(step, params, opt_state, batches):
    """Run ``step`` on copies of ``params`` and ``opt_state``; each call's loss and params."""
    params = {k: v.clone() for k, v in params.items()}
    opt_state = sg.tree.map(torch.clone, opt_state)
    out = []
    for batch in batches:
        params, opt_state, metrics = step(params, opt_state, batch)
        out.append((metrics["loss"].clone(), {k: v.clone() for k, v in params.items()}))
    return out


def torch_adamw_losses(model: nn.Module, batches, loss, lr=1e-3, weight_decay=0.01):
    """The plain PyTorch loop: eager model, ``torch.optim.AdamW``; returns losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.detach())
    return losses


def classification_batches(n, batch, width, classes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, width, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)
    ]


def token_batches(n, batch, cfg=TINY_GPT, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g),
            torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g),
        )
        for _ in range(n)
    ]


cross_entropy = F.cross_entropy
