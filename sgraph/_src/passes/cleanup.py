"""Drop autograd bookkeeping the traced graph no longer needs, then dead code.

``detach`` and ``alias`` only matter to autograd, which has already run by the time
the graph exists; removing them leaves fewer nodes for later passes to reason
about. Dead code goes too, except nodes with effects (writes, random draws); a dead op
whose every input is uninitialized memory the graph made goes all the same (DTensor's
sharding propagation records such calls while it works out an op's output, e.g. for
GPU attention).
"""

from __future__ import annotations

import torch
import torch.fx

from ..program import Program, written_args

__all__ = ["cleanup"]

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_UNINITIALIZED = (torch.ops.aten.empty_strided.default, torch.ops.aten.empty.memory_format)


def cleanup(program: Program, *, in_place: bool = False) -> Program:
    """Remove ``detach``/``alias`` nodes and dead code.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Returns:
        A Program over a new graph module, the input's graph untouched (with
        ``in_place``: over the input's graph module, edited).

    Example:
        >>> len(cleanup(program).ops()) <= len(program.ops())
        True
    """
    gm = program.graph_module_to_edit(in_place)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    _drop_dead_ops_on_uninitialized_memory(gm.graph)
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("cleanup",))


def _drop_dead_ops_on_uninitialized_memory(graph: torch.fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users or node.target in _UNINITIALIZED:
            continue
        inputs = node.all_input_nodes
        if inputs and all(a.op == "call_function" and a.target in _UNINITIALIZED for a in inputs):
            if not any(written_args(node)):
                graph.erase_node(node)
    graph.eliminate_dead_code()
