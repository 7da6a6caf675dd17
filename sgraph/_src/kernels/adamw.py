"""AdamW over whole lists of tensors in one fused kernel, as two custom ops.

``sgraph::adamw`` is the functional form the optimizer calls: it returns new params
and moments and leaves its inputs alone, so a traced step stays functional.
``sgraph::adamw_`` updates params and moments in place; the reinplace pass swaps it
in when those inputs are donated, so the whole update is one pass over memory.
Both run ATen's fused AdamW kernel (``torch._fused_adamw_``), on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["INPLACE_FORMS", "adamw", "adamw_", "fusable", "written_lists"]

_DTYPES = (torch.float32,)


def fusable(tensors: list[Tensor]) -> bool:
    """Whether the fused path suits these leaves: float32 tensors on one CPU or CUDA
    device. Low-precision params keep the foreach path: an update returned as
    ``new_p - p`` in bf16 would lose what the fused kernel gained. DTensors keep it too."""
    if not tensors:
        return False
    device = tensors[0].device
    return device.type in ("cpu", "cuda") and all(
        t.device == device and t.dtype in _DTYPES and type(t).__name__ != "DTensor" for t in tensors
    )


@torch.library.custom_op("sgraph::adamw_", mutates_args=("params", "mu", "nu"))
def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    step: Tensor,
    lr: Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place. ``step`` is the update number t (1, 2, ...), ``lr``
    a 0-dim tensor; both may change between calls without recompiling."""
    steps = [step.to(torch.float32)] * len(params)
    torch._fused_adamw_(
        params,
        grads,
        mu,
        nu,
        [],
        steps,
        lr=lr.to(params[0].device, torch.float32),
        beta1=b1,
        beta2=b2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


@torch.library.custom_op("sgraph::adamw", mutates_args=())
def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    step: Tensor,
    lr: Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> list[Tensor]:
    """The functional AdamW update: returns ``new_params + new_mu + new_nu`` as one list."""
    p, m, v = ([t.clone() for t in ts] for ts in (params, mu, nu))
    adamw_(p, grads, m, v, step, lr, b1, b2, eps, weight_decay)
    return p + m + v


@adamw.register_fake
def _(params, grads, mu, nu, step, lr, b1, b2, eps, weight_decay):  # type: ignore[no-untyped-def]
    return [torch.empty_like(t) for t in (*params, *mu, *nu)]


INPLACE_FORMS = {torch.ops.sgraph.adamw.default: torch.ops.sgraph.adamw_.default}
"""Functional op -> in-place op, for the reinplace pass."""


def written_lists(args: tuple) -> list:
    """The tensors ``sgraph::adamw_`` writes, in the order ``sgraph::adamw`` returns them."""
    params, _, mu, nu = args[:4]
    return [*params, *mu, *nu]
