"""The optimizer protocol: pure ``(init, update)`` pairs, ``chain`` and ``apply_updates``.

An optimizer never mutates what it is given. ``update`` returns new update tensors
and a new state; ``apply_updates`` returns new params. States are NamedTuples of
pytrees of tensors, so they flatten like any other input of a traced step.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from .. import tree
from ..errors import ArgumentTypeError
from ..tags import mark_foldable
from ._repr import state_html, state_repr

__all__ = [
    "PyTree",
    "InitFn",
    "UpdateFn",
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "apply_updates",
]

PyTree = Any


class InitFn(Protocol):
    """``init(params) -> state``: fresh state tensors on the params' device."""

    def __call__(self, params: PyTree, /) -> Any: ...


class UpdateFn(Protocol):
    """``update(grads, state, params=None) -> (updates, new_state)``; pure."""

    def __call__(self, grads: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer, as in optax: a pair of functions over pytrees of tensors.

    ``init(params)`` builds the state. ``update(grads, state, params=None)`` returns
    ``(updates, new_state)``; add the updates to the params with :func:`apply_updates`.
    Neither function mutates its arguments or reads a tensor's value on the host, so
    both trace into one graph.

    Example:
        >>> opt = sg.optim.adamw(1e-3)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = sg.optim.apply_updates(params, updates)
    """

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a transform that keeps none (``clip_by_global_norm``, ``identity``)."""

    def __repr__(self) -> str:
        return state_repr(self)

    def _repr_html_(self) -> str:
        return state_html(self)


def identity() -> GradientTransformation:
    """A transform whose updates are copies of the grads.

    Returns:
        A :class:`GradientTransformation` with :class:`EmptyState`.

    Example:
        >>> updates, _ = sg.optim.identity().update(grads, sg.optim.EmptyState())
    """

    def init(params: PyTree, /) -> EmptyState:
        return EmptyState()

    def update(grads: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, EmptyState]:
        return tree.map(torch.clone, grads), EmptyState()

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order, each to the updates of the one before.

    Args:
        *transforms: the transforms, first applied first.

    Returns:
        A :class:`GradientTransformation` whose state is a tuple of the states of
        ``transforms``, in order.

    Example:
        >>> opt = sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.adamw(1e-3))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise ArgumentTypeError(
                f"sg.optim.chain: argument {i} must be a GradientTransformation (such as "
                f"sg.optim.adamw(1e-3)); found {type(t).__name__}. Pass the transforms themselves."
            )

    def init(params: PyTree, /) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, tuple[Any, ...]]:
        _check_chain_state(state, len(transforms))
        new_state = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    return GradientTransformation(init, update)


def _check_chain_state(state: Any, n: int) -> None:
    if type(state) is not tuple or len(state) != n:
        found = f"tuple of length {len(state)}" if type(state) is tuple else type(state).__name__
        raise ArgumentTypeError(
            f"sg.optim.chain update: state must be the tuple of {n} states returned by init(params); "
            f"found {found}. Pass the state from this chain's init or its last update."
        )


def zeros_tree(leaves: list[torch.Tensor], spec: tree.PyTreeSpec) -> PyTree:
    """Fresh zeros like each leaf (same dtype, device, layout; DTensors stay DTensors)."""
    return tree.unflatten(spec, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves])


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return ``params + updates`` leafwise, as new tensors in the params' dtypes.

    Args:
        params: the current params.
        updates: the updates from an optimizer, same structure as ``params``.

    Returns:
        The new params; ``params`` and ``updates`` are left unchanged.

    Raises:
        TreeStructureError: ``updates`` has another structure; names the path.

    Example:
        >>> params = sg.optim.apply_updates(params, updates)
    """
    tree.assert_same_structure(params, updates, what="sg.optim.apply_updates: updates", prefix="updates")
    p, spec = tree.flatten(params)
    if not p:
        return tree.unflatten(spec, [])
    u = [x if x.dtype == y.dtype else x.to(y.dtype) for x, y in zip(tree.leaves(updates), p)]
    return tree.unflatten(spec, mark_foldable(torch._foreach_add(p, u)))
