"""Bucketing: many small collectives of one kind and group become a few large ones.

A collective costs a fixed latency (launch, synchronisation) on top of its bytes over
the link's bandwidth. A data-parallel step traces into one all-reduce (DDP) or one
all-gather and one reduce-scatter (FSDP) per parameter, so small parameters pay mostly
latency. Merging collectives that are independent of each other pays it once per
bucket, for a copy into and out of the bucket's buffer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx
from torch.fx import Node

from ...capture import SOURCE_KEY
from ...program import Program, alias_root, written_args
from .collectives import Collective, add_call, collectives

__all__ = ["bucket", "default_bucket_bytes"]

_MIB = 1 << 20
_SMALLEST, _LARGEST = _MIB, 256 * _MIB

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_MERGEABLE = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)


def default_bucket_bytes(alpha_seconds: float, bytes_per_second: float) -> int:
    """The bucket size at which latency is at most about 10% of a collective's time.

    In the alpha-beta model a collective of ``n`` bytes takes ``T(n) = alpha + n / beta``
    (``alpha`` its latency, ``beta`` the bandwidth in bytes per second). Latency is at
    most a tenth of ``T(n)`` when ``alpha <= 0.1 * (alpha + n / beta)``, that is when
    ``n >= 9 * alpha * beta``. The result is that ``n``, rounded, clamped to
    [1 MiB, 256 MiB]: below 1 MiB a bucket saves nothing measurable, above 256 MiB it
    delays the first overlap and costs as much memory again.

    Args:
        alpha_seconds: one collective's latency, in seconds.
        bytes_per_second: the bandwidth a collective sees, in bytes per second.

    Returns:
        The bucket size in bytes, for :func:`bucket`.

    Example:
        >>> default_bucket_bytes(10e-6, 100e9)  # 10 us, 100 GB/s
        9000000
    """
    for name, value in (("alpha_seconds", alpha_seconds), ("bytes_per_second", bytes_per_second)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            raise ValueError(f"default_bucket_bytes: {name} must be a positive finite number, found {value!r}")
    return min(max(round(9 * alpha_seconds * bytes_per_second), _SMALLEST), _LARGEST)


def bucket(program: Program, bucket_bytes: int) -> Program:
    """Merge independent collectives of one kind, group, dtype and reduce op into buckets.

    Collectives are taken in program order, greedily: one joins the open bucket of
    its kind (and of its half of the step: a forward collective never merges with a
    backward one, which would run the backward's at the forward's place, and keep its
    result alive from there) unless the bucket would pass ``bucket_bytes`` (the larger of one rank's
    input and output bytes, summed), or its input depends on a member's result (the
    merged collective could then not run before itself), or something wrote into a
    member's input since it joined. A bucket then becomes one collective, issued after
    the last of its inputs and waited on before the first reader of any member:

    - all-gather: inputs flattened and concatenated; the result, ``[size, total]``,
      is sliced per tensor and reshaped to ``[size * d0, ...]``, rank-major as before.
    - reduce-scatter: each input viewed as ``[size, -1]`` (rank r's chunk is row r) and
      concatenated along dim 1, so rank r's chunk of the bucket is the concatenation of
      rank r's chunks; the result is split per tensor.
    - all-reduce: inputs flattened and concatenated; the result is split per tensor.

    Every element is reduced with the same values as before, in the same rank order.

    Args:
        program: a traced step whose graph holds functional collectives.
        bucket_bytes: the most bytes one bucket holds (see :func:`default_bucket_bytes`).

    Returns:
        A Program with fewer collectives; ``program`` itself if no two could merge.

    Raises:
        ValueError: ``bucket_bytes`` is not a positive int.

    Example:
        >>> after = bucket(program, default_bucket_bytes(10e-6, 100e9))
        >>> len(collectives(after.graph)) < len(collectives(program.graph))
        True
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket: bucket_bytes must be a positive int (bytes per bucket), found {bucket_bytes!r}")
    gm = program.copy_graph_module()
    planner = _Planner(bucket_bytes)
    mergeable = {c.node: c for c in collectives(gm.graph) if _key(c) is not None}
    for node in gm.graph.nodes:
        c = mergeable.get(node)
        planner.visit(node, c, None if c is None else (*cast(tuple, _key(c)), _backward(node)))
    merged = [_merge(gm.graph, b.members) for b in planner.buckets if len(b.members) > 1]
    if not any(merged):
        return program
    gm.graph.lint()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("bucket",))


# --------------------------------------------------------------------------- planning


@dataclass
class _Bucket:
    index: int
    key: tuple[Any, ...]
    members: list[Collective] = field(default_factory=list)
    nbytes: int = 0
    needs: set[int] = field(default_factory=set)  # open buckets the members' inputs depend on
    reads: set[Node] = field(default_factory=set)  # the memory the members' inputs live in


class _Planner:
    """Greedy bucketing in program order.

    ``deps[node]`` holds the open buckets ``node``'s value depends on. A bucket runs as
    one collective, so each member's result depends on every member's input: a join
    adds the newcomer's dependencies to every reader of the bucket seen so far, or two
    buckets could each wait on the other once merged.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.limit = bucket_bytes
        self.buckets: list[_Bucket] = []
        self.open: dict[tuple[Any, ...], _Bucket] = {}
        self.deps: dict[Node, set[int]] = {}
        self.readers: dict[int, list[Node]] = {}  # per open bucket, the nodes depending on it

    def visit(self, node: Node, c: Collective | None, key: tuple[Any, ...] | None) -> None:
        needs = {i for a in node.all_input_nodes for i in self.deps.get(a, ()) if i in self.readers}
        roots = {alias_root(a) for a in written_args(node)}
        for key in [k for k, b in self.open.items() if b.reads & roots]:
            self._close(key)
        if c is None:
            self._depend(node, needs)
            return
        key, nbytes = cast(tuple, key), max(c.input_bytes, c.output_bytes)
        b = self.open.get(key)
        if b is None or b.index in needs or b.nbytes + nbytes > self.limit:
            b = self._start(key)
        new = needs - b.needs
        b.needs |= new
        for reader in list(self.readers[b.index]):
            self._add(reader, new)
        b.members.append(c)
        b.nbytes += nbytes
        b.reads.add(alias_root(cast(Node, c.node.args[0])))
        self._depend(c.node, self._closure(b.needs) | {b.index})

    def _start(self, key: tuple[Any, ...]) -> _Bucket:
        if key in self.open:
            self._close(key)
        b = self.open[key] = _Bucket(len(self.buckets), key)
        self.buckets.append(b)
        self.readers[b.index] = []
        return b

    def _close(self, key: tuple[Any, ...]) -> None:
        del self.readers[self.open.pop(key).index]

    def _closure(self, ids: set[int]) -> set[int]:
        """``ids`` and what they need, transitively (a bucket's needs may have grown since)."""
        found: set[int] = set()
        todo = list(ids)
        while todo:
            i = todo.pop()
            if i not in found:
                found.add(i)
                todo.extend(self.buckets[i].needs)
        return found

    def _depend(self, node: Node, needs: set[int]) -> None:
        self.deps[node] = set()
        self._add(node, needs)

    def _add(self, node: Node, needs: set[int]) -> None:
        for i in needs - self.deps[node]:
            self.deps[node].add(i)
            if i in self.readers:
                self.readers[i].append(node)


def _backward(node: Node) -> bool:
    """Whether the collective serves the backward (by its source: passes move them)."""
    source = node.meta.get(SOURCE_KEY)
    return bool(source is not None and source.backward)


def _key(c: Collective) -> tuple[Any, ...] | None:
    """What must match for two collectives to merge; None if ``c`` cannot merge."""
    if c.node.target not in _MERGEABLE or c.wait is None or list(c.node.users) != [c.wait]:
        return None
    source = c.node.args[0]
    x = source.meta.get("val") if isinstance(source, Node) else None
    y = c.node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dtype != y.dtype:
        return None
    ratio = {"all_gather": (c.size, 1), "reduce_scatter": (1, c.size), "all_reduce": (1, 1)}[c.kind]
    if y.numel() * ratio[1] != x.numel() * ratio[0]:
        return None
    if c.kind != "all_reduce" and (x.dim() == 0 or x.shape[1:] != y.shape[1:]):
        return None  # not split or stacked along dim 0: leave it as it is
    return (c.node.target, c.group, c.size, _argument(c.node, "reduce_op"), x.dtype, x.device)


def _argument(node: Node, name: str) -> Any:
    schema = cast(torch._ops.OpOverload, node.target)._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


# --------------------------------------------------------------------------- rewriting


def _merge(graph: torch.fx.Graph, members: list[Collective]) -> bool:
    """Replace ``members`` by one collective; False (graph untouched) if that would be a cycle."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [cast(Node, m.node.args[0]) for m in members]
    anchor = max(inputs, key=order.__getitem__)
    late = _readers_before(graph, members, anchor, order)
    if late is None:
        return False
    kind = members[0].kind
    with graph.inserting_before(anchor.next):
        issued = _ISSUE[kind](graph, members, inputs)
    cursor = issued
    for node in late:  # they read a member's result, which now exists only after `issued`
        cursor.append(node)
        cursor = node
    order = {n: i for i, n in enumerate(graph.nodes)}
    waits = [cast(Node, m.wait) for m in members]
    first = min((u for w in waits for u in w.users), key=order.__getitem__, default=issued.next)
    with graph.inserting_before(first):
        wait = add_call(graph, c10d.wait_tensor.default, (issued,))
        outs = _FINISH[kind](graph, members, wait)
    for m, w, out in zip(members, waits, outs):
        w.replace_all_uses_with(out)
        graph.erase_node(w)
        graph.erase_node(m.node)
    return True


def _readers_before(
    graph: torch.fx.Graph, members: list[Collective], anchor: Node, order: dict[Node, int]
) -> list[Node] | None:
    """The nodes before ``anchor`` that read a member's result (through any path), in
    order; None if the anchor or a member's input is one, or one writes memory (moving a
    write past a reader would change what it reads)."""
    results = {m.node for m in members}
    waits = {m.wait for m in members}
    inputs = {m.node.args[0] for m in members}
    start, stop = min(order[n] for n in results), order[anchor]
    tainted = set(results)
    late = []
    for node in list(graph.nodes)[start : stop + 1]:
        if node in results or not any(a in tainted for a in node.all_input_nodes):
            continue
        if node in inputs or written_args(node):
            return None
        tainted.add(node)
        if node not in waits:
            late.append(node)
    return late


def _contiguous(graph: torch.fx.Graph, x: Node) -> Node:
    val = x.meta.get("val")
    if isinstance(val, torch.Tensor) and val.is_contiguous():
        return x
    return add_call(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format})


def _view(graph: torch.fx.Graph, x: Node, shape: list[int]) -> Node:
    return add_call(graph, aten.view.default, (x, shape))


def _issue_flat(graph: torch.fx.Graph, members: list[Collective], inputs: list[Node]) -> Node:
    """All-gather, all-reduce: the inputs flattened end to end."""
    flat = [_view(graph, _contiguous(graph, x), [-1]) for x in inputs]
    cat = add_call(graph, aten.cat.default, (flat,))
    first = members[0].node
    return add_call(graph, cast(Callable[..., Any], first.target), (cat, *first.args[1:]), dict(first.kwargs))


def _issue_rows(graph: torch.fx.Graph, members: list[Collective], inputs: list[Node]) -> Node:
    """Reduce-scatter: rank r's chunk of the bucket is the concatenation of rank r's chunks."""
    size = members[0].size
    rows = [_view(graph, _contiguous(graph, x), [size, -1]) for x in inputs]
    cat = add_call(graph, aten.cat.default, (rows, 1))
    first = members[0].node
    flat = _view(graph, cat, [-1])
    return add_call(graph, cast(Callable[..., Any], first.target), (flat, *first.args[1:]), dict(first.kwargs))


def _finish_gather(graph: torch.fx.Graph, members: list[Collective], wait: Node) -> list[Node]:
    """Row r of the result is rank r's bucket; each tensor is a column range of it."""
    sizes = [_numel(cast(Node, m.node.args[0])) for m in members]
    rows = _view(graph, wait, [members[0].size, sum(sizes)])
    outs = []
    for m, start, n in zip(members, _starts(sizes), sizes):
        part = add_call(graph, aten.slice.Tensor, (rows, 1, start, start + n))
        outs.append(_view(graph, _contiguous(graph, part), _shape(m.node)))
    return outs


def _finish_split(graph: torch.fx.Graph, members: list[Collective], wait: Node) -> list[Node]:
    """Each tensor's result is a contiguous range of the bucket's."""
    sizes = [_numel(m.node) for m in members]
    outs = []
    for m, start, n in zip(members, _starts(sizes), sizes):
        part = add_call(graph, aten.slice.Tensor, (wait, 0, start, start + n))
        outs.append(_view(graph, part, _shape(m.node)))
    return outs


_ISSUE = {"all_gather": _issue_flat, "reduce_scatter": _issue_rows, "all_reduce": _issue_flat}
_FINISH = {"all_gather": _finish_gather, "reduce_scatter": _finish_split, "all_reduce": _finish_split}


def _numel(node: Node) -> int:
    return cast(torch.Tensor, node.meta["val"]).numel()


def _shape(node: Node) -> list[int]:
    return list(cast(torch.Tensor, node.meta["val"]).shape)


def _starts(sizes: list[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)][:-1]
