"""Pytrees in sgraph's namespace (see :mod:`sgraph._src.tree`)."""

from ._src.tree import (
    NAMESPACE,
    PyTreeSpec,
    assert_same_structure,
    flatten,
    flatten_with_paths,
    leaves,
    map,
    paths,
    register_dataclass,
    register_node,
    structure,
    unflatten,
)

__all__ = [
    "NAMESPACE",
    "PyTreeSpec",
    "assert_same_structure",
    "flatten",
    "flatten_with_paths",
    "leaves",
    "map",
    "paths",
    "register_dataclass",
    "register_node",
    "structure",
    "unflatten",
]
