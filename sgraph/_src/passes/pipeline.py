"""The one place that orders the passes.

Whatever order the user stacks the decorators in, a step is lowered the same way:
kernel fixes (replay), cleanup and algebraic folds (and, under ``sg.fuse``, products
with an integer zero given a float zero, which Inductor would fold away, ops over
empty tensors made constants, since Inductor refuses some of them, 2-D
convolutions laid out channels-last and low-precision gradients handed to the AdamW
update as they are), then communication (for a step over DTensors: collectives of one
rank elided, parameters gathered again for the backward, small collectives bucketed,
issues moved up and waits down to overlap compute), memory planning (optimizer updates
scheduled as gradients finish where that lowers the predicted peak, then
rematerialization), then donation, which must see the final outputs, then reinplacing,
which makes the graph write donated outputs straight into their inputs. Last, for a
step that replays as a CUDA graph, gapped inputs the graph copies are given dense
layouts (a change of strides alone, which no earlier pass should see).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from ..errors import DonationWarning
from ..options import Options
from ..program import Program
from .cleanup import cleanup
from .conv_layout import channels_last
from .dense_inputs import dense_inputs
from .donation import donation
from .empty_folds import empty_folds
from .float_zeros import float_zeros
from .grad_casts import grad_casts
from .memory.analysis import memory_analysis
from .memory.plan import device_budget, plan_memory, warn_unmatched_pins
from .memory.schedule import schedule
from .reinplace import reinplace
from .replay import replay
from .shard.bucketing import bucket, default_bucket_bytes
from .shard.collectives import collectives, group_ranks
from .shard.cost import Links
from .shard.overlap import overlap
from .shard.regather import regather
from .shard.trivial import elide_trivial
from .simplify import simplify

__all__ = ["lower", "replays_as_graph"]


def lower(program: Program, options: Options) -> Program:
    """Run every pass the options ask for, in the canonical order.

    Example:
        >>> lower(traced_program, options).passes
        ('replay', 'cleanup', 'simplify', 'donation', 'reinplace')
    """
    # One copy of the traced graph, which the default passes edit in place: the traced
    # program is left as it was and the programs between passes are never seen, while
    # a copy per pass cost a noticeable part of a second for a large step.
    # (Communication and memory passes still copy: memory planning compares graphs.)
    program = program.replace(graph_module=program.copy_graph_module())
    program = simplify(cleanup(replay(program, in_place=True), in_place=True), in_place=True)
    if options.fuse is not None:
        program = empty_folds(float_zeros(program, in_place=True), in_place=True)
    if options.fuse is not None and options.fuse.channels_last:
        program = channels_last(program)
    if options.fuse is not None and "adamw" in options.fuse.kernels:
        program = grad_casts(program, in_place=True)
    if collectives(program.graph):
        program = _communication(program, options)
    if options.memory is not None:
        program = _planned(program, options)
    program = donation(program, in_place=True)
    program = reinplace(program, in_place=True, aten=options.fuse is None)
    return dense_inputs(program) if replays_as_graph(program, options) else program


def replays_as_graph(program: Program, options: Options) -> bool:
    """Whether the compiled step replays as a CUDA graph: ``sg.static`` over CUDA inputs."""
    cuda = any(leaf.device is not None and leaf.device.type == "cuda" for leaf in program.tensor_inputs)
    return cuda and options.static is not None


def _communication(program: Program, options: Options) -> Program:
    program = elide_trivial(program)
    shard = options.shard
    if shard is None or shard.reshard_after_forward:
        program = regather(program)
    size = shard.bucket_bytes if shard is not None and shard.bucket_bytes is not None else _bucket_bytes(program, shard)
    if size and collectives(program.graph):
        # Bucketing merges collectives in program order: first order them as they are
        # used, so a bucket holds neighbours (the gathers of one block, not of the
        # first and the last layer), then schedule the buckets.
        program = bucket(overlap(program), size)
    return overlap(program)


def _bucket_bytes(program: Program, shard: Any) -> int:
    """The default bucket: latency a tenth of a collective's time on the slowest link used."""
    links = shard.links if shard is not None and shard.links is not None else Links()
    classes = {links.link(group_ranks(c.group)) for c in collectives(program.graph)}
    return default_bucket_bytes(*links.alpha_bandwidth("inter-node" if "inter-node" in classes else "intra-node"))


def _planned(program: Program, options: Options) -> Program:
    memory = options.memory
    assert memory is not None
    budget = memory.budget
    if isinstance(budget, float):
        budget = device_budget(budget, program)
    warn_unmatched_pins(program, memory)
    as_run = functools.partial(_as_run, options=options) if program.donated else None
    planned, plan = plan_memory(
        _scheduled_if_lower(program, as_run), memory, budget, generated=options.fuse is not None, as_run=as_run
    )
    return planned.replace(memory_plan=plan, passes=planned.passes + ("plan_memory",))


def _as_run(program: Program, options: Options) -> Program:
    """``program`` with the passes that follow the memory plan (donation, reinplace),
    on a copy: a budget is met by the step as it runs, where donated params and state
    take their new values in their own memory, not by the step before donation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DonationWarning)  # said once, by the pipeline's own donation
        return reinplace(donation(program), in_place=True, aten=options.fuse is None)


def _scheduled_if_lower(program: Program, as_run: Any = None) -> Program:
    """The program with its optimizer updates moved up to where their gradients are
    final, if that lowers the predicted peak: an update run inside the backward frees
    its gradient early but makes its temporaries while activations are still live."""
    scheduled = schedule(program)
    if scheduled.graph_module is program.graph_module:
        return program

    def peak(p: Program) -> int:
        return memory_analysis(as_run(p) if as_run else p).peak_bytes

    return scheduled if peak(scheduled) < peak(program) else program
