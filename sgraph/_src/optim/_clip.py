"""Gradient clipping by the global 2-norm, as ``torch.nn.utils.clip_grad_norm_``.

    total = ||[||g_1||, ..., ||g_n||]||      (norms in the grads' dtype, as PyTorch)
    g     = g * min(max_norm / (total + 1e-6), 1)

The scale is always applied (multiplying by 1 when nothing is clipped), so there is
no branch on the norm's value and no host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import tree
from ._base import EmptyState, GradientTransformation, PyTree
from ._checks import check_positive, check_state
from ._scalars import dtypes_of

__all__ = ["global_norm", "clip_by_global_norm"]


def _total_norm(leaves: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves, 2.0)), 2.0)


def global_norm(tree_: PyTree, /) -> torch.Tensor:
    """The 2-norm of all leaves of ``tree_`` taken together, as a 0-dim tensor.

    Args:
        tree_: a pytree of tensors (usually grads or updates).

    Returns:
        A 0-dim tensor on the leaves' device; a CPU zero for an empty tree.

    Example:
        >>> metrics = {"grad_norm": sg.optim.global_norm(grads)}
    """
    leaves = tree.leaves(tree_)
    return _total_norm(leaves) if leaves else torch.zeros(())


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the grads down so their global 2-norm is at most ``max_norm``.

    Args:
        max_norm: the largest global norm let through, ``> 0``.

    Returns:
        A :class:`GradientTransformation` with :class:`EmptyState`; ``params`` is
        not needed.

    Example:
        >>> opt = sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.adamw(3e-4))
    """
    api = "sg.optim.clip_by_global_norm"
    limit = check_positive(api, "max_norm", max_norm)

    def init(params: PyTree, /) -> EmptyState:
        return EmptyState()

    def update(grads: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, EmptyState]:
        check_state(api, state, EmptyState)
        g, spec = tree.flatten(grads)
        if not g:
            return grads, EmptyState()
        coef = torch.clamp(limit / (_total_norm(g) + 1e-6), max=1.0)
        return tree.unflatten(spec, dtypes_of(torch._foreach_mul(g, coef), g)), EmptyState()

    return GradientTransformation(init, update)
