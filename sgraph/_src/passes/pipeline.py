"""The one place that orders the passes.

Whatever order the user stacks the decorators in, a step is lowered the same way:
kernel fixes (replay), cleanup and algebraic folds, then (as they land) sharding,
fusion and memory planning, then donation, which must see the final outputs, then
reinplacing, which makes the graph write donated outputs straight into their inputs
and so must come last.
"""

from __future__ import annotations

from ..options import Options
from ..program import Program
from .cleanup import cleanup
from .donation import donation
from .reinplace import reinplace
from .replay import replay
from .simplify import simplify

__all__ = ["lower"]


def lower(program: Program, options: Options) -> Program:
    """Run every pass the options ask for, in the canonical order.

    Example:
        >>> lower(traced_program, options).passes
        ('replay', 'cleanup', 'simplify', 'donation', 'reinplace')
    """
    del options  # read by the sharding, fusion and memory passes as they land
    program = simplify(cleanup(replay(program)))
    program = donation(program)
    return reinplace(program)
