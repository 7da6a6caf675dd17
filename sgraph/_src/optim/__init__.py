"""Optax-like pure optimizers and schedules driven by a step-count tensor.

An optimizer is a :class:`GradientTransformation` ``(init, update)``. States are
NamedTuples of pytrees of tensors; each holds ``count``, a 0-dim int64 tensor on the
params' device counting the updates applied. Learning rates are floats or
:class:`Schedule` s of that count (the k-th update uses ``schedule(k - 1)``), so the
whole update is tensor ops: it traces into one graph and never syncs with the host.

States save with ``torch.save`` and load with ``torch.load``'s default
``weights_only=True``: their classes are allowlisted on import.
"""

import torch

from ._adam import ScaleByAdamState, adam, adamw
from ._base import EmptyState, GradientTransformation, apply_updates, chain, identity
from ._clip import clip_by_global_norm, global_norm
from ._lion import LionState, lion
from ._schedules import Schedule, constant, cosine, linear, linear_warmup, warmup_cosine
from ._sgd import SgdState, sgd

STATES = (EmptyState, LionState, ScaleByAdamState, SgdState)
"""Every state class an optimizer here returns (chain states are plain tuples of them)."""

torch.serialization.add_safe_globals(list(STATES))

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "LionState",
    "ScaleByAdamState",
    "Schedule",
    "SgdState",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine",
    "global_norm",
    "identity",
    "linear",
    "linear_warmup",
    "lion",
    "sgd",
    "warmup_cosine",
]
