"""Match donated inputs to outputs, so each output can be written into one.

As in JAX, a donated input is reused for the first not-yet-matched output of the
same shape, dtype and device, in flattening order (an input the step already
writes in place keeps that write instead); a donated input that matches no
output is reported with a :class:`DonationWarning` naming its path. An output that
is a view of a donated input is cloned first, so writing the new values into that
input cannot change an output the user holds.
"""

from __future__ import annotations

import warnings

import torch

from ..errors import DonationWarning
from ..program import Program, alias_root, output_node, placeholders, returned

__all__ = ["donation"]


def donation(program: Program) -> Program:
    """Record ``(output, donated input)`` pairs in ``program.aliases``.

    Example:
        >>> donation(program).aliases   # output 0 goes into input 0, ...
        ((0, 0), (1, 1))
    """
    gm = program.copy_graph_module()
    inputs = placeholders(gm.graph)
    values = returned(gm.graph)
    _clone_views_of_donated(gm, values, inputs, program.donated)
    aliases = _match(program, values, inputs)
    output_node(gm.graph).args = (values,)
    gm.recompile()
    return program.replace(graph_module=gm, aliases=tuple(aliases), passes=program.passes + ("donation",))


def _match(program: Program, returned: list, inputs: list) -> list[tuple[int, int]]:
    used: set[int] = set()
    aliases = []
    inputs = program.tensor_inputs
    for index in sorted(program.donated - program.written_inputs()):
        want = (inputs[index].shape, inputs[index].dtype, inputs[index].device)
        for out in program.outputs:
            i = out.graph_index
            if i is None or i in used or (out.shape, out.dtype, out.device) != want:
                continue
            node = returned[i]
            if node in inputs and node is not inputs[index]:
                continue
            used.add(i)
            aliases.append((i, index))
            break
        else:
            _warn_unused(program, index)
    return aliases


def _warn_unused(program: Program, index: int) -> None:
    leaf = program.tensor_inputs[index]
    warnings.warn(
        f"{program.name}: donated input {leaf.path} ({leaf.describe()}) matches no output of the "
        "same shape, dtype and device, so its memory is not reused. Return its new value from the "
        "step, or stop donating it.",
        DonationWarning,
        stacklevel=2,
    )


def _clone_views_of_donated(gm: torch.fx.GraphModule, returned: list, inputs: list, donated: frozenset[int]) -> None:
    targets = {inputs[i] for i in donated}
    for i, node in enumerate(returned):
        if not isinstance(node, torch.fx.Node) or node in inputs:
            continue
        if alias_root(node) in targets:
            with gm.graph.inserting_after(node):
                clone = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
            clone.meta = dict(node.meta)
            returned[i] = clone
