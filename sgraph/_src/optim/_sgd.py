"""SGD with optional momentum, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

Per leaf (PyTorch's single-tensor path, dampening 0):

    g   = g + weight_decay * p                    # if weight_decay
    buf = buf * momentum + g                      # if momentum; buf starts at 0
    g   = g + momentum * buf if nesterov else buf
    update = -lr * g

PyTorch starts the buffer as a copy of the first gradient; starting from zeros gives
the same first buffer exactly (``0 * momentum + g == g``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import tree
from ..errors import ArgumentError
from . import _checks, _scalars
from ._base import GradientTransformation, PyTree, zeros_tree
from ._repr import state_html, state_repr
from ._scalars import Tensors
from ._schedules import Schedule

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: 0-dim int64 tensor, the number of updates applied so far.
        momentum: momentum buffers, a tree like the params; ``None`` without momentum.
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    momentum: PyTree | None

    def __repr__(self) -> str:
        return state_repr(self)

    def _repr_html_(self) -> str:
        return state_html(self)


@dataclass(frozen=True)
class _Sgd:
    lr: float | Schedule
    momentum: float
    nesterov: bool
    weight_decay: float

    api = "sg.optim.sgd"


def _config(lr: Any, momentum: Any, nesterov: Any, weight_decay: Any) -> _Sgd:
    api = _Sgd.api
    cfg = _Sgd(
        lr=_checks.check_learning_rate(api, lr),
        momentum=_checks.check_nonnegative(api, "momentum", momentum),
        nesterov=bool(nesterov),
        weight_decay=_checks.check_nonnegative(api, "weight_decay", weight_decay),
    )
    if cfg.nesterov and cfg.momentum == 0.0:
        raise ArgumentError(
            f"{api}: nesterov=True needs momentum > 0; found momentum=0.0. "
            "Pass a momentum such as momentum=0.9, or nesterov=False."
        )
    return cfg


def _init(cfg: _Sgd, params: PyTree) -> SgdState:
    leaves, spec = _checks.tensor_leaves(cfg.api, params)
    buffers = zeros_tree(leaves, spec) if cfg.momentum else None
    return SgdState(_scalars.init_count(leaves), buffers)


def _checked_leaves(cfg: _Sgd, grads: PyTree, state: SgdState, params: PyTree | None) -> tuple[Tensors, Tensors]:
    """The grads' and (when weight decay needs them) the params' leaves, after structure checks."""
    _checks.check_state(cfg.api, state, SgdState)
    if cfg.momentum:
        _checks.matching_leaves(cfg.api, state.momentum, grads, name="grads")
    if not cfg.weight_decay:
        return tree.leaves(grads), []
    p = _checks.required_params(cfg.api, params, grads, reason=f"weight_decay={cfg.weight_decay}")
    return tree.leaves(grads), p


def _direction(cfg: _Sgd, g: Tensors, p: Tensors, buf: Tensors) -> tuple[Tensors, Tensors]:
    """The step direction (before ``-lr``) and the new momentum buffers."""
    if cfg.weight_decay:
        g = torch._foreach_add(g, p, alpha=cfg.weight_decay)
    if not cfg.momentum:
        return g, []
    buf = torch._foreach_add(torch._foreach_mul(buf, cfg.momentum), g)
    if cfg.nesterov:
        return torch._foreach_add(g, buf, alpha=cfg.momentum), buf
    return buf, buf


def _update(cfg: _Sgd, grads: PyTree, state: SgdState, params: PyTree | None) -> tuple[PyTree, SgdState]:
    g, p = _checked_leaves(cfg, grads, state, params)
    if not g:
        return grads, state._replace(count=state.count + 1)
    direction, buf = _direction(cfg, g, p, tree.leaves(state.momentum))
    lr = _scalars.learning_rate(cfg.lr, state.count)
    updates = torch._foreach_mul(direction, _scalars.like(-lr, g[0]))
    spec = tree.structure(grads)
    momentum = tree.unflatten(spec, buf) if cfg.momentum else None
    return tree.unflatten(spec, _scalars.dtypes_of(updates, g)), SgdState(state.count + 1, momentum)


def sgd(
    lr: float | Schedule, *, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (dampening 0, not maximizing).

    Args:
        lr: learning rate, a float ``>= 0`` or a :class:`Schedule` of the count.
        momentum: momentum factor, ``>= 0``; 0 keeps no buffers.
        nesterov: use Nesterov momentum; needs ``momentum > 0``.
        weight_decay: L2 penalty added to the gradient, ``>= 0``; when nonzero,
            ``update`` needs ``params``.

    Returns:
        A :class:`GradientTransformation` with :class:`SgdState`.

    Example:
        >>> opt = sg.optim.sgd(0.1, momentum=0.9, nesterov=True)
    """
    cfg = _config(lr, momentum, nesterov, weight_decay)

    def init(params: PyTree, /) -> SgdState:
        return _init(cfg, params)

    def update(grads: PyTree, state: SgdState, params: PyTree | None = None) -> tuple[PyTree, SgdState]:
        return _update(cfg, grads, state, params)

    return GradientTransformation(init, update)
