"""Drop autograd bookkeeping the traced graph no longer needs, then dead code.

``detach`` and ``alias`` only matter to autograd, which has already run by the time
the graph exists; removing them leaves fewer nodes for later passes to reason
about. Dead code goes too, except nodes with effects (writes, random draws).
"""

from __future__ import annotations

import torch

from ..program import Program

__all__ = ["cleanup"]

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def cleanup(program: Program) -> Program:
    """Remove ``detach``/``alias`` nodes and dead code.

    Returns:
        A Program over a new graph module; the input's graph is untouched.

    Example:
        >>> len(cleanup(program).ops()) <= len(program.ops())
        True
    """
    gm = program.copy_graph_module()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("cleanup",))
