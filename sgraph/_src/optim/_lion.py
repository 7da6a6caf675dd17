"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as optax.

Per leaf:

    update = -lr * (sign(b1 * mu + (1 - b1) * g) + weight_decay * p)
    mu     = b2 * mu + (1 - b2) * g

Both interpolations are computed with ``lerp`` (one rounding, one kernel each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import tree
from . import _checks, _scalars
from ._base import GradientTransformation, PyTree, zeros_tree
from ._repr import state_html, state_repr
from ._scalars import Tensors
from ._schedules import Schedule

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    """State of :func:`lion`.

    Attributes:
        count: 0-dim int64 tensor, the number of updates applied so far.
        mu: the momentum, a tree like the params (each leaf in its param's dtype).
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: PyTree

    def __repr__(self) -> str:
        return state_repr(self)

    def _repr_html_(self) -> str:
        return state_html(self)


@dataclass(frozen=True)
class _Lion:
    lr: float | Schedule
    b1: float
    b2: float
    weight_decay: float

    api = "sg.optim.lion"


def _config(lr: Any, b1: Any, b2: Any, weight_decay: Any) -> _Lion:
    api = _Lion.api
    return _Lion(
        lr=_checks.check_learning_rate(api, lr),
        b1=_checks.check_beta(api, "b1", b1),
        b2=_checks.check_beta(api, "b2", b2),
        weight_decay=_checks.check_nonnegative(api, "weight_decay", weight_decay),
    )


def _init(cfg: _Lion, params: PyTree) -> LionState:
    leaves, spec = _checks.tensor_leaves(cfg.api, params)
    return LionState(_scalars.init_count(leaves), zeros_tree(leaves, spec))


def _direction(cfg: _Lion, g: Tensors, mu: Tensors, p: Tensors) -> Tensors:
    """``sign(lerp(mu, g, 1 - b1)) + weight_decay * p``."""
    direction = _scalars.sign(_scalars.lerp(mu, g, 1.0 - cfg.b1))
    if not cfg.weight_decay:
        return direction
    return torch._foreach_add(direction, p, alpha=cfg.weight_decay)


def _update(cfg: _Lion, grads: PyTree, state: LionState, params: PyTree | None) -> tuple[PyTree, LionState]:
    _checks.check_state(cfg.api, state, LionState)
    g = _checks.matching_leaves(cfg.api, state.mu, grads, name="grads")
    p: Tensors = []
    if cfg.weight_decay:
        p = _checks.required_params(cfg.api, params, grads, reason=f"weight_decay={cfg.weight_decay}")
    if not g:
        return grads, state._replace(count=state.count + 1)
    mu = tree.leaves(state.mu)
    direction = _direction(cfg, g, mu, p)
    lr = _scalars.learning_rate(cfg.lr, state.count)
    updates = torch._foreach_mul(direction, _scalars.like(-lr, g[0]))
    spec = tree.structure(grads)
    new_mu = tree.unflatten(spec, _scalars.lerp(mu, g, 1.0 - cfg.b2))
    return tree.unflatten(spec, _scalars.dtypes_of(updates, g)), LionState(state.count + 1, new_mu)


def lion(
    lr: float | Schedule, *, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0
) -> GradientTransformation:
    """Lion: the sign of an interpolated momentum, plus decoupled weight decay.

    Use a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger
    (the paper's advice), since every coordinate moves by ``lr``.

    Args:
        lr: learning rate, a float ``>= 0`` or a :class:`Schedule` of the count.
        b1: interpolation between momentum and gradient for the step, in ``[0, 1)``.
        b2: decay of the momentum, in ``[0, 1)``.
        weight_decay: decoupled decay rate, ``>= 0``; when nonzero, ``update`` needs ``params``.

    Returns:
        A :class:`GradientTransformation` with :class:`LionState`.

    Example:
        >>> opt = sg.optim.lion(1e-4, weight_decay=0.1)
    """
    cfg = _config(lr, b1, b2, weight_decay)

    def init(params: PyTree, /) -> LionState:
        return _init(cfg, params)

    def update(grads: PyTree, state: LionState, params: PyTree | None = None) -> tuple[PyTree, LionState]:
        return _update(cfg, grads, state, params)

    return GradientTransformation(init, update)
