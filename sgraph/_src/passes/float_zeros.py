"""Multiply floating tensors by a floating zero, not an integer one, under ``sg.fuse``.

Inductor's constant folding takes ``x * 0`` (an integer or boolean zero: ``aux * 0``,
``x * flag`` with ``flag`` False) for a tensor of zeros. Eagerly it is not: NaN and
infinity times zero are NaN, and a negative value times zero is -0. A step whose
``aux_loss * int(use_aux)`` hid a NaN eagerly would lose it under ``sg.fuse`` (the
fuzz found it: seed 4306). For a floating (or complex) ``x``, ``x * 0`` and
``x * 0.0`` are the same op eagerly (the integer promotes to the tensor's dtype), and
Inductor leaves the second as the multiplication it is; this pass writes the first as
the second. Integer tensors times zero are zero, and are left to the folding.
"""

from __future__ import annotations

import torch

from ..program import Program

__all__ = ["float_zeros"]

_MULS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar)


def float_zeros(program: Program, *, in_place: bool = False) -> Program:
    """``program`` with each multiplication of a floating tensor by an integer or
    boolean zero given the zero as a float; ``program`` itself where there is none.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> [n.args for n in float_zeros(program).ops()]  # traced from ``x * False``
        [(x, 0.0)]
    """
    found = [n for n in program.graph.nodes if n.target in _MULS and _int_zero_times_float(n)]
    if not found:
        return program
    gm = program.graph_module_to_edit(in_place)
    names = {n.name for n in found}
    for node in gm.graph.nodes:
        if node.name in names:
            node.args = tuple(0.0 if _is_int_zero(a) else a for a in node.args)
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("float_zeros",))


def _int_zero_times_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    floating = isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)
    return floating and any(_is_int_zero(a) for a in node.args)


def _is_int_zero(value: object) -> bool:
    return type(value) in (int, bool) and value == 0
