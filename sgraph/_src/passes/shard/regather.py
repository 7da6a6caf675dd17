"""Regather: gather sharded parameters again for the backward instead of keeping them.

FSDP gathers each parameter before the forward uses it. The backward reads the
same weight again (a linear layer's input gradient is ``grad @ W``), so the traced
step keeps every gathered weight alive from its forward use to its backward use:
the whole model, unsharded, at the peak. FSDP's answer (``reshard_after_forward``)
is to free the gathered weight after the forward and gather it again in the
backward, trading one more all-gather per parameter for the memory of all the
gathered weights but the few in flight.

This pass does that on the graph: each all-gather of a parameter (its input is a
graph input, or views and casts of one) whose result the backward reads is copied,
with its wait and the views the backward reads, to just before the first backward
reader (:func:`memory.remat.rematerialize` makes the copies). The overlap pass
then prefetches the copies as it does the forward's gathers. The values gathered
are the same, so results are bitwise those of the step without the pass.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from ...capture import SOURCE_KEY
from ...program import Program
from ..memory.remat import RECOMPUTED_KEY, Group, forward_end, rematerialize
from .collectives import collectives
from .overlap import is_view, of_parameters

__all__ = ["regather"]


def regather(program: Program) -> Program:
    """``program`` with each parameter gathered again for its backward readers.

    Returns:
        A new Program (``"regather"`` added to its passes), or ``program`` itself when
        no gathered parameter is read by the backward.

    Example:
        >>> [c.kind for c in collectives(regather(program).graph)].count("all_gather")
        8  # 4 parameters, gathered for the forward and again for the backward
    """
    nodes = list(program.graph.nodes)
    end = forward_end(program.graph)
    backward = set(nodes[end:])
    chosen = []
    for c in collectives(program.graph):
        if c.kind != "all_gather" or c.wait is None or nodes.index(c.node) >= end or not of_parameters(c.node):
            continue
        members = _read_by(c.node, c.wait, backward)
        if members:
            chosen.append(Group(c.node, (c.node, *members), c.output_bytes, "other", 0, 0.0, ""))
    if not chosen:
        return program
    planned = rematerialize(program, chosen)
    for node in planned.graph.nodes:  # the copies run for the backward: say so
        source = node.meta.get(SOURCE_KEY)
        if RECOMPUTED_KEY in node.meta and source is not None and not source.backward:
            node.meta[SOURCE_KEY] = dataclasses.replace(source, backward=True)
    return planned.replace(passes=program.passes + ("regather",))


def _read_by(gather: torch.fx.Node, wait: torch.fx.Node, backward: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The wait and the views of its result between it and the backward's reads, if the
    backward reads any (views of views included)."""
    found: list[torch.fx.Node] = []
    stack = [wait]
    read = False
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.append(node)
        for user in node.users:
            if user in backward:
                read = True
            elif user.args and user.args[0] is node and is_view(user):
                stack.append(user)
    return found if read else []
