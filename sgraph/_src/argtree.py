"""Flatten a call's arguments fast, by matching structures seen on earlier calls.

Flattening a 500-leaf pytree with optree costs a few hundred microseconds, which
would dominate a small step. A training loop passes the same structures on every
call, so each argument position keeps the :class:`Template` of the structures it
has seen; matching one is a handful of C-level list operations per container
(keys, value types), and yields the leaves in optree's order. A miss (a new
structure) builds a new template from optree's own view of the object.

A template also pins what optree's structure equality leaves out: the insertion
order of dict keys and the exact type of every leaf. Two calls whose dicts hold
the same keys in another order therefore have different templates, so the order
a step sees is part of its signature, as in eager PyTorch.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from typing import Any, cast

import optree

from .tree import NAMESPACE

__all__ = ["Template", "ArgFlattener", "CallStructure"]

_NOT_A_FACTORY = object()


class _Node:
    """One container of a template: its type, its children's types, how to order them."""

    __slots__ = ("kind", "type", "keys", "types", "order", "subs", "getter", "factory", "spec", "key")

    def __init__(self, obj: Any, leaves: list[Any]) -> None:
        self.type = type(obj)
        self.factory: Any = getattr(obj, "default_factory", _NOT_A_FACTORY)
        self.spec: Any = None
        self.subs: dict[int, _Node] = {}
        self.getter: Any = None
        self.keys: list[Any] | None = None
        self.types: list[type] = []
        self.order: tuple[int, ...] | None = None
        if optree.tree_is_leaf(obj, namespace=NAMESPACE):
            self.kind, self.types, self.order = "leaf", [], None
            leaves.append(obj)
        elif obj is None:
            self.kind, self.types, self.order = "none", [], None
        elif self.type in (dict, collections.OrderedDict, collections.defaultdict):
            self._init_dict(obj, leaves)
        elif self.type in (list, tuple) or _is_namedtuple(self.type):
            self._init_sequence(obj, leaves)
        else:  # another registered node: optree flattens it on every call
            self.kind, self.types, self.order = "opaque", [], None
            found, self.spec = optree.tree_flatten(obj, namespace=NAMESPACE)
            leaves.extend(found)
        self.key = self._key()

    def _init_dict(self, obj: dict[Any, Any], leaves: list[Any]) -> None:
        self.kind = "dict"
        self.keys = list(obj)
        entries = optree.tree_flatten_one_level(cast(Any, obj), namespace=NAMESPACE).entries
        index = {k: i for i, k in enumerate(self.keys)}
        self._init_children(list(obj.values()), [index[k] for k in entries], leaves)

    def _init_sequence(self, obj: Sequence[Any], leaves: list[Any]) -> None:
        self.kind = "sequence"
        self._init_children(list(obj), list(range(len(obj))), leaves)

    def _init_children(self, values: list[Any], order: list[int], leaves: list[Any]) -> None:
        self.types = [type(v) for v in values]
        self.order = None if order == list(range(len(values))) else tuple(order)
        for i in order:
            child = _Node(values[i], leaves)
            if child.kind != "leaf":
                self.subs[i] = child
        if not self.subs and self.order is not None:
            self.getter = operator.itemgetter(*self.order) if len(self.order) > 1 else None

    def _key(self) -> tuple[Any, ...]:
        subs = tuple((i, s.key) for i, s in sorted(self.subs.items()))
        factory = None if self.factory is _NOT_A_FACTORY else id(self.factory)
        keys = tuple(self.keys) if self.keys is not None else None
        return (self.kind, self.type, keys, tuple(self.types), factory, self.spec, subs)

    def flatten(self, obj: Any, out: list[Any]) -> bool:
        """Append ``obj``'s leaves to ``out`` if it has this structure; else return False."""
        if type(obj) is not self.type:
            return False
        kind = self.kind
        if kind == "leaf":
            out.append(obj)
            return True
        if kind == "none":
            return True
        if kind == "opaque":
            found, spec = optree.tree_flatten(obj, namespace=NAMESPACE)
            if spec != self.spec:
                return False
            out.extend(found)
            return True
        values = self._values(obj)
        if values is None or list(map(type, values)) != self.types:
            return False
        if not self.subs:
            out.extend(values if self.order is None else self._ordered(values))
            return True
        positions: Sequence[int] = self.order or range(len(values))
        for i in positions:
            sub = self.subs.get(i)
            if sub is None:
                out.append(values[i])
            elif not sub.flatten(values[i], out):
                return False
        return True

    def _values(self, obj: Any) -> list[Any] | None:
        if self.kind == "sequence":
            return obj if len(obj) == len(self.types) else None
        if len(obj) != len(self.types) or list(obj) != self.keys:
            return None
        if self.factory is not _NOT_A_FACTORY and obj.default_factory is not self.factory:
            return None
        return list(obj.values())

    def _ordered(self, values: list[Any]) -> Sequence[Any]:
        if self.getter is not None:
            return self.getter(values)  # type: ignore[no-any-return]
        return [values[i] for i in self.order or ()]


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


class Template:
    """The structure of one argument; hashable, equal for equal structures.

    Example:
        >>> leaves = []
        >>> t = Template.build({"b": 1, "a": 2}, leaves)
        >>> leaves, t.flatten({"b": 3, "a": 4}, out := []), out
        ([2, 1], True, [4, 3])
    """

    __slots__ = ("root", "_hash")

    def __init__(self, root: _Node) -> None:
        self.root = root
        self._hash = hash(root.key)

    @staticmethod
    def build(obj: Any, leaves: list[Any]) -> Template:
        """The template of ``obj``'s structure; appends its leaves to ``leaves``."""
        return Template(_Node(obj, leaves))

    def flatten(self, obj: Any, out: list[Any]) -> bool:
        """Append ``obj``'s leaves (in optree's order) to ``out`` if it has this structure."""
        start = len(out)
        if self.root.flatten(obj, out):
            return True
        del out[start:]
        return False

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Template) and self.root.key == other.root.key)


CallStructure = tuple
"""``(templates of the positional arguments, (keyword, template) pairs)``: hashable."""


class ArgFlattener:
    """Flattens calls of one function, keeping a few templates per argument position."""

    def __init__(self, keep: int = 4) -> None:
        self._templates: dict[int | str, list[Template]] = {}
        self._keep = keep

    def flatten(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], CallStructure]:
        """The leaves of ``(args, kwargs)`` in ``sg.tree.flatten``'s order, and their structure."""
        leaves: list[Any] = []
        positional = tuple([self._one(i, a, leaves) for i, a in enumerate(args)])
        if not kwargs:
            return leaves, (positional, ())
        named = tuple([(k, self._one(k, kwargs[k], leaves)) for k in sorted(kwargs)])
        return leaves, (positional, named)

    def _one(self, position: int | str, obj: Any, leaves: list[Any]) -> Template:
        known = self._templates.get(position)
        if known is not None:
            for template in known:
                if template.flatten(obj, leaves):
                    return template
        else:
            known = self._templates[position] = []
        template = Template.build(obj, leaves)
        known.insert(0, template)
        del known[self._keep :]
        return template


def describe_binding_change(old: CallStructure, new: CallStructure) -> str | None:
    """``"2 positional arguments and keywords [] -> 1 positional and keywords ['batch']"``
    when the two calls pass their arguments differently; None when they pass them alike."""
    was, now = (len(old[0]), [k for k, _ in old[1]]), (len(new[0]), [k for k, _ in new[1]])
    if was == now:
        return None
    return (
        f"the call passes {now[0]} positional argument{'s' * (now[0] != 1)} and keywords {now[1]} "
        f"where the traced one passed {was[0]} and keywords {was[1]}"
    )


def describe_order_change(old: CallStructure, new: CallStructure, names: list[str]) -> str | None:
    """``"the key order of params changed: ['w', 'b'] -> ['b', 'w']"`` when two structures
    differ only in the order of some dict's keys; None otherwise.

    Args:
        old / new: two call structures of the same argument count.
        names: the argument names, positional ones first, then the keywords' (sorted).
    """
    pairs = list(zip(old[0], new[0])) + [(a, b) for (_, a), (_, b) in zip(old[1], new[1])]
    for name, (a, b) in zip(names, pairs):
        if a != b:
            return _order_change(a.root, b.root, name)
    return None


def _order_change(a: _Node, b: _Node, path: str) -> str | None:
    if a.kind != b.kind or a.type is not b.type:
        return None
    if a.keys is not None and b.keys is not None and a.keys != b.keys:
        if sorted(map(repr, a.keys)) == sorted(map(repr, b.keys)):
            return f"the key order of {path} changed: {a.keys} -> {b.keys}"
        return None
    for i, sub in a.subs.items():
        other = b.subs.get(i)
        if other is not None and other.key != sub.key:
            label = f"[{a.keys[i]!r}]" if a.keys is not None else f"[{i}]"
            return _order_change(sub, other, path + label)
    return None
