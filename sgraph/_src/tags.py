"""User names for values of a traced step, as ``jax.ad_checkpoint.checkpoint_name``.

``sg.checkpoint_name(x, "attn_scores")`` records the name on the graph node that
made ``x`` (under ``TAGS_KEY`` in its meta) and returns ``x`` itself: no op is
added, and outside a trace it does nothing. ``sg.plan_memory``'s ``save=`` and
``recompute=`` patterns match these names as they match module paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from . import tree
from .dtensors import local
from .errors import ArgumentTypeError
from .guards import is_tracing

__all__ = ["FOLDABLE_KEY", "TAGS_KEY", "checkpoint_name", "mark_foldable"]

TAGS_KEY = "sgraph_tags"
"""Node meta key: the names given to the node's value with :func:`checkpoint_name`, in order."""

FOLDABLE_KEY = "sgraph_foldable"
"""Node meta key: the node is ``sg.optim``'s own update arithmetic (``new_p - p``, then
``p + updates``), which the ``simplify`` pass may fold; the user's code is never folded."""

T = TypeVar("T")


def checkpoint_name(x: T, /, name: str) -> T:
    """Name a value of the step, for ``sg.plan_memory(save=..., recompute=...)``.

    Args:
        x: a tensor, or a pytree of tensors (each is named).
        name: the name; patterns match it as they match module paths
            (``"attn_*"``, and ``"attn"`` also matches ``"attn.scores"``).

    Returns:
        ``x`` itself. While sgraph traces a step, the graph node that made ``x``
        (each leaf's) records ``name``; otherwise nothing happens.

    Raises:
        ArgumentTypeError: ``name`` is not a non-empty string, or ``x`` holds
            something other than tensors.

    Example:
        >>> @sg.static
        ... @sg.plan_memory(recompute="scores")
        ... def step(params, batch):
        ...     scores = sg.checkpoint_name(q @ k.mT, "scores")
    """
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(
            f"sg.checkpoint_name: name must be a non-empty string, such as 'attn_scores'; found {name!r}."
        )
    paths, leaves, _ = tree.flatten_with_paths(x, prefix="x")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ArgumentTypeError(
                f"sg.checkpoint_name: x must be a tensor or a pytree of tensors; found {leaf!r:.60} "
                f"(type {type(leaf).__name__}) at {path}. Name the tensors only, e.g. "
                f"sg.checkpoint_name(out.logits, {name!r})."
            )
    mode = get_proxy_mode() if is_tracing() else None
    if mode is not None:
        for leaf in leaves:
            _tag(mode.tracer, leaf, name)
    return x


def mark_foldable(tensors: Sequence[torch.Tensor]) -> Any:
    """Mark the graph nodes that made ``tensors`` with :data:`FOLDABLE_KEY`; returns ``tensors``."""
    mode = get_proxy_mode() if is_tracing() else None
    if mode is not None:
        for t in tensors:
            slot = get_proxy_slot(local(t), mode.tracer, None)
            if slot is not None:
                slot.proxy.node.meta[FOLDABLE_KEY] = True
    return tensors


def _tag(tracer: Any, value: torch.Tensor, name: str) -> None:
    # The graph tracks a DTensor's local shard; a tensor made outside the trace has no node.
    slot = get_proxy_slot(local(value), tracer, None)
    if slot is None:
        return
    meta = slot.proxy.node.meta
    if name not in meta.get(TAGS_KEY, ()):
        meta[TAGS_KEY] = (*meta.get(TAGS_KEY, ()), name)
