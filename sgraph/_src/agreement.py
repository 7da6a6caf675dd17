"""Before a sharded step's first collective, its ranks agree on what they run.

Ranks that compiled different programs (other shapes, other code, other control
flow) would issue different collectives and wait on each other forever. So on its
first call each rank publishes a hash of its program's inputs and collectives (the
rest may differ by rank: each rank slices its own shard), the shapes each collective
sends, and checksums of the inputs it holds as replicated, through the process
group's store, and waits (with a timeout) for all the others. All ranks must run the
same collectives in the same order; the shapes need only agree among the ranks of
each collective's group (on a 2-D mesh, a shard uneven along one axis is a row of
other shapes than the next row's, whose collectives never meet its own). A
difference raises on every rank, naming it; a rank that never arrives is named when
the timeout ends.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx

from .capture import SOURCE_KEY
from .dtensors import is_dtensor
from .errors import CaptureError
from .passes.shard.collectives import Collective, collectives, group_ranks
from .program import Program
from .text import describe_tensor

__all__ = ["agree", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
"""Seconds the ranks wait for each other at a sharded step's first call, by default."""
_ROUNDS: dict[str, int] = {}


def agree(
    program: Program, tensors: Sequence[torch.Tensor], timeout: datetime.timedelta = datetime.timedelta(seconds=300)
) -> None:
    """Raise on every rank unless all ranks compiled the same program and hold the
    same values where they hold replicated inputs.

    Args:
        program: this rank's lowered program.
        tensors: the first call's tensor leaves (DTensors included).
        timeout: how long to wait for the other ranks.

    Raises:
        CaptureError: the programs or the replicated inputs differ between ranks, or a
            rank did not arrive within ``timeout``.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"sgraph/agree/{program.name}/{_next_round(program.name)}"
    found = collectives(program.graph)
    inputs, ops, sent = _input_lines(program), _collective_lines(found, shapes=False), _collective_lines(found)
    mine = {
        "hash": _hash(inputs + ops),
        "inputs": inputs,
        "ops": ops,
        "sent": sent,
        "groups": [group_ranks(c.group) for c in found],
        "replicated": _checksums(program, tensors),
    }
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    everyone = _gather(store, prefix, world, timeout, program.name)
    message = _difference(program.name, everyone)
    if message is not None:
        raise CaptureError(message)


def _next_round(name: str) -> int:
    _ROUNDS[name] = _ROUNDS.get(name, 0) + 1
    return _ROUNDS[name]


def _hash(lines: list[str]) -> str:
    text = "\n".join(lines)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _collective_lines(found: Sequence[Collective], *, shapes: bool = True) -> list[str]:
    """The collectives in order: kind, group size and (with ``shapes``) the shapes each
    rank sends and gets (not the group's name: the ranks of each row of a 2-D mesh have
    groups of their own)."""
    lines = []
    for c in found:
        source = c.node.meta.get(SOURCE_KEY)
        where = f" at {source.short()}" if source is not None else ""
        sent = f": {_shape(c.node.args[0])} -> {_shape(c.node)}" if shapes else ""
        lines.append(f"{c.kind} over {c.size} ranks{sent}{where}")
    return lines


def _shape(value: Any) -> str:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return describe_tensor(val.dtype, tuple(val.shape))
    return "?"


def _input_lines(program: Program) -> list[str]:
    """Each input; a DTensor by its global shape (uneven shards differ by rank)."""
    return [
        f"{leaf.path}: {leaf.dtype} {leaf.dist.describe()}"
        if leaf.dist is not None
        else f"{leaf.path}: {leaf.describe()}"
        for leaf in program.inputs
    ]


def _checksums(program: Program, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """For each input replicated over some mesh axes (a DTensor, or this rank's shard of
    one), the bits of a few sums of this rank's piece, with the rank's coordinates on the
    other axes: ranks whose coordinates agree there must hold the same piece."""
    found = {}
    for leaf, t in zip(program.tensor_inputs, cast(Sequence[Any], tensors)):
        if not is_dtensor(t):
            continue
        split = [p.is_shard() or p.is_partial() for p in t.placements]
        if all(split):
            continue
        coordinate = t.device_mesh.get_coordinate()
        x = t._local_tensor.detach()
        x = x.double() if x.is_floating_point() or x.is_complex() else x.long()
        found[leaf.path] = {
            "where": [c if s else None for c, s in zip(coordinate, split)],
            "axes": [name for name, s in zip(t.device_mesh.mesh_dim_names or (), split) if not s],
            "sums": repr((x.sum().item(), x.abs().sum().item())),
        }
    return found


def _gather(
    store: Any, prefix: str, world: int, timeout: datetime.timedelta, name: str, *, decode: bool = True
) -> list[Any]:
    keys = [f"{prefix}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store.wait(keys, datetime.timedelta(seconds=max(1.0, min(10.0, deadline - time.monotonic()))))
            break
        except RuntimeError:  # the store's timeout: name who is missing, once the deadline passes
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise CaptureError(
                    f"{name}: ranks {missing} did not reach this step's first call within "
                    f"{timeout.total_seconds():.0f} s, so its collectives would hang. Every rank must call "
                    "the sharded step the same number of times, with the same signature."
                ) from None
    values = [store.get(k).decode() for k in keys]
    return [json.loads(v) for v in values] if decode else values


def _difference(name: str, everyone: list[dict[str, Any]]) -> str | None:
    first = everyone[0]
    for rank, other in enumerate(everyone):
        if other["hash"] != first["hash"]:
            lines = _first_different(first["inputs"], other["inputs"])
            where = (
                f" First difference in the inputs: rank 0 has {lines[0]!r}, rank {rank} has {lines[1]!r}."
                if lines
                else ""
            )
            return (
                f"{name}: rank 0 and rank {rank} compiled different programs, so their collectives would not "
                f"match and the step would hang.{where} Every rank must trace the step with the same shapes "
                f"and the same code path.{_code_difference(first, other, rank)}"
            )
    for rank, other in enumerate(everyone):
        for i, (line, group) in enumerate(zip(other["sent"], other["groups"])):
            peer = min(group)
            if everyone[peer]["sent"][i] != line:
                return (
                    f"{name}: ranks {peer} and {rank} run collective {i} of the step together, but with other "
                    f"shapes, so the step would hang or exchange wrong data: rank {peer} runs "
                    f"{everyone[peer]['sent'][i]!r}, rank {rank} runs {line!r}. Every rank must trace the step "
                    "with the same shapes."
                )
    holders: dict[tuple[str, str], int] = {}
    for rank, other in enumerate(everyone):
        for path, held in other["replicated"].items():
            peer = holders.setdefault((path, repr(held["where"])), rank)
            if everyone[peer]["replicated"][path]["sums"] != held["sums"]:
                axes = ", ".join(repr(a) for a in held["axes"])
                over = "(the same on every rank)" if all(w is None for w in held["where"]) else f"over mesh axes {axes}"
                return (
                    f"{name}: {path} is replicated {over} by its spec, but rank {rank} "
                    f"holds other values than rank {peer}. Give it a spec that shards it (a per-rank batch: "
                    "batch=sg.P('dp'), or sg.P(('dp', 'tp')) to split it over both axes), or pass the same "
                    "values on those ranks."
                )
    return None


def _code_difference(first: dict[str, Any], other: dict[str, Any], rank: int) -> str:
    """The first collective two ranks' programs differ in (shapes aside), with its shapes."""
    i = _first_index(first["ops"], other["ops"])
    if i is None:
        return ""
    a, b = (s["sent"][i] if i < len(s["sent"]) else "<end>" for s in (first, other))
    return f" First differing collective: rank 0 runs {a!r}, rank {rank} runs {b!r}."


def _first_different(a: Sequence[str], b: Sequence[str]) -> tuple[str, str] | None:
    i = _first_index(a, b)
    if i is None:
        return None
    return (a[i] if i < len(a) else "<end>", b[i] if i < len(b) else "<end>")


def _first_index(a: Sequence[str], b: Sequence[str]) -> int | None:
    """Where two lists of lines first differ (the shorter one's end counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
