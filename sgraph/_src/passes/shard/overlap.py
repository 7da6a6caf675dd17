"""Overlap: issue each collective as early as it can run, wait on it as late as it can.

A functional collective runs in the background between its issue and its
``wait_tensor``, so the compute placed between the two hides the communication. A
traced step waits right after each issue and hides nothing; this pass moves issues
up and waits down, leaving the compute in its order.
"""

from __future__ import annotations

import operator
from collections import deque

import torch
import torch.fx
from torch.fx import Node

from ...program import Program, alias_root, written_args
from .collectives import group_name, is_collective, is_wait

__all__ = ["overlap"]


def overlap(program: Program) -> Program:
    """Reorder the graph so that communication overlaps compute.

    Compute nodes keep their relative order. Each collective moves up to just after
    the last node it needs: its inputs, and the last earlier write into the memory it
    reads. Each ``wait_tensor``, with the views and ``getitem`` nodes over its result,
    moves down to just before the first node that reads it, but stays before any
    write into the memory its collective reads (the collective may still be reading).
    A collective whose input is another one's result is issued once that result is
    first needed, by it or by compute.

    One collective per group is in flight at a time, as FSDP does: the next one is
    issued once the previous one's result is waited on. A collective of parameters
    (its input is a graph input, or views and casts of one: FSDP's all-gathers) waits
    for that, so it is prefetched one use ahead and gathered parameters do not all
    live at once; any other (a gradient's reduce-scatter) is issued as soon as its
    input exists, waiting on the previous one first, so at most one full gradient
    waits for its reduction.

    Collectives over one process group keep their order: every rank of a group must
    issue the group's collectives in the same order, or ranks would pair different
    collectives and hang or exchange the wrong data. Keeping the traced order keeps
    it the same on every rank whatever their graphs hold besides. Collectives over
    different groups may pass each other.

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
    """A new order: compute in its order, collectives issued once ready (in each group's
    order), waits and their views emitted on demand."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.order: list[Node] = []
        self.done: set[Node] = set()
        self.queues: dict[str, deque[Node]] = {}
        self.lazy: set[Node] = set()
        self.writes_before: dict[Node, list[Node]] = {}  # collective -> earlier writes into what it reads
        self.previous: dict[Node, Node] = {}  # collective -> the one before it in its group
        self.prefetched: set[Node] = set()  # collectives of parameters
        self.waits_before: dict[Node, list[Node]] = {}  # write -> waits of earlier collectives reading it
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
                queue = self.queues.setdefault(group_name(node), deque())
                if queue:
                    self.previous[node] = queue[-1]
                queue.append(node)
                if _of_parameters(node):
                    self.prefetched.add(node)
                roots = {alias_root(a) for a in node.all_input_nodes}
                self.writes_before[node] = [last_write[r] for r in roots if r in last_write]
                for root in roots:
                    readers.setdefault(root, []).append(node)
            elif is_wait(node) or (_is_view(node) and _follows_collective(node, self.lazy)):
                self.lazy.add(node)

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
            self._issue_ready()  # a wait just emitted for this node may free its group's next collective
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
        """Issue the collectives of ``collective``'s group up to it, in their order."""
        queue = self.queues[group_name(collective)]
        while collective not in self.done:
            head = queue[0]
            for needed in [*head.all_input_nodes, *self.writes_before[head]]:
                self._ensure(needed)
            queue.popleft()
            self._emit(head)

    def _issue_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for queue in self.queues.values():
                while queue and self._ready(queue[0]):
                    self._wait_previous(queue[0])
                    self._emit(queue.popleft())
                    progress = True

    def _ready(self, collective: Node) -> bool:
        needed = [*collective.all_input_nodes, *self.writes_before[collective]]
        if not all(n in self.done for n in needed):
            return False
        previous = self.previous.get(collective)
        if collective in self.prefetched and previous is not None:
            return all(w in self.done for w in _waits(previous))
        return True

    def _wait_previous(self, collective: Node) -> None:
        previous = self.previous.get(collective)
        if previous is not None:
            for wait in _waits(previous):
                self._ensure(wait)


def _waits(collective: Node) -> list[Node]:
    """The waits on ``collective``'s result (through ``getitem`` for a coalesced one)."""
    found = [u for u in collective.users if is_wait(u)]
    items = [u for u in collective.users if u.target is operator.getitem]
    return found + [w for item in items for w in item.users if is_wait(w)]


def _of_parameters(collective: Node) -> bool:
    """Whether the collective's input is made from graph inputs by views and casts only."""
    stack = list(collective.all_input_nodes)
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            continue
        if not (_is_view(node) or node.target in _CASTS):
            return False
        stack.extend(node.all_input_nodes)
    return True


_CASTS = {
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
}


def _is_view(node: Node) -> bool:
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
