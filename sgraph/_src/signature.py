"""Call signatures: what a compiled step was traced for, and what changed between two.

A :class:`Signature` has three parts: the structure of ``(args, kwargs)`` (pytree
structure including dict key order and leaf types), one key per leaf (a tensor's
shape, dtype, device, strides and ``requires_grad``, a DTensor's mesh and
placements, a static leaf's type and value) and the context the trace read (the
global modes and module training flags of :mod:`guards`).

Building a full signature is for new calls and messages. Calls that hit the cache
are checked by :class:`TensorCheck` (torch's C++ tensor-metadata check when this
build has it) and :func:`static_key` on the few static leaves.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from .errors import ArgumentTypeError
from .guards import GlobalState, ModuleFlags, describe_global_change
from .text import describe_tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["ClosureCheck", "Signature", "TensorCheck", "leaf_key", "static_key", "signature_of"]


@dataclass(frozen=True)
class Signature:
    """The hashable key of one call: structure, leaf keys and traced context.

    Attributes:
        structure: the call's structure (see :class:`argtree.ArgFlattener`).
        leaves: one :func:`leaf_key` per leaf, in flattening order.
        state: the global modes when traced (:func:`guards.global_state`).
        modules: the training flags of the modules the trace read.
        paths: each leaf's path, for messages (not part of the identity).
        names: the argument names (positional, then keywords sorted), for messages.
    """

    structure: Any
    leaves: tuple[Any, ...]
    state: GlobalState = ()
    modules: ModuleFlags = field(default_factory=ModuleFlags)
    paths: tuple[str, ...] = field(default=(), compare=False)
    names: tuple[str, ...] = field(default=(), compare=False)

    def devices(self) -> set[torch.device]:
        """The devices of the call's tensor leaves."""
        return {key[3] for key in self.leaves if isinstance(key, tuple) and key[:1] in (("tensor",), ("dtensor",))}

    def difference(self, old: Signature) -> str:
        """Say in one line what changed from ``old`` to this signature.

        Example:
            >>> new.difference(old)
            "params['extra'] is new"
        """
        return "; ".join(_differences(old, self)[:3]) or "no leaf changed"

    def distance(self, other: Signature) -> int:
        """How many things differ (for picking the nearest cached signature)."""
        return len(_differences(other, self))


def signature_of(
    leaves: Sequence[Any],
    structure: Any,
    paths: Sequence[str],
    state: GlobalState = (),
    modules: ModuleFlags | None = None,
    names: Sequence[str] = (),
) -> Signature:
    """The signature of one call's flattened arguments.

    Raises:
        ArgumentTypeError: a static (non-tensor) leaf is not hashable; names its path.
    """
    keys = tuple(leaf_key(leaf) for leaf in leaves)
    try:
        hash(keys)
    except TypeError:
        raise ArgumentTypeError(_unhashable(leaves, paths)) from None
    return Signature(structure, keys, state, modules or ModuleFlags(), tuple(paths), tuple(names))


def leaf_key(leaf: Any) -> Any:
    """What the cache compares of one leaf (tensors by metadata, static leaves by value)."""
    if isinstance(leaf, torch.Tensor):
        placements = _placements(leaf)
        if placements is not None:
            return ("dtensor", leaf.shape, leaf.dtype, leaf.device, placements)
        return (
            "tensor",
            leaf.shape,
            leaf.dtype,
            leaf.device,
            leaf.stride(),
            leaf.requires_grad,
            type(leaf),
            leaf.is_conj(),
            leaf.is_neg(),
            leaf.is_inference(),
        )
    return static_key(leaf)


def static_key(value: Any) -> Any:
    """A static leaf's cache key: its type and value, with floats compared by bits.

    ``-0.0`` and ``0.0`` differ (``x / s`` gives ``-inf`` or ``inf``) and NaN equals
    NaN, so a NaN argument does not retrace on every call.
    """
    kind = type(value)
    if kind is float:
        return ("static", kind, _float_bits(value))
    if kind is int or kind is bool or kind is str:
        return ("static", kind, value)
    # a float of another type (NumPy's float32 / float64) by its bits too
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return ("static", kind, _float_bits(float(value)))
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        z = complex(value)
        return ("static", kind, _float_bits(z.real), _float_bits(z.imag))
    return ("static", kind, value)


def _float_bits(x: float) -> Any:
    if x != x:
        return "nan"
    if x == 0.0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    return x


class TensorCheck:
    """Checks that tensors have the metadata the step was traced for, fast.

    Uses torch's C++ check (the one ``torch.compile`` guards with: type, dispatch
    keys, dtype, device, shape, strides, ``requires_grad``) where this build has it,
    else compares :func:`leaf_key` of each tensor. The C++ check also fails when one
    tensor object comes twice; such calls are decided by the comparison of keys.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._keys = [leaf_key(t) for t in tensors]
        self._native = _native_check(tensors)

    def holds(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` match, one for one."""
        if self._native is not None and self._native.check(*tensors):
            return True
        return len(tensors) == len(self._keys) and all(
            isinstance(t, torch.Tensor) and leaf_key(t) == k for t, k in zip(tensors, self._keys)
        )


class ClosureCheck:
    """Checks that the tensors a step closes over keep what it was traced for: their
    metadata (as :class:`TensorCheck`), and their memory, which a CUDA graph reads at
    the address it captured (``t.data = ...``, ``t.set_(...)``, ``t.resize_(...)`` and
    ``module.double()`` change one in place, where eager follows).

    Args:
        described: each closed-over tensor with how messages name it.
    """

    def __init__(self, described: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._names = [name for name, _ in described]
        self.tensors = [t for _, t in described]
        self._keys = [leaf_key(t) for t in self.tensors]
        self._check = TensorCheck(self.tensors) if self.tensors else None
        self._addresses = [_address(t) for t in self.tensors]

    def holds(self) -> bool:
        if self._check is None:
            return True
        return self._check.holds(self.tensors) and [_address(t) for t in self.tensors] == self._addresses

    def change(self) -> str | None:
        """What changed, in one line (None if nothing did)."""
        for name, t, key, address in zip(self._names, self.tensors, self._keys, self._addresses):
            now = leaf_key(t)
            if now != key:
                return f"{name}, closed over by the step, changed: {_describe(key, now)} -> {_describe(now, key)}"
            if _address(t) != address:
                return f"{name}, closed over by the step, now holds other memory (its storage was replaced)"
        return None


def _address(t: torch.Tensor) -> int:
    """``t``'s data pointer (0 for a tensor subclass, whose memory is its own business)."""
    return t.data_ptr() if type(t) in (torch.Tensor, torch.nn.Parameter) else 0


def _native_check(tensors: Sequence[torch.Tensor]) -> Any:
    if not tensors or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return None
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(
            *tensors,
            dynamic_dims_sizes=cast(Any, [list(t.shape) for t in tensors]),
            dynamic_dims_strides=cast(Any, [list(t.stride()) for t in tensors]),
        )
    except (ImportError, TypeError, RuntimeError, SystemError):
        return None


def _placements(leaf: torch.Tensor) -> Any:
    spec = getattr(leaf, "_spec", None)
    if spec is None or not hasattr(spec, "placements"):
        return None
    return (spec.mesh, tuple(spec.placements), cast("DTensor", leaf)._local_tensor.stride())


# --------------------------------------------------------------------------- messages


def _differences(old: Signature, new: Signature) -> list[str]:
    found = _structure_differences(old, new)
    if not found:
        found = [
            f"{path}: {_describe(was, now)} -> {_describe(now, was)}"
            for path, was, now in zip(new.paths, old.leaves, new.leaves)
            if was != now
        ]
    if old.state != new.state:
        found += describe_global_change(old.state, new.state)
    if old.modules != new.modules:
        found += _module_differences(old.modules, new.modules)
    return found


def _structure_differences(old: Signature, new: Signature) -> list[str]:
    if old.structure == new.structure:
        return []
    before, after = set(old.paths), set(new.paths)
    found = [f"{p} is new" for p in new.paths if p not in before]
    found += [f"{p} is missing" for p in old.paths if p not in after]
    if found:
        return found
    order = _order_change(old, new)
    if order is not None:
        return [order]
    kinds = [
        f"{p}: {_describe(a, b)} -> {_describe(b, a)}"
        for p, a, b in zip(new.paths, old.leaves, new.leaves)
        if _kind(a) != _kind(b)
    ]
    return kinds or ["the argument structure changed (container types)"]


def _order_change(old: Signature, new: Signature) -> str | None:
    from .argtree import describe_binding_change, describe_order_change

    try:
        return describe_binding_change(old.structure, new.structure) or describe_order_change(
            old.structure, new.structure, list(new.names)
        )
    except (TypeError, AttributeError, IndexError):  # structures of another kind (hand-built)
        return None


def _module_differences(old: ModuleFlags, new: ModuleFlags) -> list[str]:
    mode = {True: "train", False: "eval"}
    if old.modules != new.modules:
        return ["the modules the step runs changed"]
    changed = [(name, a, b) for name, a, b in zip(new.names, old.flags, new.flags) if a != b]
    if not changed:
        return []
    name, a, b = changed[0]
    more = f" (and of {len(changed) - 1} more module{'s' * (len(changed) > 2)})" if len(changed) > 1 else ""
    return [f"training mode of {name} changed: {mode[a]} -> {mode[b]}{more}"]


def _kind(key: Any) -> str:
    return f"static {key[1].__name__}" if key[0] == "static" else key[0]


def _describe(key: Any, other: Any) -> str:
    kind = key[0]
    if kind == "static":
        return f"static {_static_value(key)} ({key[1].__name__})"
    text = describe_tensor(key[2], tuple(key[1]), key[3])
    if kind == "dtensor":
        return f"{text} placements {list(key[4][1])} on {key[4][0]}"
    if other[0] != kind or other[1:4] != key[1:4]:
        return text
    if other[4] != key[4]:
        return f"{text} with strides {key[4]}"
    if other[5] != key[5]:
        return f"{text} {'requiring' if key[5] else 'not requiring'} grad"
    if other[6] != key[6]:
        return f"{text} of type {key[6].__name__}"
    bits = [name for name, on in zip(("conjugated view", "negated view", "inference tensor"), key[7:]) if on]
    return f"{text} ({', '.join(bits) if bits else 'not a conjugated or negated view, nor an inference tensor'})"


def _static_value(key: Any) -> str:
    if key[1] is float:
        return key[2] if isinstance(key[2], str) else repr(key[2])
    if key[1] is complex:
        return f"complex({key[2]}, {key[3]})"
    return repr(key[2])


def _unhashable(leaves: Sequence[Any], paths: Sequence[str]) -> str:
    for leaf, where in zip(leaves, paths):
        try:
            hash(leaf_key(leaf))
        except TypeError:
            return (
                f"{where} is a {type(leaf).__name__}, which is neither a tensor nor hashable; static "
                "arguments must be hashable (they are part of the compiled step's signature). Pass a "
                "tensor, a tuple, or register the class as a pytree node (sg.tree.register_node, "
                "sg.tree.register_dataclass)."
            )
    return "an argument is not hashable"
