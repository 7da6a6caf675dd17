"""``sg.shard``'s options, and how a sharded step's arguments are laid out on each call.

The spec language itself (meshes, ``P``, the strategies, the placements a spec gives
one leaf) is in :mod:`sharding`; this module applies it to a step's arguments:
plain tensors become DTensors of their specs' placements, DTensors are checked
against them, and outputs get the placements the ``out`` spec asks.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import tree
from .dtensors import is_dtensor, local
from .errors import ArgumentError, ArgumentTypeError
from .sharding import (
    Layout,
    Spec,
    broadcast_specs,
    fqns,
    layout_of,
    mark_none,
    mesh_axes,
    no_spec,
)

__all__ = ["ShardOptions", "Sharder", "check_shard_options", "check_spec_names", "check_specs"]


@dataclass(frozen=True, eq=False)
class ShardOptions:
    """Options of ``sg.shard``; see its docstring. ``specs`` maps argument names to
    spec trees; ``out`` is a spec tree over the step's result (None: outputs follow
    the inputs they match); ``links`` the cost model's links (None: the defaults);
    ``bucket_bytes`` the bucket size (None: from the links); ``timeout`` seconds;
    ``reshard_after_forward``: gather FSDP's parameters again for the backward."""

    mesh: Any
    specs: tuple[tuple[str, Any], ...] = ()
    out: Any = None
    links: Any = None  # a passes.shard.cost.Links
    bucket_bytes: int | None = None
    timeout: float = 300.0
    reshard_after_forward: bool = True


def check_specs(api: str, device_mesh: Any, name: str, spec: Any) -> None:
    """Raise for a spec tree holding something that is not a spec, or naming an axis
    the mesh does not have (the message gives the spec's path)."""
    names = mesh_axes(device_mesh, api)
    paths, leaves, _ = tree.flatten_with_paths(mark_none(spec), prefix=name)
    for path, leaf in zip(paths, leaves):
        if no_spec(leaf):
            continue
        if not isinstance(leaf, Spec):
            raise ArgumentTypeError(
                f"{api}: {path} is {leaf!r}, not a spec: give sg.P(...), sg.replicate(), sg.ddp(axis), "
                "sg.fsdp(axis), sg.tp(rules), a sum of them, or a dict/list of specs."
            )
        for axis in leaf.axes():
            if axis not in names:
                close = [n for n in names if n.lower() == axis.lower()] or list(names)
                raise ArgumentError(
                    f"{api}: {path}: {leaf!r} names mesh axis {axis!r}, which the mesh does not have "
                    f"(its axes: {', '.join(repr(n) for n in names)}). Did you mean {close[0]!r}?"
                )


class Sharder:
    """Lays out a sharded step's arguments: plain tensors become DTensors of the specs'
    placements (a plain tensor is this rank's shard, as a data loader gives it; a
    replicated one must be the same on every rank), DTensors are checked against them.

    Arguments without a spec follow ``params``: a leaf whose path ends with a
    parameter's name and whose shape is that parameter's (optimizer moments) is laid
    out like the parameter; other plain tensors are replicated, other DTensors kept
    as they are.
    """

    def __init__(self, api: str, options: ShardOptions) -> None:
        self.api = api
        self.mesh = options.mesh
        self.specs = dict(options.specs)
        self.out = options.out
        self._cache: dict[Any, list[Layout | None]] = {}

    def place(self, named: Sequence[tuple[str, Any]]) -> list[Any]:
        """Each ``(argument name, value)`` with its plain tensors made DTensors. Runs on
        every call: an argument holding only DTensors costs a flatten; the layouts of
        one holding plain tensors are computed once per structure and shapes."""
        from torch.distributed.tensor import DTensor

        placed = []
        for name, value in named:
            leaves, treedef = tree.flatten(value)
            if not any(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in leaves):
                placed.append(value)
                continue
            key = (name, treedef, tuple(_leaf_key(x) for x in leaves))
            layouts = self._cache.get(key)
            if layouts is None:
                layouts = self._cache[key] = self._arg_layouts(name, value, named)
            out = [
                DTensor.from_local(x, self.mesh, lay.stored, run_check=False)
                if isinstance(x, torch.Tensor) and not is_dtensor(x) and lay is not None
                else x
                for x, lay in zip(leaves, layouts)
            ]
            placed.append(tree.unflatten(treedef, out))
        return placed

    def compute(self, named: Sequence[tuple[str, Any]]) -> list[Any]:
        """Per leaf of all arguments (flattening order): the compute placements where
        they differ from the stored ones, else None. Checks DTensors against the specs."""
        found: list[Any] = []
        for name, value, layouts in self._layouts(named):
            paths, leaves, _ = tree.flatten_with_paths(value, prefix=name)
            for path, leaf, lay in zip(paths, leaves, layouts):
                if lay is not None and is_dtensor(leaf):
                    self._check_dtensor(path, leaf, lay)
                found.append(lay.compute if lay is not None and lay.compute != lay.stored else None)
        return found

    def out_layout(self) -> Callable[[Any], list[Any]] | None:
        """The placements of the step's DTensor outputs from the ``out`` spec (None
        without one: outputs then follow the inputs they match; so does each output whose
        spec in it is ``None``, which gets None here)."""
        if self.out is None:
            return None

        def targets(result: Any) -> list[Any]:
            specs = broadcast_specs(self.api, "the result (out=)", self.out, result)
            paths, leaves, _ = tree.flatten_with_paths(result, prefix="result")
            return [
                layout_of(self.api, s, self.mesh, path, tuple(leaf.shape), fqn).stored
                if is_dtensor(leaf) and s is not None
                else None
                for path, fqn, leaf, s in zip(paths, fqns(result), leaves, specs)
            ]

        return targets

    def _layouts(self, named: Sequence[tuple[str, Any]]) -> list[tuple[str, Any, list[Layout | None]]]:
        return [(name, value, self._arg_layouts(name, value, named)) for name, value in named]

    def _arg_layouts(self, name: str, value: Any, named: Sequence[tuple[str, Any]]) -> list[Layout | None]:
        if name in self.specs:
            return self._of_spec(name, value, self.specs[name])
        params = dict(named).get("params")
        follow = self._param_layouts(params) if "params" in self.specs and params is not None else {}
        return [
            _followed(fqn, leaf, follow) or (None if is_dtensor(leaf) else self._replicated(leaf))
            for fqn, leaf in zip(fqns(value), tree.leaves(value))
        ]

    def _of_spec(self, name: str, value: Any, spec: Any) -> list[Layout | None]:
        specs = broadcast_specs(self.api, name, spec, value)
        paths, leaves, _ = tree.flatten_with_paths(value, prefix=name)
        return [
            layout_of(self.api, s, self.mesh, path, tuple(leaf.shape), fqn, whole=is_dtensor(leaf))
            if isinstance(leaf, torch.Tensor)
            else None
            for path, fqn, leaf, s in zip(paths, fqns(value), leaves, specs)
        ]

    def _param_layouts(self, params: Any) -> dict[str, tuple[tuple[int, ...], Layout | None]]:
        layouts = self._of_spec("params", params, self.specs["params"])
        return {
            fqn: (tuple(local(leaf).shape), lay)
            for fqn, leaf, lay in zip(fqns(params), tree.leaves(params), layouts)
            if isinstance(leaf, torch.Tensor)
        }

    def _replicated(self, leaf: Any) -> Layout | None:
        if not isinstance(leaf, torch.Tensor):
            return None
        return layout_of(self.api, None, self.mesh, "", tuple(leaf.shape), "")

    def _check_dtensor(self, path: str, leaf: Any, lay: Layout) -> None:
        if leaf.device_mesh != self.mesh or tuple(leaf.placements) != lay.stored:
            raise ArgumentError(
                f"{self.api}: {path} is a DTensor placed {tuple(leaf.placements)} on mesh "
                f"{leaf.device_mesh}, but its spec asks {lay.stored} on {self.mesh}. Pass it laid out as "
                "the spec says (x.redistribute(mesh, placements), or sg.distribute for full tensors), "
                "or change the spec."
            )


def _leaf_key(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return None
    return (is_dtensor(x), tuple(local(x).shape), x.dtype)


def _followed(fqn: str, leaf: Any, params: Mapping[str, tuple[tuple[int, ...], Layout | None]]) -> Layout | None:
    if not isinstance(leaf, torch.Tensor):
        return None
    shape = tuple(local(leaf).shape)
    best, length = None, -1
    for name, (param_shape, lay) in params.items():
        matches = fqn == name or fqn.endswith("." + name)
        if matches and param_shape == shape and len(name) > length:
            best, length = lay, len(name)
    return best


def check_shard_options(api: str, links: Any, bucket_bytes: Any, timeout: Any) -> None:
    """Raise for a bad ``links``, ``bucket_bytes`` or ``timeout`` of ``sg.shard``."""
    from .passes.shard.cost import Links

    if links is not None and not isinstance(links, Links):
        raise ArgumentTypeError(f"{api}: links must be an sg.Links(...); found {links!r}.")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)):
        raise ArgumentTypeError(f"{api}: bucket_bytes must be an int (0 turns bucketing off); found {bucket_bytes!r}.")
    if bucket_bytes is not None and bucket_bytes < 0:
        raise ArgumentError(f"{api}: bucket_bytes must be >= 0 (0 turns bucketing off); found {bucket_bytes}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ArgumentError(f"{api}: timeout must be a positive number of seconds; found {timeout!r}.")


def check_spec_names(api: str, fn: Callable[..., Any], specs: dict[str, Any]) -> None:
    """Raise for a spec keyword that names no parameter of the step."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for name in specs:
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f" Did you mean {close[0]}=?" if close else ""
            raise ArgumentError(
                f"{api}: {name}= names no parameter of the step (its parameters: {', '.join(params)}).{hint}"
            )
