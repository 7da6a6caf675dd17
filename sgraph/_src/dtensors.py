"""DTensors across the step boundary.

A compiled step runs on local tensors: a DTensor argument enters the graph as its
local shard, and the traced function rebuilds the DTensor from that shard (with
its mesh, placements and global shape), so DTensor's propagation turns the user's
global-view code into local ops and collectives. Outputs leave the trace as local
shards, laid out as the step's result asks, and become DTensors again after each run.

FSDP stores a shard and computes with the whole tensor: the rebuilt DTensors that
FSDP gathers are noted here, and ``sg.grad`` differentiates through the gather
(:func:`for_compute`), so the gradient comes back to the shard as a reduce-scatter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import optree
import torch

from . import tree

__all__ = [
    "DistInfo",
    "OutLayout",
    "dist_info",
    "is_dtensor",
    "for_compute",
    "rebuild",
    "compute_scope",
    "compute_table",
    "like",
    "local",
    "matching_layout",
    "wrap",
]


@dataclass(frozen=True)
class DistInfo:
    """How a local shard is a DTensor: its mesh, placements, global shape and stride."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def describe(self) -> str:
        places = ", ".join(_placement_text(p) for p in self.placements)
        return f"DTensor[{places}] of global shape {list(self.shape)}"


def _placement_text(p: Any) -> str:
    dim = getattr(p, "dim", None)
    return f"Shard({dim})" if dim is not None else type(p).__name__ + "()"


def is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "_spec")


def dist_info(x: Any) -> DistInfo:
    """The layout of DTensor ``x``."""
    return DistInfo(x.device_mesh, tuple(x.placements), tuple(x.shape), tuple(x.stride()))


def local(x: Any) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is returned as is)."""
    return x._local_tensor if is_dtensor(x) else x


def rebuild(shard: torch.Tensor, info: DistInfo) -> Any:
    """The DTensor whose local shard is ``shard`` (no communication, no check)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard, info.mesh, info.placements, run_check=False, shape=torch.Size(info.shape), stride=info.stride
    )


def wrap(shards: list[Any], infos: Sequence[DistInfo | None], specs: list[Any], *, skip: Container[int] = ()) -> None:
    """Make ``shards[i]`` the DTensor ``infos[i]`` describes, in place, where it is not
    None and ``i`` not in ``skip``. ``specs`` caches each output's DTensor spec: after
    the first call a DTensor is made straight from it (what DTensor's own ops do),
    without ``from_local``'s autograd function, which costs tens of microseconds."""
    from torch.distributed.tensor import DTensor

    for i, info in enumerate(infos):
        if info is None or i in skip:
            continue
        if specs[i] is None:
            shards[i] = rebuild(shards[i], info)
            specs[i] = shards[i]._spec
        else:
            shards[i] = DTensor(shards[i], specs[i], requires_grad=False)


_COMPUTE = threading.local()


@contextmanager
def compute_scope() -> Iterator[dict[int, tuple[Any, ...]]]:
    """While tracing: a map from rebuilt input DTensors (by id) to the placements the
    step computes them with, where those differ from how they are stored."""
    previous = getattr(_COMPUTE, "table", None)
    table: dict[int, tuple[Any, ...]] = {}
    _COMPUTE.table = table
    try:
        yield table
    finally:
        _COMPUTE.table = previous


_SHIFTS = {
    "__rshift__.Scalar": "bitwise_right_shift.Tensor_Scalar",
    "__rshift__.Tensor": "bitwise_right_shift.Tensor",
    "__lshift__.Scalar": "bitwise_left_shift.Tensor_Scalar",
    "__lshift__.Tensor": "bitwise_left_shift.Tensor",
}


def _aten(name: str) -> Any:
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


@contextmanager
def exact_shifts() -> Iterator[None]:
    """While tracing: ``x >> n`` and ``x << n`` on DTensors compute the shift.

    DTensor takes an op whose schema name ends in ``_`` for an in-place one, and
    ``aten::__rshift__`` / ``aten::__lshift__`` do: it returned the input unchanged
    (a key folded with a sharded step's counter, ``(c >> 32) & mask``, was wrong, and
    sg.random's draws from a key passed in collapsed to a few values). Their
    ``bitwise_*_shift`` twins compute the same thing and are dispatched as what they are.
    """
    try:
        from torch.distributed.tensor import DTensor

        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        yield
        return
    ops = {_aten(name): _aten(twin) for name, twin in _SHIFTS.items()}
    added = [op for op in ops if op not in handlers]
    for op in added:
        handlers[op] = functools.partial(_shift, ops[op])
    try:
        yield
    finally:
        for op in added:
            handlers.pop(op, None)


def _shift(twin: Any, call: Any, args: Any, kwargs: Any) -> Any:
    return twin(*args, **kwargs)


def for_compute(original: Any, watched: Any) -> Any:
    """``watched`` (``sg.grad``'s differentiable copy of leaf ``original``) laid out for
    compute: gathered where ``original`` is an FSDP-stored input, else unchanged."""
    table = getattr(_COMPUTE, "table", None)
    if not table or id(original) not in table:
        return watched
    return watched.redistribute(watched.device_mesh, table[id(original)])


def like(grad: Any, leaf: Any) -> Any:
    """A DTensor gradient laid out as its leaf: pending sums over ranks (DDP's ``Partial``
    gradients) are carried out once here, not again at every use in the update.

    Over a mesh dim where the leaf itself is a pending sum (``t @ t`` of a split ``t``),
    the gradient is whole: each rank's part of the sum has the sum's gradient.
    """
    if not is_dtensor(grad) or not is_dtensor(leaf):
        return grad
    from torch.distributed.tensor import Partial, Replicate

    target = tuple(Replicate() if isinstance(p, Partial) else p for p in leaf.placements)
    if tuple(grad.placements) == target:
        return grad
    return grad.redistribute(leaf.device_mesh, target)


OutLayout = Callable[[Any], list[Any]]
"""Given the step's result, the placements each of its leaves leaves the step with
(entries for non-DTensor leaves are ignored)."""


def compute_table() -> dict[int, tuple[Any, ...]]:
    """The table of the :func:`compute_scope` being traced."""
    table = getattr(_COMPUTE, "table", None)
    return {} if table is None else table


def matching_layout(in_leaves: Sequence[Any], in_spec: Any) -> OutLayout:
    """Outputs laid out like the inputs they match, partial sums summed.

    A DTensor output matches a DTensor input of the same mesh and global shape whose
    path inside its argument ends the output's path: ``result[0]['fc.weight']``
    matches ``params['fc.weight']``, ``result[1].mu['fc.weight']`` matches
    ``opt_state.mu['fc.weight']`` (the longest such path wins). So new params and
    optimizer state come back stored as they came in, ready for the next call, and
    a donated input's shard can take its output. Other outputs keep their layout,
    except that a pending sum over ranks (``Partial``) is carried out (``Replicate``).
    """
    candidates = [
        (tuple(path[2:]), dist_info(leaf))
        for path, leaf in zip(in_spec.paths(), in_leaves)
        if is_dtensor(leaf) and len(path) > 2
    ]

    def targets(out: Any) -> list[Any]:
        from torch.distributed.tensor import Partial, Replicate

        paths, leaves, _ = optree.tree_flatten_with_path(out, namespace=tree.NAMESPACE)
        found: list[Any] = []
        for path, leaf in zip(paths, leaves):
            if not is_dtensor(leaf):
                found.append(None)
                continue
            best = _best_match(tuple(path), leaf, candidates)
            found.append(best or tuple(Replicate() if isinstance(p, Partial) else p for p in leaf.placements))
        return found

    return targets


def _best_match(path: tuple[Any, ...], leaf: Any, candidates: Sequence[tuple[tuple[Any, ...], DistInfo]]) -> Any:
    best, length = None, 0
    for in_path, info in candidates:
        n = len(in_path)
        if n > length and path[-n:] == in_path and info.shape == tuple(leaf.shape) and info.mesh == leaf.device_mesh:
            best, length = info.placements, n
    return best
