"""Overlap: issue each collective as early as it can run, wait on it as late as it can.

A functional collective runs in the background between its issue and its
``wait_tensor``, so the compute placed between the two hides the communication. A
traced step waits right after each issue and hides nothing; this pass moves issues
up and waits down, leaving the compute in its order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx import Node

from ...program import Program, alias_root, written_args
from .collectives import group_name, is_collective, is_wait

__all__ = ["is_view", "of_parameters", "overlap"]


def overlap(program: Program) -> Program:
    """Reorder the graph so that communication overlaps compute.

    Compute nodes keep their relative order. Each collective moves up to just after
    the last node it needs: its inputs, and the last earlier write into the memory it
    reads. Each ``wait_tensor``, with the views and ``getitem`` nodes over its result,
    moves down to just before the first node that reads it, but stays before any
    write into the memory its collective reads (the collective may still be reading).
    A collective whose input is another one's result is issued once that result is
    first needed, by it or by compute.

    Each group has two lanes, and each lane has one collective in flight at a time,
    as FSDP has:

    - Gathers of parameters (the input is a graph input, or views, casts and padding
      of one) are issued once the lane's previous one is waited on. So each is
      prefetched one use ahead, and gathered parameters do not all live at once.
    - Any other collective (a gradient's reduce-scatter) is issued as soon as its input
      exists, after waiting on the lane's previous one. So at most one full gradient
      waits for its reduction.

    Every rank of a group must issue the group's collectives in the same order, or ranks
    would pair different collectives and hang or exchange the wrong data. Within a lane
    the traced order is kept. Across the two lanes the order follows the compute order
    and the waits the compute demands, both the same on every rank. (Ranks' graphs
    differ only by the padding of uneven shards, which decides nothing here, and the
    ranks check that they agree on their collectives before the first one runs.)
    Collectives over different groups may pass each other.

    Issuing earlier keeps a collective's buffers alive longer, so peak memory can grow.

    Args:
        program: a traced step whose graph holds functional collectives.

    Returns:
        A Program over the reordered graph; ``program`` itself if the order is unchanged.

    Example:
        >>> after = overlap(program)
        >>> [n.name for n in after.graph.nodes if is_collective(n) or is_wait(n)]
        ['all_gather_into_tensor', 'all_gather_into_tensor_1', 'wait_tensor', 'wait_tensor_1']
    """
    gm = program.copy_graph_module()
    graph = gm.graph
    order = _Schedule(graph).run()
    if order == list(graph.nodes):
        return program
    _apply(graph, order)
    graph.lint()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("overlap",))


class _Schedule:
    """A new order: compute in its order, collectives issued once ready (see
    :func:`overlap` for the lanes), waits and their views emitted on demand."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.order: list[Node] = []
        self.done: set[Node] = set()
        self.queues: dict[tuple[str, bool], list[Node]] = {}  # per lane (group, of parameters): not yet issued
        self.lane: dict[Node, tuple[str, bool]] = {}
        self.flight: dict[tuple[str, bool], Node] = {}  # per lane: the last collective issued
        self.lazy: set[Node] = set()
        self.writes_before: dict[Node, list[Node]] = {}  # collective -> earlier writes into what it reads
        self.waits_before: dict[Node, list[Node]] = {}  # write -> waits of earlier collectives reading it
        self.sources: dict[Node, list[Node]] = {}
        self._index()

    def _index(self) -> None:
        readers: dict[Node, list[Node]] = {}  # memory root -> collectives reading it so far
        last_write: dict[Node, Node] = {}
        for node in self.nodes:
            for root in {alias_root(a) for a in written_args(node)}:
                waits = [w for c in readers.get(root, []) for w in _waits(c)]
                self.waits_before.setdefault(node, []).extend(waits)
                last_write[root] = node
            if is_collective(node):
                lane = (group_name(node), of_parameters(node))
                self.queues.setdefault(lane, []).append(node)
                self.lane[node] = lane
                self.sources[node] = _sources(node)
                roots = {alias_root(a) for a in node.all_input_nodes}
                self.writes_before[node] = [last_write[r] for r in roots if r in last_write]
                for root in roots:
                    readers.setdefault(root, []).append(node)
            elif is_wait(node) or (is_view(node) and _follows_collective(node, self.lazy)):
                self.lazy.add(node)
        position = {node: i for i, node in enumerate(self.nodes)}
        for lane, queue in self.queues.items():
            if lane[1]:  # gathers of parameters go in the order the step first uses them
                queue.sort(key=lambda c: (self._first_use(c, position), position[c]))

    def _first_use(self, collective: Node, position: dict[Node, int]) -> int:
        """The position of the first node reading the collective's result through its
        wait and views (the end if none does)."""
        first, stack = len(self.nodes), list(collective.users)
        while stack:
            node = stack.pop()
            if node in self.lazy or node.target is operator.getitem:
                stack.extend(node.users)
            else:
                first = min(first, position[node])
        return first

    def run(self) -> list[Node]:
        for node in self.nodes:
            if node.op != "placeholder":
                break
            self._emit(node)
        self._issue_ready()
        for node in self.nodes:
            if node in self.done or node in self.lazy or is_collective(node):
                continue
            if node.op == "output":  # what nothing reads still runs, before the end
                for rest in self.nodes[:-1]:
                    self._ensure(rest)
            for needed in [*node.all_input_nodes, *self.waits_before.get(node, ())]:
                self._ensure(needed)
            self._issue_ready()  # a wait just emitted for this node may free its lane's next collective
            self._emit(node)
            self._issue_ready()
        return self.order

    def _emit(self, node: Node) -> None:
        self.order.append(node)
        self.done.add(node)

    def _ensure(self, node: Node) -> None:
        if node in self.done:
            return
        if is_collective(node):
            self._issue_through(node)
            return
        for needed in node.all_input_nodes:
            self._ensure(needed)
        self._emit(node)

    def _issue_through(self, collective: Node) -> None:
        """Issue ``collective`` now (a parameter gather: its lane's earlier ones first)."""
        lane = self.lane[collective]
        while collective not in self.done:
            self._issue(self.queues[lane][0] if lane[1] else collective)

    def _issue_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for lane, queue in self.queues.items():
                found = self._next(lane, queue)
                if found is not None:
                    self._issue(found)
                    progress = True

    def _next(self, lane: tuple[str, bool], queue: list[Node]) -> Node | None:
        """The lane's collective to issue now, if any: the first parameter gather once the
        previous one is waited on; else the first collective whose input exists."""
        if not queue:
            return None
        if lane[1]:
            previous = self.flight.get(lane)
            landed = previous is None or all(w in self.done for w in _waits(previous))
            return queue[0] if landed and self._ready(queue[0]) else None
        return next((c for c in queue if self._ready(c)), None)

    def _ready(self, collective: Node) -> bool:
        needed = [*self.sources[collective], *self.writes_before[collective]]
        return all(n in self.done for n in needed)

    def _issue(self, collective: Node) -> None:
        lane = self.lane[collective]
        previous = self.flight.get(lane)
        if previous is not None:
            for wait in _waits(previous):
                self._ensure(wait)
        for needed in [*collective.all_input_nodes, *self.writes_before[collective]]:
            self._ensure(needed)
        self.queues[lane].remove(collective)
        self._emit(collective)
        self.flight[lane] = collective


def _sources(collective: Node) -> list[Node]:
    """What a collective's input is made from, looking through views, casts and padding
    (which some ranks have and others not: readiness must not depend on them)."""
    found: list[Node] = []
    stack = list(collective.all_input_nodes)
    while stack:
        node = stack.pop()
        if node.op != "placeholder" and (is_view(node) or node.target in _CASTS) and not is_wait(node):
            stack.extend(node.all_input_nodes)
        elif node not in found:
            found.append(node)
    return found


def _waits(collective: Node) -> list[Node]:
    """The waits on ``collective``'s result (through ``getitem`` for a coalesced one)."""
    found = [u for u in collective.users if is_wait(u)]
    items = [u for u in collective.users if u.target is operator.getitem]
    return found + [w for item in items for w in item.users if is_wait(w)]


def of_parameters(collective: Node) -> bool:
    """Whether the collective's input is made from graph inputs by views, casts and
    padding only (DTensor pads the ranks' uneven shards of a parameter to one size:
    the answer must be the same on every rank)."""
    stack = list(collective.all_input_nodes)
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            continue
        if not (is_view(node) or node.target in _CASTS):
            return False
        stack.extend(node.all_input_nodes)
    return True


_CASTS = {
    torch.ops.aten.constant_pad_nd.default,
    torch.ops.aten.detach.default,
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
}


def is_view(node: Node) -> bool:
    """Whether ``node`` returns a view of its first argument (``getitem`` counts)."""
    target = node.target
    if target is operator.getitem:
        return True
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _follows_collective(node: Node, lazy: set[Node]) -> bool:
    """Whether ``node`` views a waited result (or picks a coalesced collective's output)."""
    base = node.args[0] if node.args else None
    return isinstance(base, Node) and (base in lazy or (node.target is operator.getitem and is_collective(base)))


def _apply(graph: torch.fx.Graph, order: list[Node]) -> None:
    first = next(iter(graph.nodes))
    if order[0] is not first:
        first.prepend(order[0])
    for before, node in zip(order, order[1:]):
        if before.next is not node:
            before.append(node)
