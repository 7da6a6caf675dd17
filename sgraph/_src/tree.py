"""Pytrees: optree in sgraph's own namespace.

Containers are dicts, lists, tuples, namedtuples, ``None`` (an empty subtree, as in
JAX) and anything registered with :func:`register_node`. Everything else is a leaf:
tensors and DTensors included. Paths are written the way Python indexes them,
``params['0.weight']`` or ``opt_state[1].mu['w']``, so an error message can be
pasted back into code.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import optree
from optree import PyTreeSpec

from .errors import ArgumentTypeError, TreeStructureError

__all__ = [
    "NAMESPACE",
    "PyTreeSpec",
    "flatten",
    "flatten_with_paths",
    "unflatten",
    "leaves",
    "structure",
    "paths",
    "map",
    "register_node",
    "register_dataclass",
    "assert_same_structure",
]

NAMESPACE = "sgraph"
T = TypeVar("T")


def flatten(tree: Any, /) -> tuple[list[Any], PyTreeSpec]:
    """Split ``tree`` into its leaves (left to right) and its structure.

    Example:
        >>> leaves, spec = flatten({"b": 1, "a": (2, 3)})
        >>> leaves
        [2, 3, 1]
    """
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def flatten_with_paths(tree: Any, /, *, prefix: str = "") -> tuple[list[str], list[Any], PyTreeSpec]:
    """Like :func:`flatten`, with each leaf's path as Python indexing text.

    Args:
        tree: any pytree.
        prefix: text put before every path, usually the argument's name.

    Returns:
        ``(paths, leaves, spec)``.

    Example:
        >>> flatten_with_paths({"w": 1}, prefix="params")[0]
        ["params['w']"]
    """
    accessors, leaves_, spec = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [a.codify(prefix) for a in accessors], leaves_, spec


def paths(spec_or_tree: Any, /, *, prefix: str = "") -> list[str]:
    """The path of every leaf, as :func:`flatten_with_paths` writes it, of a spec (from
    :func:`flatten`) or of a tree itself (``sg.tree.paths(opt_state)``).

    Example:
        >>> paths({"w": 1, "b": (2, 3)}, prefix="params")
        ["params['b'][0]", "params['b'][1]", "params['w']"]
    """
    if isinstance(spec_or_tree, PyTreeSpec):
        return [a.codify(prefix) for a in spec_or_tree.accessors()]
    return flatten_with_paths(spec_or_tree, prefix=prefix)[0]


def unflatten(spec: PyTreeSpec, leaves_: Iterable[Any], /) -> Any:
    """Rebuild a tree of structure ``spec`` from ``leaves_`` (the inverse of :func:`flatten`)."""
    return optree.tree_unflatten(spec, leaves_)


def leaves(tree: Any, /) -> list[Any]:
    """The leaves of ``tree``, left to right."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def structure(tree: Any, /) -> PyTreeSpec:
    """The structure of ``tree`` without its leaves."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def map(fn: Callable[..., Any], tree: Any, /, *rest: Any) -> Any:
    """Apply ``fn`` leafwise over ``tree`` and trees of the same structure.

    Raises:
        TreeStructureError: a tree in ``rest`` differs from ``tree``; the message
            names the first differing path.

    Example:
        >>> map(lambda a, b: a + b, {"x": 1}, {"x": 2})
        {'x': 3}
    """
    spec = structure(tree)
    for i, other in enumerate(rest):
        assert_same_structure(tree, other, what=f"tree.map argument {i + 1}")
    flat = [spec.flatten_up_to(t) for t in rest]
    return unflatten(spec, [fn(*xs) for xs in zip(leaves(tree), *flat)])


def register_node(
    cls: type[T],
    flatten_fn: Callable[[T], tuple[Sequence[Any], Any]],
    unflatten_fn: Callable[[Any, Sequence[Any]], T],
    /,
) -> type[T]:
    """Register ``cls`` as a container in sgraph's namespace.

    Args:
        cls: the class.
        flatten_fn: ``obj -> (children, aux)``; ``aux`` must be hashable.
        unflatten_fn: ``(aux, children) -> obj``.

    Returns:
        ``cls``, so this can decorate a class factory.
    """
    # optree's stubs require a Collection class; at runtime any class registers.
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)  # type: ignore[arg-type]
    return cls


def register_dataclass(cls: type[T], /) -> type[T]:
    """Register a dataclass as a container whose children are its fields.

    Every field that ``__init__`` takes is a child, in declaration order; paths
    name fields as attributes (``state.mu``). Works as a decorator.

    Raises:
        ArgumentTypeError: ``cls`` is not a dataclass.

    Example:
        >>> @sg.tree.register_dataclass
        ... @dataclasses.dataclass
        ... class State:
        ...     mu: torch.Tensor
        ...     step: int
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ArgumentTypeError(
            f"sg.tree.register_dataclass: expected a dataclass type; found {cls!r}. "
            "Decorate the class with @dataclasses.dataclass first, or use sg.tree.register_node."
        )
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def flatten_fn(obj: Any) -> tuple[list[Any], None, tuple[str, ...]]:
        return [getattr(obj, n) for n in names], None, names

    def unflatten_fn(_: Any, children: Iterable[Any]) -> Any:
        return cls(**dict(zip(names, children)))

    optree.register_pytree_node(
        cls,  # type: ignore[arg-type]
        flatten_fn,  # type: ignore[arg-type]
        unflatten_fn,
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )
    return cls


def assert_same_structure(expected: Any, found: Any, /, *, what: str, prefix: str = "") -> None:
    """Raise :class:`TreeStructureError` naming the first path where two trees differ.

    Args:
        expected: the reference tree.
        found: the tree that must have the same structure.
        what: the API and argument being checked, put first in the message.
        prefix: text put before the path (an argument name).
    """
    if structure(expected) == structure(found):
        return
    where, want, got = _first_difference(expected, found, prefix)
    raise TreeStructureError(
        f"{what}: structure differs at {where or '<root>'}: expected {want}, found {got}. "
        "Pass a tree of the same structure (same keys, same lengths, same container types)."
    )


def _node_summary(node: Any) -> str:
    if isinstance(node, dict):
        # OrderedDicts and defaultdicts are other structures than dicts; an OrderedDict's
        # key order is part of its structure, a dict's is not
        keys = [repr(k) for k in node] if isinstance(node, collections.OrderedDict) else sorted(repr(k) for k in node)
        return f"{type(node).__name__} with keys [{', '.join(keys)}]"
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return f"{type(node).__name__} with fields {list(node._fields)}"
    if isinstance(node, (list, tuple)):
        return f"{type(node).__name__} of length {len(node)}"
    if node is None:
        return "None"
    return f"a leaf of type {type(node).__name__}"


def _first_difference(a: Any, b: Any, prefix: str) -> tuple[str, str, str]:
    """Walk two trees in step; return the first differing path and both node summaries."""
    spec_a, spec_b = structure(a), structure(b)
    if spec_a.is_leaf() or spec_b.is_leaf() or spec_a.type is not spec_b.type:
        return prefix, _node_summary(a), _node_summary(b)
    ca, cb = _children(a), _children(b)
    if [k for k, _ in ca] != [k for k, _ in cb]:
        return prefix, _node_summary(a), _node_summary(b)
    for (key, x), (_, y) in zip(ca, cb):
        if structure(x) != structure(y):
            return _first_difference(x, y, prefix + key)
    return prefix, _node_summary(a), _node_summary(b)


def _children(node: Any) -> list[tuple[str, Any]]:
    """One level of ``node``: (path text, child) pairs."""
    if isinstance(node, dict):
        return [(f"[{k!r}]", node[k]) for k in sorted(node, key=repr)]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [(f".{f}", getattr(node, f)) for f in node._fields]
    if isinstance(node, (list, tuple)):
        return [(f"[{i}]", x) for i, x in enumerate(node)]
    children = optree.tree_flatten_one_level(node, namespace=NAMESPACE)[0]
    return [(f"[{i}]", x) for i, x in enumerate(children)]
