"""Call signatures: the cache key of a compiled step, and what changed between two.

A signature is the tree structure of ``(args, kwargs)`` plus, per leaf, the
tensor's shape, dtype, device, strides (and DTensor mesh and placements), or a
static leaf's type and value. Computing one is on every call's path, so it is a
flat tuple built with no per-leaf Python objects beyond tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from . import tree
from .errors import ArgumentTypeError
from .text import describe_tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Signature", "signature_of"]


@dataclass(frozen=True)
class Signature:
    """The hashable key of one call's argument structure and leaf metadata."""

    spec: tree.PyTreeSpec
    leaves: tuple[Any, ...]

    def difference(self, old: Signature, paths: Sequence[str]) -> str:
        """Say what changed from ``old`` to this signature, naming the first leaf path.

        Args:
            old: the earlier signature.
            paths: leaf paths of this signature's arguments (from ``arg_layout``).
        """
        if self.spec != old.spec:
            return f"the argument structure changed: {old.spec} -> {self.spec}"
        for path, was, now in zip(paths, old.leaves, self.leaves):
            if was != now:
                strides = was[:4] == now[:4]
                return f"{path}: {_describe(was, strides)} -> {_describe(now, strides)}"
        return "no leaf changed"


def signature_of(leaves: list[Any], spec: tree.PyTreeSpec, paths: Sequence[str] | None = None) -> Signature:
    """The signature of one call's flattened arguments.

    Raises:
        TypeError: a static (non-tensor) leaf is not hashable; names its path when
            ``paths`` is given.
    """
    plain = torch.Tensor
    # Plain tensors inline: this runs on every call, for every leaf.
    keys = tuple(
        [("tensor", t.shape, t.dtype, t.device, t.stride()) if type(t) is plain else _leaf_key(t) for t in leaves]
    )
    try:
        hash(keys)
    except TypeError:
        raise ArgumentTypeError(_unhashable(leaves, paths)) from None
    return Signature(spec, keys)


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        placements = _placements(leaf)
        if placements is not None:
            return ("dtensor", leaf.shape, leaf.dtype, leaf.device, placements)
        return ("tensor", leaf.shape, leaf.dtype, leaf.device, leaf.stride())
    return ("static", type(leaf), leaf)


def _placements(leaf: torch.Tensor) -> Any:
    spec = getattr(leaf, "_spec", None)
    if spec is None or not hasattr(spec, "placements"):
        return None
    return (spec.mesh, tuple(spec.placements), cast("DTensor", leaf).to_local().stride())


def _describe(key: Any, strides: bool) -> str:
    kind = key[0]
    if kind == "static":
        return f"static {key[2]!r} ({key[1].__name__})"
    text = describe_tensor(key[2], tuple(key[1]), key[3])
    if kind == "dtensor":
        return f"{text} placements {list(key[4][1])} on {key[4][0]}"
    return f"{text} with strides {key[4]}" if strides else text


def _unhashable(leaves: list[Any], paths: Sequence[str] | None) -> str:
    for i, leaf in enumerate(leaves):
        try:
            hash(_leaf_key(leaf))
        except TypeError:
            where = paths[i] if paths is not None else f"leaf {i}"
            return (
                f"{where} is a {type(leaf).__name__}, which is neither a tensor nor hashable; static "
                "arguments must be hashable (they are part of the compiled step's signature). Pass a "
                "tensor, a tuple, or register the class with sg.tree.register_node."
            )
    return "an argument is not hashable"
