"""Collectives over a group of one rank move no data: their result is their input.

A mesh dimension of size 1 (a ``(dp, tp)`` mesh run with ``tp=1``, say) still traces
into collectives over that dimension's group. Gathering, scattering or reducing over
one rank returns the input's value for every reduce op (``sum``, ``avg``, ``max``...),
so the collective and its ``wait_tensor`` can go, saving a launch and a copy each.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx
from torch.fx import Node

from ...program import Program, alias_root, returned, written_args
from .collectives import Collective, add_call, collectives, is_wait

__all__ = ["elide_trivial"]


def elide_trivial(program: Program) -> Program:
    """Replace each collective over a one-rank group by its input, and drop its wait.

    The input itself takes the result's place where that is safe. A contiguous copy
    (``aten.clone``) takes it where the two names would become one tensor in a way the
    step could observe: something writes either one (a donated input's trailing
    ``copy_``, a reinplaced op), the result is returned while the input is a graph input
    or is returned too, or the layouts differ (a collective's result is contiguous).

    Args:
        program: a traced step whose graph holds functional collectives.

    Returns:
        A Program without one-rank collectives; ``program`` itself if it had none.

    Example:
        >>> after = elide_trivial(program)  # a (dp=4, tp=1) step
        >>> [c.size for c in collectives(after.graph)]
        [4, 4]
    """
    if not _trivial(program.graph):
        return program
    gm = program.copy_graph_module()
    graph = gm.graph
    written = {alias_root(a) for node in graph.nodes for a in written_args(node)}
    outputs = {alias_root(v) for v in returned(graph) if isinstance(v, Node)}
    for c in _trivial(graph):
        for source, result in _results(c):
            _redirect(result, _value(graph, c, source, result, written, outputs))
            if result is not c.node:
                graph.erase_node(result)
        graph.erase_node(c.node)
    graph.lint()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("elide_trivial",))


def _trivial(graph: torch.fx.Graph) -> list[Collective]:
    """The one-rank collectives; a coalesced one only if its results are read one by one."""
    return [
        c
        for c in collectives(graph)
        if c.size == 1 and (isinstance(c.node.args[0], Node) or all(u.target is operator.getitem for u in c.node.users))
    ]


def _results(c: Collective) -> list[tuple[Node, Node]]:
    """(input, result) pairs: the node itself, or each ``getitem`` of a coalesced one."""
    inputs = c.node.args[0]
    if isinstance(inputs, Node):
        return [(inputs, c.node)]
    assert isinstance(inputs, (list, tuple))
    items = [u for u in c.node.users if u.target is operator.getitem]
    return [(cast(Node, inputs[cast(int, item.args[1])]), item) for item in items]


def _value(
    graph: torch.fx.Graph, c: Collective, source: Node, result: Node, written: set[Node], outputs: set[Node]
) -> Node:
    """The node that takes ``result``'s place: ``source``, or a copy of it made where ``c`` ran."""
    names = [result] + [u for u in result.users if is_wait(u)]
    root = alias_root(source)
    returned_result = any(n in outputs for n in names)
    shared = root in written or any(n in written for n in names)
    escapes = returned_result and (root.op == "placeholder" or root in outputs)
    if not (shared or escapes or not _same_layout(source, result)):
        if returned_result:
            outputs.add(root)
        return source
    with graph.inserting_before(c.node):
        return add_call(graph, torch.ops.aten.clone.default, (source,), {"memory_format": torch.contiguous_format})


def _same_layout(source: Node, result: Node) -> bool:
    a, b = source.meta.get("val"), result.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def _redirect(result: Node, value: Node) -> None:
    """Point every reader of ``result`` and of its waits at ``value``; erase the waits."""
    for user in list(result.users):
        if is_wait(user):
            _redirect(user, value)
            user.graph.erase_node(user)
    result.replace_all_uses_with(value)
