"""Run each parameter's optimizer update as soon as its gradient is final.

A traced train step computes every gradient, then updates every parameter with
multi-tensor ops (``torch._foreach_*``, or the fused ``sgraph::adamw``) over the
list of all leaves, so all gradients live until the end of the backward. This pass
reorders the step, without computing anything more, so that gradients die early:

1. **Lanes.** A multi-tensor op computes element ``i`` of each output list from
   element ``i`` of each input list plus values shared by all elements (scalars,
   0-dim tensors). Elements linked through ``getitem`` (``_foreach_mul`` feeding
   ``_foreach_addcmul``, ...) form a *lane*: one leaf's chain through the optimizer.
2. **Readiness.** The *tail* is everything after the step's last backward op. A
   lane is ready once every value it reads from before the tail exists, and once
   every op before the tail that reads a step input the lane takes (a parameter,
   a moment) has run: the update may then overwrite that input in place
   (:mod:`~sgraph._src.passes.reinplace` writes donated outputs into their inputs
   only where nothing reads the old value afterwards; an update made early but
   out of place would live to the end and cost memory instead of saving it).
3. **Groups.** :func:`group_lanes` cuts the lanes, in order of readiness, into at
   most ``max_groups`` runs (every multi-tensor op is one kernel launch per group
   in the eager runtime), and each multi-tensor op of the tail is split into one op
   per group it spans, with its ``getitem`` users rebuilt to match.
4. **Placement.** A stable list schedule: the ops before the tail keep their order;
   each op of the tail, keeping its place relative to the other tail ops released
   at the same point, runs right after the latest of its inputs, of its group's
   ready point, of the earlier readers of the step inputs it takes, and of the
   first backward op (nothing of the optimizer moves into the forward). An op that
   needs all gradients (a global-norm clip) makes everything after it wait; the
   schedule is still valid, only less useful. Ops that draw random numbers, and
   every op from the first one that writes into memory on, stay at the end.

Only the order of the same ATen calls changes, and a multi-tensor op's elements are
computed independently of each other, so results are bitwise those of the
unscheduled step. The pass always records ``"schedule"`` in ``program.passes``; a
graph with no multi-tensor op after its backward, or one that writes into memory
before its last backward op, is returned unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from ...capture import SOURCE_KEY
from ...errors import ArgumentError
from ...kernels.adamw import INPLACE_FORMS
from ...program import Program, alias_root, graph_module, output_node, written_args

__all__ = ["MAX_GROUPS", "group_lanes", "schedule"]

Node = torch.fx.Node
Element = tuple[Node, int]
"""Lane ``i`` of a multi-tensor op."""
Item = tuple[Node, int]
"""What the schedule places: ``(op, group)`` for a piece of a split op, ``(node, -1)`` otherwise."""

MAX_GROUPS = 16
"""The most groups the optimizer is split into (each costs a launch per multi-tensor op)."""


def schedule(program: Program, *, max_groups: int = MAX_GROUPS) -> Program:
    """Split the optimizer's multi-tensor ops by when their gradients are final, and run
    each piece as early as its inputs allow (see the module docstring).

    Args:
        program: a functional step, before donation and reinplacing.
        max_groups: the most pieces a multi-tensor op is split into.

    Returns:
        The rescheduled Program, ``"schedule"`` added to its passes.

    Raises:
        ArgumentError: ``max_groups`` is below 1.

    Example:
        >>> [n.name for n in schedule(program).ops() if n.target is torch.ops.sgraph.adamw.default]
        ['adamw_g0', 'adamw_g1', 'adamw_g2']
    """
    if max_groups < 1:
        raise ArgumentError(
            f"schedule: max_groups must be at least 1; found {max_groups}. Pass 1 to keep the optimizer whole."
        )
    passes = program.passes + ("schedule",)
    plan = _plan(program, max_groups)
    if plan is None:
        return program.replace(passes=passes)
    return program.replace(graph_module=_emit(program, plan), passes=passes)


def group_lanes(ready: Sequence[int], nbytes: Sequence[int], max_groups: int = MAX_GROUPS) -> list[int]:
    """The grouping rule: cut lanes, in order of readiness, into runs of at least
    ``1 / max_groups`` of all their bytes.

    Lanes ready at the same point always share a group. Going through those sets in
    order, a group closes once it holds at least ``ceil(total / max_groups)`` bytes,
    so there are at most ``max_groups`` groups (about one per transformer block for a
    model of a dozen blocks), and a group is ready at its last lane's point.

    Args:
        ready: per lane, the graph position after which it can run.
        nbytes: per lane, the bytes of its largest tensor.
        max_groups: the most groups to make, ``>= 1``.

    Returns:
        Per lane, its group: 0 for the earliest, then 1, 2, ...

    Example:
        >>> group_lanes([5, 9, 9, 20], [400, 100, 100, 400], max_groups=2)
        [0, 0, 0, 1]
    """
    threshold = max(1, -(-sum(nbytes) // max_groups))
    found = [0] * len(ready)
    group, held, previous = 0, 0, None
    for lane in sorted(range(len(ready)), key=ready.__getitem__):
        if ready[lane] != previous and held >= threshold:
            group, held = group + 1, 0
        found[lane], held, previous = group, held + nbytes[lane], ready[lane]
    return found


@dataclass(frozen=True)
class _MultiOp:
    """A multi-tensor op the pass may split: ``lanes`` elements per list, its per-element
    lists at ``lists`` (positions in ``args``, names in ``kwargs``)."""

    node: Node
    lanes: int
    lists: tuple[int | str, ...]

    def inputs(self, lane: int) -> list[Any]:
        return [_value(self.node, key)[lane] for key in self.lists]

    def shared(self) -> list[Node]:
        """The node inputs every element reads (0-dim tensors)."""
        keys = set(self.lists)
        values = [v for k, v in _arguments(self.node) if k not in keys]
        return [v for v in values if isinstance(v, Node)]

    def getitems(self) -> list[Node]:
        return list(self.node.users)


@dataclass(frozen=True)
class _Plan:
    """The new order: each node before the tail, then the tail items released at it."""

    head: list[Node]
    released: dict[Node, list[Item]]
    pieces: dict[Node, dict[int, list[int]]]
    multi: dict[Node, _MultiOp]
    position: dict[Node, int]


def _plan(program: Program, max_groups: int) -> _Plan | None:
    """The schedule of ``program``, or None when it would leave the graph as it is."""
    nodes = list(program.graph.nodes)
    bounds = _backward_bounds(nodes)
    if bounds is None:
        return None
    first, last = bounds
    tail = nodes[last + 1 : -1]
    multi = {n: op for n in tail if (op := _multi_op(n)) is not None}
    if not multi or any(written_args(n) for n in nodes[: last + 1]):
        return None
    position = {n: i for i, n in enumerate(nodes)}
    lane_of = _lanes(multi)
    ready = _readiness(tail, position, multi, _last_reads(nodes[: last + 1], position))
    groups, group_ready = _groups(lane_of, ready, multi, first, max_groups)
    pieces = {n: _pieces(op, groups) for n, op in multi.items()}
    released = _release(tail, position, _Floors(first, last, group_ready), multi, pieces, groups)
    plan = _Plan(nodes[: last + 1], _by_point(released, position), pieces, multi, position)
    unsplit = all(len(p) == 1 for p in pieces.values())
    return None if unsplit and list(_flat_order(plan)) == nodes[:-1] else plan


def _backward_bounds(nodes: list[Node]) -> tuple[int, int] | None:
    """Positions of the first and the last backward op, or None without a backward."""
    found = [i for i, n in enumerate(nodes) if n.op == "call_function" and _is_backward(n)]
    return (found[0], found[-1]) if found else None


def _is_backward(node: Node) -> bool:
    source = node.meta.get(SOURCE_KEY)
    return source is not None and bool(source.backward)


def _multi_op(node: Node) -> _MultiOp | None:
    """``node`` as a splittable multi-tensor op, or None: a functional ``_foreach_*`` op or
    ``sgraph::adamw``, whose lists all have one length, whose other tensor inputs are
    0-dim, and whose results are read only through ``getitem``."""
    if node.op != "call_function" or not _is_multi_tensor(node.target):
        return None
    lists = [(k, v) for k, v in _arguments(node) if isinstance(v, (list, tuple))]
    lanes = len(lists[0][1]) if lists else 0
    val = node.meta.get("val")
    if not lanes or any(len(v) != lanes for _, v in lists) or not isinstance(val, list) or len(val) % lanes:
        return None
    op = _MultiOp(node, lanes, tuple(k for k, _ in lists))
    scalars = all(isinstance(v, Node) and _is_scalar(v) for v in op.shared())
    read_by_getitem = all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users)
    return op if scalars and read_by_getitem else None


def _is_multi_tensor(target: object) -> bool:
    """A functional ``aten._foreach_*`` op, or ``sgraph::adamw`` (lists element-wise independent too)."""
    if target in INPLACE_FORMS:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    return target._schema.name.startswith("aten::_foreach_") and not target._schema.is_mutable


def _is_scalar(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _arguments(node: Node) -> list[tuple[int | str, Any]]:
    return [*enumerate(node.args), *node.kwargs.items()]


def _value(node: Node, key: int | str) -> Any:
    return node.args[key] if isinstance(key, int) else node.kwargs[key]


def _element(value: Any, multi: dict[Node, _MultiOp]) -> Element | None:
    """The element a ``getitem`` of a multi-tensor op reads, or None for any other value."""
    if not isinstance(value, Node) or value.target is not operator.getitem:
        return None
    op = multi.get(cast(Node, value.args[0]))
    return (op.node, cast(int, value.args[1]) % op.lanes) if op is not None else None


def _lanes(multi: dict[Node, _MultiOp]) -> dict[Element, Element]:
    """Per element, its lane (one representative element): elements linked through
    ``getitem`` share a lane (a union-find)."""
    parent: dict[Element, Element] = {(n, i): (n, i) for n, op in multi.items() for i in range(op.lanes)}

    def find(e: Element) -> Element:
        while parent[e] != e:
            parent[e] = parent[parent[e]]
            e = parent[e]
        return e

    for node, op in multi.items():
        for i in range(op.lanes):
            for value in op.inputs(i):
                source = _element(value, multi)
                if source is not None:
                    parent[find((node, i))] = find(source)
    return {e: find(e) for e in parent}


def _last_reads(head: list[Node], position: dict[Node, int]) -> dict[Node, int]:
    """Per step input, the position of the last op before the tail reading it or a view of it."""
    last: dict[Node, int] = {}
    for node in head:
        for arg in node.all_input_nodes:
            root = alias_root(arg)
            if root.op == "placeholder":
                last[root] = position[node]
    return last


def _readiness(
    tail: list[Node], position: dict[Node, int], multi: dict[Node, _MultiOp], last_read: dict[Node, int]
) -> dict[Element, int]:
    """Per element, the position before the tail after which it can run (step 2 of the
    module docstring), following values through the tail."""
    ready: dict[Node, int] = {}
    elements: dict[Element, int] = {}

    def at(value: Any) -> int:
        if not isinstance(value, Node):
            return -1
        element = _element(value, multi)
        if element is not None:
            return elements[element]
        return ready[value] if value in ready else position[value]

    for node in tail:
        op = multi.get(node)
        if op is None:
            ready[node] = max((at(a) for a in node.all_input_nodes), default=-1)
            continue
        shared = max((at(a) for a in op.shared()), default=-1)
        for i in range(op.lanes):
            reads = [last_read.get(alias_root(v), -1) for v in op.inputs(i) if isinstance(v, Node)]
            elements[(node, i)] = max([shared, *reads, *(at(v) for v in op.inputs(i))])
    return elements


def _groups(
    lane_of: dict[Element, Element], ready: dict[Element, int], multi: dict[Node, _MultiOp], first: int, max_groups: int
) -> tuple[dict[Element, int], list[int]]:
    """Per element, its group; and per group, the position it is ready at."""
    lanes = list(dict.fromkeys(lane_of.values()))
    index = {lane: i for i, lane in enumerate(lanes)}
    points, sizes = [first] * len(lanes), [0] * len(lanes)
    for element, lane in lane_of.items():
        points[index[lane]] = max(points[index[lane]], ready[element])
        sizes[index[lane]] = max(sizes[index[lane]], _element_bytes(multi[element[0]], element[1]))
    found = group_lanes(points, sizes, max_groups)
    group_ready = [first] * (max(found, default=0) + 1)
    for point, group in zip(points, found):
        group_ready[group] = max(group_ready[group], point)
    return {e: found[index[lane]] for e, lane in lane_of.items()}, group_ready


def _element_bytes(op: _MultiOp, lane: int) -> int:
    """The bytes of the largest tensor an element reads or makes."""
    val = cast(list, op.node.meta["val"])
    made = val[lane :: op.lanes]
    read = [v.meta.get("val") for v in op.inputs(lane) if isinstance(v, Node)]
    return max((t.numel() * t.element_size() for t in [*made, *read] if isinstance(t, torch.Tensor)), default=0)


def _pieces(op: _MultiOp, groups: dict[Element, int]) -> dict[int, list[int]]:
    """Per group the op spans, its lanes in that group, in order."""
    found: dict[int, list[int]] = {}
    for i in range(op.lanes):
        found.setdefault(groups[(op.node, i)], []).append(i)
    return found


@dataclass(frozen=True)
class _Floors:
    """What no tail item runs before: the first backward op; the end of the head for
    pinned ops; per group, the point where its lanes are ready."""

    first: int
    last: int
    group_ready: list[int]


def _release(
    tail: list[Node],
    position: dict[Node, int],
    floors: _Floors,
    multi: dict[Node, _MultiOp],
    pieces: dict[Node, dict[int, list[int]]],
    groups: dict[Element, int],
) -> dict[Item, int]:
    """Per tail item, the position before the tail after which it runs (step 4 of the
    module docstring)."""
    released: dict[Item, int] = {}
    read_at: dict[Node, int] = {}  # step input -> latest release of a tail item reading it
    pinned = False
    for node in tail:
        if _element(node, multi) is not None:
            continue  # placed with its op
        pinned = pinned or bool(written_args(node))
        for item, inputs in _items(node, multi, pieces):
            roots = {r for v in inputs if (r := alias_root(v)).op == "placeholder"}
            after = [read_at.get(r, -1) for r in roots] + [_at(v, position, released, groups, multi) for v in inputs]
            released[item] = max([_floor(item, pinned, floors), *after])
            read_at.update((r, max(read_at.get(r, -1), released[item])) for r in roots)
    return released


def _floor(item: Item, pinned: bool, floors: _Floors) -> int:
    node, group = item
    if pinned or _draws_random(node):
        return floors.last
    return floors.group_ready[group] if group >= 0 else floors.first


def _items(
    node: Node, multi: dict[Node, _MultiOp], pieces: dict[Node, dict[int, list[int]]]
) -> Iterator[tuple[Item, list[Node]]]:
    """The items a tail node becomes, each with the nodes it reads."""
    op = multi.get(node)
    if op is None:
        yield (node, -1), node.all_input_nodes
        return
    for group, lanes in pieces[node].items():
        inputs = [v for i in lanes for v in op.inputs(i) if isinstance(v, Node)]
        yield (node, group), [*op.shared(), *inputs]


def _at(
    value: Node,
    position: dict[Node, int],
    released: dict[Item, int],
    groups: dict[Element, int],
    multi: dict[Node, _MultiOp],
) -> int:
    """Where ``value`` is available: its release if the tail makes it, else its position."""
    element = _element(value, multi)
    if element is not None:
        return released[(element[0], groups[element])]
    return released.get((value, -1), position[value])


def _draws_random(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _by_point(released: dict[Item, int], position: dict[Node, int]) -> dict[Node, list[Item]]:
    """Tail items per head node they follow, in their order in the tail (pieces of one op
    by group)."""
    heads = {i: n for n, i in position.items()}
    found: dict[Node, list[Item]] = {}
    for item in sorted(released, key=lambda it: (released[it], position[it[0]], it[1])):
        found.setdefault(heads[released[item]], []).append(item)
    return found


def _flat_order(plan: _Plan) -> Iterator[Node]:
    """The original nodes in the planned order (for a plan that splits nothing)."""
    for node in plan.head:
        yield node
        for op, _ in plan.released.get(node, []):
            yield op
            if op in plan.multi:
                yield from _getitems(plan, op)


def _getitems(plan: _Plan, op: Node) -> list[Node]:
    return sorted(plan.multi[op].getitems(), key=plan.position.__getitem__)


def _emit(program: Program, plan: _Plan) -> torch.fx.GraphModule:
    """A graph module running ``plan``: nodes copied in the new order, split ops rebuilt."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in plan.head:
        env[node] = graph.node_copy(node, env.__getitem__)
        for op, group in plan.released.get(node, []):
            if op not in plan.multi:
                env[op] = graph.node_copy(op, env.__getitem__)
            elif len(plan.pieces[op]) == 1:
                env[op] = graph.node_copy(op, env.__getitem__)
                env.update((g, graph.node_copy(g, env.__getitem__)) for g in _getitems(plan, op))
            else:
                _emit_piece(graph, plan, op, group, env)
    graph.node_copy(output_node(program.graph), env.__getitem__)
    return graph_module(program.graph_module, graph)


def _emit_piece(graph: torch.fx.Graph, plan: _Plan, node: Node, group: int, env: dict[Node, Node]) -> None:
    """Add the piece of split op ``node`` for ``group``, and its ``getitem`` s (into ``env``)."""
    op, lanes = plan.multi[node], plan.pieces[node][group]
    args, kwargs = torch.fx.map_arg(_sliced(op, node.args, node.kwargs, lanes), env.__getitem__)
    piece = graph.create_node("call_function", node.target, args, kwargs, name=f"{node.name}_g{group}")
    piece.meta = _piece_meta(op, lanes)
    local = {lane: j for j, lane in enumerate(lanes)}
    for g in _getitems(plan, node):
        block, lane = divmod(cast(int, g.args[1]), op.lanes)
        if lane in local:
            index = block * len(lanes) + local[lane]  # sgraph::adamw returns params, then mu, then nu
            env[g] = graph.create_node("call_function", operator.getitem, (piece, index), name=g.name)
            env[g].meta = dict(g.meta)


def _piece_meta(op: _MultiOp, lanes: list[int]) -> dict[str, Any]:
    """The op's node meta, its fake results (and recorded inputs, where kept) cut to ``lanes``."""
    meta = dict(op.node.meta)
    val = cast(list, meta["val"])
    meta["val"] = [val[block * op.lanes + i] for block in range(len(val) // op.lanes) for i in lanes]
    recorded = meta.get("eager_input_vals")
    if isinstance(recorded, tuple) and len(recorded) == 2:
        meta["eager_input_vals"] = _sliced(op, *recorded, lanes)
    return meta


def _sliced(op: _MultiOp, args: tuple, kwargs: dict, lanes: list[int]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each per-element list cut down to ``lanes``."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for key in op.lists:
        if isinstance(key, int):
            new_args[key] = [args[key][i] for i in lanes]
        else:
            new_kwargs[key] = [kwargs[key][i] for i in lanes]
    return tuple(new_args), new_kwargs
