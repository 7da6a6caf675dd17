"""Adam and AdamW, with PyTorch's formulas and order of operations.

Per leaf, for update number ``t = count + 1`` (PyTorch's single-tensor path):

    mu    = lerp(mu, g, 1 - b1)
    nu    = nu * b2 + (1 - b2) * g * g
    denom = sqrt(nu) / sqrt(1 - b2**t) + eps
    new_p = p * (1 - lr * weight_decay)                 # adamw only
    new_p = new_p + (-(lr / (1 - b1**t)) * mu) / denom

and the update is ``new_p - p``, so ``p + update`` equals ``new_p`` wherever ``new_p``
is within a factor of two of ``p`` (the subtraction is exact). Float32 leaves on one
CPU or CUDA device compute ``new_p`` with ATen's fused multi-tensor AdamW kernel
(``sgraph::adamw``), other leaves with the foreach ops above; both stay within the
tolerances ``tests/test_optim.py`` checks against ``torch.optim`` (1e-6 relative after
100 steps in fp32). Any memory layouts of params, grads and moments give the same
values: the kernel copies a leaf whose tensors differ in layout into its param's
(``tests/test_optim_layouts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import tree
from ..kernels.adamw import adamw as fused_adamw
from ..kernels.adamw import fusable
from ..tags import mark_foldable
from . import _checks, _scalars
from ._base import GradientTransformation, PyTree, zeros_tree
from ._repr import state_html, state_repr
from ._scalars import Tensors
from ._schedules import Schedule

__all__ = ["ScaleByAdamState", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`.

    Attributes:
        count: 0-dim int64 tensor, the number of updates applied so far.
        mu: first moments, a tree like the params (each leaf in its param's dtype).
        nu: second moments, a tree like the params.
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: PyTree
    nu: PyTree

    def __repr__(self) -> str:
        return state_repr(self)

    def _repr_html_(self) -> str:
        return state_html(self)


@dataclass(frozen=True)
class _Adam:
    api: str
    lr: float | Schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float


def _config(api: str, lr: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any) -> _Adam:
    return _Adam(
        api=api,
        lr=_checks.check_learning_rate(api, lr),
        b1=_checks.check_beta(api, "b1", b1),
        b2=_checks.check_beta(api, "b2", b2),
        eps=_checks.check_nonnegative(api, "eps", eps),
        weight_decay=_checks.check_nonnegative(api, "weight_decay", weight_decay),
    )


def _init(cfg: _Adam, params: PyTree) -> ScaleByAdamState:
    leaves, spec = _checks.tensor_leaves(cfg.api, params)
    return ScaleByAdamState(_scalars.init_count(leaves), zeros_tree(leaves, spec), zeros_tree(leaves, spec))


def _moments(cfg: _Adam, g: Tensors, mu: Tensors, nu: Tensors) -> tuple[Tensors, Tensors]:
    mu = _scalars.lerp(mu, g, 1.0 - cfg.b1)
    nu = torch._foreach_addcmul(torch._foreach_mul(nu, cfg.b2), g, g, value=1.0 - cfg.b2)
    return mu, nu


def _direction(cfg: _Adam, mu: Tensors, nu: Tensors, lr: _scalars.Scalar, count: torch.Tensor) -> Tensors:
    """``(-step_size * mu) / denom``: the bias-corrected Adam step, as PyTorch's ``addcdiv``."""
    t = _scalars.step_number(count)
    neg_step_size = -(lr / _scalars.bias_correction(cfg.b1, t))
    bc2_sqrt = _scalars.bias_correction(cfg.b2, t).sqrt()
    root = torch._foreach_div(torch._foreach_sqrt(nu), _scalars.like(bc2_sqrt, nu[0]))
    denom = torch._foreach_add(root, cfg.eps)
    return torch._foreach_div(torch._foreach_mul(mu, _scalars.like(neg_step_size, mu[0])), denom)


def _decayed(cfg: _Adam, p: Tensors, step: Tensors, lr: _scalars.Scalar) -> Tensors:
    """``p * (1 - lr * wd) + step - p``: decoupled decay folded into the update."""
    keep = _scalars.like(1.0 - lr * cfg.weight_decay, p[0])
    return mark_foldable(torch._foreach_sub(torch._foreach_add(torch._foreach_mul(p, keep), step), p))


def _fused(
    cfg: _Adam, p: Tensors, g: Tensors, mu: Tensors, nu: Tensors, lr: _scalars.Scalar, count: torch.Tensor
) -> tuple[Tensors, Tensors, Tensors]:
    """The same update through one fused multi-tensor kernel (``sgraph::adamw``).

    It returns the new params; the update is ``new_p - p``, which ``apply_updates``
    adds back (exactly, when ``new_p`` is within a factor of two of ``p``; a compiled
    step folds ``p + (new_p - p)`` to ``new_p``).
    """
    lr_tensor = _scalars.as_tensor(lr, torch.float32, count.device)
    out = fused_adamw(
        list(p), list(g), list(mu), list(nu), count + 1, lr_tensor, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    )
    n = len(p)
    return mark_foldable(torch._foreach_sub(out[:n], list(p))), out[n : 2 * n], out[2 * n :]


def _decay_params(cfg: _Adam, grads: PyTree, params: PyTree | None) -> Tensors | None:
    if not cfg.weight_decay:
        return None
    return _checks.required_params(cfg.api, params, grads, reason=f"weight_decay={cfg.weight_decay}")


def _update(
    cfg: _Adam, grads: PyTree, state: ScaleByAdamState, params: PyTree | None
) -> tuple[PyTree, ScaleByAdamState]:
    _checks.check_state(cfg.api, state, ScaleByAdamState)
    g = _checks.matching_leaves(cfg.api, state.mu, grads, name="grads")
    p = _decay_params(cfg, grads, params)
    if not g:
        return grads, state._replace(count=state.count + 1)
    lr = _scalars.learning_rate(cfg.lr, state.count)
    p_all = (
        p
        if p is not None
        else (None if params is None else _checks.matching_leaves(cfg.api, grads, params, name="params"))
    )
    mu: Tensors = tree.leaves(state.mu)
    nu: Tensors = tree.leaves(state.nu)
    if p_all is not None and fusable([*p_all, *g, *mu, *nu]):
        updates, mu, nu = _fused(cfg, p_all, g, mu, nu, lr, state.count)
    else:
        mu, nu = _moments(cfg, g, mu, nu)
        updates = _direction(cfg, mu, nu, lr, state.count)
        if p is not None:
            updates = _decayed(cfg, p, updates, lr)
    spec = tree.structure(grads)
    new_state = ScaleByAdamState(state.count + 1, tree.unflatten(spec, mu), tree.unflatten(spec, nu))
    return tree.unflatten(spec, _scalars.dtypes_of(updates, g)), new_state


def _transform(cfg: _Adam) -> GradientTransformation:
    def init(params: PyTree, /) -> ScaleByAdamState:
        return _init(cfg, params)

    def update(grads: PyTree, state: ScaleByAdamState, params: PyTree | None = None) -> tuple[PyTree, ScaleByAdamState]:
        return _update(cfg, grads, state, params)

    return GradientTransformation(init, update)


def adam(lr: float | Schedule, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` (no weight decay, no amsgrad).

    Args:
        lr: learning rate, a float ``>= 0`` or a :class:`Schedule` of the count.
        b1: decay of the first moment, in ``[0, 1)``.
        b2: decay of the second moment, in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``.

    Returns:
        A :class:`GradientTransformation` with :class:`ScaleByAdamState`.

    Example:
        >>> opt = sg.optim.adam(1e-3, b2=0.95)
    """
    return _transform(_config("sg.optim.adam", lr, b1, b2, eps, 0.0))


def adamw(
    lr: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """AdamW, as ``torch.optim.AdamW``: Adam plus decoupled decay ``p * (1 - lr * weight_decay)``.

    Args:
        lr: learning rate, a float ``>= 0`` or a :class:`Schedule` of the count.
        b1: decay of the first moment, in ``[0, 1)``.
        b2: decay of the second moment, in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``.
        weight_decay: decoupled decay rate, ``>= 0``; when nonzero, ``update`` needs ``params``.

    Returns:
        A :class:`GradientTransformation` with :class:`ScaleByAdamState`.

    Example:
        >>> opt = sg.optim.adamw(sg.optim.warmup_cosine(3e-4, 100, 10_000), weight_decay=0.1)
        >>> updates, state = opt.update(grads, opt.init(params), params)
    """
    return _transform(_config("sg.optim.adamw", lr, b1, b2, eps, weight_decay))
