"""The spec language of ``sg.shard``: a mesh with named axes, and how each leaf of
each argument is laid out over it.

A spec says, for one tensor, which mesh axes split which of its dims. ``P`` says it
directly, dim by dim (as JAX's ``PartitionSpec``); the strategies say it by rule:
``replicate()`` / ``ddp(axis)`` keep whole copies, ``fsdp(axis)`` stores a shard of
every parameter and gathers it for compute, ``tp(rules)`` splits the matmuls of
matching modules column- or row-wise. Strategies add up on a 2-D mesh:
``sg.fsdp("dp") + sg.tp({...})``.

Each leaf gets two layouts: where it is *stored* between steps (the placements of
the DTensor the step takes and returns) and where it is *computed* with (FSDP
stores ``Shard`` and computes ``Replicate``; everything else computes as stored).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optree
import torch

from . import tree
from .errors import ArgumentError, ArgumentTypeError

__all__ = [
    "P",
    "Spec",
    "Layout",
    "mesh",
    "replicate",
    "ddp",
    "fsdp",
    "tp",
    "distribute",
    "broadcast_specs",
    "layout_of",
    "fqns",
    "mesh_axes",
    "mark_none",
    "no_spec",
]

Placements = tuple[Any, ...]
TpStyle = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class Layout:
    """Where one leaf lives: its stored placements (the DTensor's) and the placements
    the step computes with (FSDP gathers its axis: ``Replicate`` there)."""

    mesh: Any
    stored: Placements
    compute: Placements


class Spec:
    """A rule giving each tensor leaf its placements on a mesh (see the module doc)."""

    def axes(self) -> tuple[str, ...]:
        """The mesh axis names this spec uses."""
        raise NotImplementedError

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        """For each axis this spec decides: the dim it splits (None: replicated), and
        whether compute gathers it."""
        raise NotImplementedError

    def __add__(self, other: Spec) -> Spec:
        if not isinstance(other, Spec):
            return NotImplemented
        return _Sum((self, other))


class P(Spec):
    """A partition spec: entry ``d`` names the mesh axis (or tuple of axes) splitting dim
    ``d``; ``None`` or a missing entry leaves the dim whole.

    Example:
        >>> sg.P("dp")            # dim 0 split over "dp": a data-parallel batch
        >>> sg.P(None, "tp")      # dim 1 split over "tp"
        >>> sg.P(("dp", "tp"))    # dim 0 split over both axes, "dp" outermost
    """

    def __init__(self, *dims: str | tuple[str, ...] | None) -> None:
        for d in dims:
            ok = d is None or isinstance(d, str) or (isinstance(d, tuple) and all(isinstance(a, str) for a in d))
            if not ok:
                raise ArgumentTypeError(
                    f"sg.P: each entry is a mesh axis name, a tuple of names, or None; found {d!r}."
                )
        self.dims: tuple[tuple[str, ...], ...] = tuple(
            () if d is None else (d,) if isinstance(d, str) else d for d in dims
        )
        seen = [a for d in self.dims for a in d]
        repeated = sorted({a for a in seen if seen.count(a) > 1})
        if repeated:
            raise ArgumentError(f"{self!r}: axis {repeated[0]!r} splits two dims; an axis can split one dim only.")

    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        return {a: (d, False) for d, axes in enumerate(self.dims) for a in axes}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and other.dims == self.dims

    def __hash__(self) -> int:
        return hash(("P", self.dims))

    def __repr__(self) -> str:
        parts = ["None" if not d else repr(d[0]) if len(d) == 1 else repr(d) for d in self.dims]
        return f"sg.P({', '.join(parts)})"


def _axes_of(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


@dataclass(frozen=True, eq=True)
class _Replicated(Spec):
    axis: str | None
    name: str

    def axes(self) -> tuple[str, ...]:
        return () if self.axis is None else (self.axis,)

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        return {a: (None, False) for a in (names if self.axis is None else (self.axis,))}

    def __repr__(self) -> str:
        return f"sg.{self.name}({'' if self.axis is None else repr(self.axis)})"


@dataclass(frozen=True, eq=True)
class _Fsdp(Spec):
    axis: str

    def axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        return {self.axis: (0 if shape else None, True)}

    def __repr__(self) -> str:
        return f"sg.fsdp({self.axis!r})"


@dataclass(frozen=True, eq=True)
class _Tp(Spec):
    rules: tuple[tuple[str, str], ...]
    axis: str

    def axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        module, _, name = fqn.rpartition(".")
        for pattern, style in self.rules:
            if fnmatch.fnmatchcase(module, pattern):
                return {self.axis: (_tp_dim(style, name, len(shape)), False)}
        return {self.axis: (None, False)}

    def __repr__(self) -> str:
        return f"sg.tp({dict(self.rules)!r}, axis={self.axis!r})"


def _tp_dim(style: str, name: str, ndim: int) -> int | None:
    """Column parallel splits a weight's output rows and its bias; row parallel splits
    the weight's input columns and keeps the bias whole (it is added after the sum)."""
    if ndim == 0:
        return None
    if style == "colwise":
        return 0
    return ndim - 1 if ndim >= 2 and name != "bias" else None


@dataclass(frozen=True, eq=True)
class _Sum(Spec):
    parts: tuple[Spec, ...]

    def axes(self) -> tuple[str, ...]:
        return tuple(a for p in self.parts for a in p.axes())

    def assign(self, names: Sequence[str], fqn: str, shape: Sequence[int]) -> dict[str, tuple[int | None, bool]]:
        """FSDP goes last: it splits the first dim the other parts leave whole (or
        keeps the leaf replicated on its axis when there is none)."""
        found: dict[str, tuple[int | None, bool]] = {}
        for part in sorted(self.parts, key=lambda p: isinstance(p, _Fsdp)):
            if isinstance(part, _Fsdp):
                taken = {d for d, _ in found.values() if d is not None}
                free = [d for d in range(len(shape)) if d not in taken]
                found[part.axis] = (free[0] if free else None, True)
            else:
                found.update(part.assign(names, fqn, shape))
        return found

    def __add__(self, other: Spec) -> Spec:
        if not isinstance(other, Spec):
            return NotImplemented
        return _Sum(self.parts + (other,))

    def __repr__(self) -> str:
        return " + ".join(repr(p) for p in self.parts)


def replicate() -> Spec:
    """Every leaf whole on every rank (the default for arguments without a spec)."""
    return _Replicated(None, "replicate")


def ddp(axis: str) -> Spec:
    """Data parallel parameters: whole on every rank of ``axis``; their gradients are
    summed over it (pair with ``batch=sg.P(axis)``)."""
    _check_axis_name("sg.ddp", axis)
    return _Replicated(axis, "ddp")


def fsdp(axis: str) -> Spec:
    """Fully sharded parameters: each stored split over ``axis`` along its first dim
    (the first dim another strategy leaves whole), gathered for compute; gradients are
    reduce-scattered back to the shards, and the optimizer updates shards only."""
    _check_axis_name("sg.fsdp", axis)
    return _Fsdp(axis)


def tp(rules: Mapping[str, TpStyle], axis: str = "tp") -> Spec:
    """Tensor parallel linear layers by module path pattern: ``"colwise"`` splits a
    weight's output rows (and its bias), ``"rowwise"`` its input columns.

    Example:
        >>> sg.tp({"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
    """
    _check_axis_name("sg.tp", axis)
    if not isinstance(rules, Mapping) or not rules:
        raise ArgumentTypeError(
            f'sg.tp: rules must be a non-empty dict {{"module.path.*": "colwise"}}; found {rules!r}.'
        )
    for pattern, style in rules.items():
        if not isinstance(pattern, str) or style not in ("colwise", "rowwise"):
            raise ArgumentError(
                f'sg.tp: rule {pattern!r}: {style!r} must be "colwise" or "rowwise" (keys are module path patterns).'
            )
    return _Tp(tuple(rules.items()), axis)


def _check_axis_name(api: str, axis: Any) -> None:
    if not isinstance(axis, str):
        raise ArgumentTypeError(f"{api}: axis must be a mesh axis name (a str); found {axis!r}.")


# --------------------------------------------------------------------------- meshes


def mesh(shape: Mapping[str, int] | None = None, /, *, device_type: str | None = None, **axes: int) -> Any:
    """A device mesh with named axes over the processes of the default process group.

    Args:
        shape: ``{"dp": 2, "tp": 4}`` (or the same as keywords, ``sg.mesh(dp=2, tp=4)``);
            the sizes multiply to the world size.
        device_type: ``"cuda"`` when a GPU is present, else ``"cpu"``, by default.

    Returns:
        A torch ``DeviceMesh`` (any ``DeviceMesh`` with named axes is accepted as is).

    Example:
        >>> mesh = sg.mesh(dp=torch.distributed.get_world_size())
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sizes = dict(shape or {}) | axes
    if not sizes or not all(isinstance(k, str) and isinstance(v, int) and v > 0 for k, v in sizes.items()):
        raise ArgumentError(f"sg.mesh: give named axis sizes, e.g. sg.mesh(dp=2, tp=4); found {sizes!r}.")
    if not dist.is_initialized():
        raise ArgumentError(
            "sg.mesh: torch.distributed is not initialized. Start the processes with torchrun (or "
            "torch.multiprocessing) and call torch.distributed.init_process_group() first; a single "
            "process can use init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())."
        )
    world = dist.get_world_size()
    total = 1
    for v in sizes.values():
        total *= v
    if total != world:
        raise ArgumentError(f"sg.mesh: axis sizes {sizes} make {total} ranks, but the world has {world}.")
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(kind, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def mesh_axes(device_mesh: Any, api: str) -> tuple[str, ...]:
    """The mesh's axis names; an unnamed mesh is refused (specs name axes)."""
    names = getattr(device_mesh, "mesh_dim_names", None)
    if not names:
        raise ArgumentError(
            f"{api}: the mesh has no axis names; make it with sg.mesh(dp=...) or "
            "init_device_mesh(..., mesh_dim_names=(...))."
        )
    return tuple(names)


# --------------------------------------------------------------------------- leaves


def broadcast_specs(api: str, name: str, spec: Any, value: Any) -> list[Spec | None]:
    """One spec per leaf of ``value``: ``spec`` is a prefix of its structure (a dict or
    list of specs may match a dict or list of subtrees); ``None`` means no spec.

    Raises:
        ArgumentError: ``spec`` does not match the structure of ``value``.
    """
    if isinstance(spec, Spec) or spec is None:
        return [spec] * len(tree.leaves(value))
    marked = mark_none(spec)
    try:
        full = optree.tree_broadcast_prefix(marked, value, namespace=tree.NAMESPACE, is_leaf=_is_spec_leaf)
    except ValueError as e:
        raise ArgumentError(
            f"{api}: the spec for {name} is not a prefix of its structure ({e}). Give one spec for the "
            "whole argument, or a dict/list of specs with the argument's keys."
        ) from None
    leaves = tree.leaves(full)
    bad = [s for s in leaves if not isinstance(s, (Spec, _NoSpec))]
    if bad:
        raise ArgumentTypeError(f"{api}: the spec for {name} holds {bad[0]!r}, which is not a spec (sg.P, sg.fsdp...).")
    return [None if isinstance(s, _NoSpec) else s for s in leaves]


class _NoSpec:
    def __repr__(self) -> str:
        return "None"


_NO_SPEC = _NoSpec()


def mark_none(spec: Any) -> Any:
    """A spec tree with ``None`` (no spec) as a leaf that pytrees keep."""
    if spec is None:
        return _NO_SPEC
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Mapping):
        return {k: mark_none(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)) and not hasattr(spec, "_fields"):
        return type(spec)(mark_none(v) for v in spec)
    return spec


def no_spec(x: Any) -> bool:
    """Whether a leaf of :func:`mark_none`'s tree stands for ``None``."""
    return isinstance(x, _NoSpec)


def _is_spec_leaf(x: Any) -> bool:
    return isinstance(x, (Spec, _NoSpec))


def layout_of(
    api: str, spec: Spec | None, device_mesh: Any, path: str, shape: Sequence[int], fqn: str, *, whole: bool = True
) -> Layout:
    """The placements ``spec`` gives one leaf (``None``: replicated everywhere).
    ``shape`` is the whole tensor's (``whole``) or one rank's shard of it.

    Raises:
        ArgumentError: the spec splits a dim the leaf does not have, or one whose size
            the axes do not divide (named by ``path``).
    """
    from torch.distributed.tensor import Replicate, Shard

    names = mesh_axes(device_mesh, api)
    chosen = {} if spec is None else spec.assign(names, fqn, shape)
    stored, compute = [], []
    for axis in names:
        dim, gathered = chosen.get(axis, (None, False))
        if dim is not None and dim >= len(shape):
            raise ArgumentError(
                f"{api}: {path} has {len(shape)} dims, but its spec {spec!r} splits dim {dim} over {axis!r}. "
                f"Give {path.split('[')[0]} a spec with fewer entries (or a dict of specs per leaf)."
            )
        place = Replicate() if dim is None else Shard(dim)
        stored.append(place)
        compute.append(Replicate() if gathered else place)
    if whole:
        _check_divisible(api, spec, device_mesh, names, stored, path, shape)
    return Layout(device_mesh, tuple(stored), tuple(compute))


def _check_divisible(
    api: str, spec: Any, device_mesh: Any, names: Sequence[str], stored: Sequence[Any], path: str, shape: Sequence[int]
) -> None:
    if not isinstance(spec, P):
        return  # strategies accept uneven shards (the last ranks hold fewer rows)
    split: dict[int, int] = {}
    for axis, place in zip(names, stored):
        dim = getattr(place, "dim", None)
        if dim is not None:
            split[dim] = split.get(dim, 1) * device_mesh.size(names.index(axis))
    for dim, ways in split.items():
        if shape[dim] % ways:
            raise ArgumentError(
                f"{api}: {path} has size {shape[dim]} in dim {dim}, which {spec!r} splits {ways} ways; "
                f"it must be a multiple of {ways} (pad it, or change the spec)."
            )


def distribute(value: Any, device_mesh: Any, spec: Any = None) -> Any:
    """Make DTensors of full tensors: each rank keeps a copy of its own piece (no
    communication: every rank must hold the same full values, as after seeding the
    same init).

    Args:
        value: a pytree of full tensors (e.g. ``params``).
        device_mesh: the mesh.
        spec: a spec or a prefix tree of specs, as ``sg.shard`` takes; ``None`` replicates.

    Returns:
        The same pytree with DTensor leaves (non-tensor leaves unchanged).

    Example:
        >>> params = sg.distribute(params, mesh, sg.fsdp("dp"))
    """
    from torch.distributed.tensor import distribute_tensor

    api = "sg.distribute"
    paths, leaves, treedef = tree.flatten_with_paths(value, prefix="value")
    specs = broadcast_specs(api, "value", spec, value)
    out = []
    for path, fqn, leaf, leaf_spec in zip(paths, fqns(value), leaves, specs):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        layout = layout_of(api, leaf_spec, device_mesh, path, tuple(leaf.shape), fqn)
        placed: Any = distribute_tensor(leaf.detach(), device_mesh, layout.stored, src_data_rank=None)
        if placed._local_tensor.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr():
            placed = placed.clone()  # its own memory: a donated step must not write into the caller's tensor
        out.append(placed)
    return tree.unflatten(treedef, out)


def fqns(value: Any) -> list[str]:
    """Each leaf's keys and indices joined by dots, as module paths are written:
    ``{"blocks.0.fc.weight": w}`` -> ``blocks.0.fc.weight``; ``(s, {"mu": {"w": m}})`` -> ``1.mu.w``."""
    paths, _, _ = optree.tree_flatten_with_path(value, namespace=tree.NAMESPACE)
    return [".".join(str(k) for k in path) for path in paths]
