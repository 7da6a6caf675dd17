"""What one run of a sharded step costs each rank: its memory and its communication.

Communication follows the alpha-beta model of ring collectives. A collective over
``n`` ranks takes ``n - 1`` steps (twice that for an all-reduce), each paying a
latency ``alpha``, and moves its bytes at the per-rank bandwidth ``bw`` of the
slowest link its group spans:

* all_gather: ``alpha * (n-1) + (n-1)/n * B / bw``, ``B`` the gathered (output) size;
* reduce_scatter: ``alpha * (n-1) + (n-1)/n * B / bw``, ``B`` the full input size;
* all_reduce: ``2 * alpha * (n-1) + 2 * (n-1)/n * B / bw``, ``B`` the tensor's size;
* all_to_all: ``alpha * (n-1) + (n-1)/n * B / bw``, ``B`` this rank's input size;
* broadcast (a pipelined chain): ``alpha * (n-1) + B / bw``, ``B`` the tensor's size.

A group of one rank costs nothing. ``bw`` is the bus bandwidth that ``nccl-tests``
reports, so these are the times it would measure. A group whose ranks all sit on
one node uses the intra-node link (NVLink); a group spanning nodes is bounded by the
inter-node link (the network). Ring latency grows with ``n``; NCCL's trees and
NVLink SHARP do better on large groups and small messages, so the latency term is
pessimistic there.

The total is the sum over collectives: overlap with compute (or with each other)
is not modelled, so it bounds the communication a step can expose from above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...capture import SOURCE_KEY
from ...errors import ArgumentError, ArgumentTypeError, UnsupportedError
from ...program import Program
from ..memory.analysis import MemoryAnalysis, memory_analysis
from .collectives import Collective, collectives, group_ranks

__all__ = ["CollectiveCost", "CostAnalysis", "LinkClass", "Links", "collective_seconds", "cost_analysis"]

LinkClass = Literal["intra-node", "inter-node"]

_API = "sg.Links"
_UNITS = {
    "alpha": "seconds (the latency of one step of a ring collective)",
    "bandwidth": "bytes per second per rank (the bus bandwidth nccl-tests reports)",
}


@dataclass(frozen=True)
class Links:
    """The two kinds of links between ranks, for the communication cost model.

    Ranks ``k * ranks_per_node`` to ``(k + 1) * ranks_per_node - 1`` share node ``k``
    (``node = rank // ranks_per_node``, the order ``torchrun`` assigns).

    The defaults describe H200 nodes of 8 GPUs. NVLink 4 moves 450 GB/s each way per
    GPU and ring collectives reach about 80% of it on large messages (360 GB/s);
    NCCL's own tuning model charges a few microseconds per ring step over NVLink
    (5 us here). Between nodes each GPU has one 400 Gb/s InfiniBand NIC, 50 GB/s, of
    which about 80% (40 GB/s) is reached, with about 15 us per ring step.

    Attributes:
        intra_node_alpha / inter_node_alpha: seconds per ring step.
        intra_node_bandwidth / inter_node_bandwidth: bytes per second per rank.
        ranks_per_node: GPUs (ranks) per node.

    Example:
        >>> links = sg.Links(inter_node_bandwidth=25e9)  # 200 Gb/s NICs
        >>> links.seconds("all_reduce", 2**30, ranks=range(8))
    """

    intra_node_alpha: float = 5e-6
    intra_node_bandwidth: float = 360e9
    inter_node_alpha: float = 15e-6
    inter_node_bandwidth: float = 40e9
    ranks_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("intra_node_alpha", "intra_node_bandwidth", "inter_node_alpha", "inter_node_bandwidth"):
            _check_positive(name, getattr(self, name), _UNITS[name.rsplit("_", 1)[1]])
        n = self.ranks_per_node
        if isinstance(n, bool) or not isinstance(n, int):
            raise ArgumentTypeError(f"{_API}: ranks_per_node must be an int (GPUs per node); found {n!r}.")
        if n < 1:
            raise ArgumentError(f"{_API}: ranks_per_node must be at least 1 (GPUs per node); found {n}.")

    def link(self, ranks: Sequence[int]) -> LinkClass:
        """``"intra-node"`` when all ``ranks`` sit on one node, else ``"inter-node"``."""
        nodes = {rank // self.ranks_per_node for rank in ranks}
        return "intra-node" if len(nodes) <= 1 else "inter-node"

    def alpha_bandwidth(self, link: LinkClass) -> tuple[float, float]:
        """``(alpha, bandwidth)`` of the ``link`` class."""
        if link == "intra-node":
            return self.intra_node_alpha, self.intra_node_bandwidth
        return self.inter_node_alpha, self.inter_node_bandwidth

    def seconds(self, kind: str, nbytes: int, *, ranks: Sequence[int]) -> float:
        """The time of one collective of ``kind`` over ``ranks`` (global ranks), with
        ``nbytes`` as :func:`collective_seconds` counts them."""
        alpha, bandwidth = self.alpha_bandwidth(self.link(ranks))
        return collective_seconds(kind, nbytes, len(ranks), alpha=alpha, bandwidth=bandwidth)


def collective_seconds(kind: str, nbytes: int, size: int, *, alpha: float, bandwidth: float) -> float:
    """The alpha-beta time of one ring collective (the formulas of the module docstring).

    Args:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``
            or ``"broadcast"``.
        nbytes: the collective's size: the gathered output of an all_gather, the full
            input of a reduce_scatter, the tensor of the others.
        size: ranks in the group.
        alpha: seconds per ring step.
        bandwidth: bytes per second per rank.

    Example:
        >>> collective_seconds("all_reduce", 8 * 2**20, 8, alpha=1e-5, bandwidth=1e11)
    """
    if size <= 1:
        return 0.0
    steps = size - 1
    share = steps / size * nbytes / bandwidth
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return alpha * steps + share
    if kind == "all_reduce":
        return 2 * alpha * steps + 2 * share
    if kind == "broadcast":
        return alpha * steps + nbytes / bandwidth
    raise ArgumentError(
        f"collective_seconds: kind={kind!r} is not one of 'all_gather', 'reduce_scatter', "
        "'all_reduce', 'all_to_all', 'broadcast'."
    )


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of the step and its estimated time on one rank.

    Attributes:
        node: the collective's node (its name in the program's listing).
        kind: as :class:`~.collectives.Collective` names it.
        group: the process group's name; ``size`` its ranks; ``link`` the slowest
            link class they span.
        nbytes: the collective's size as the formulas count it (gathered output for
            all_gather, full input for reduce_scatter, the tensor otherwise).
        seconds: the estimated time.
        source: the user's line that issued it (``file.py:12 in fn``), if recorded.
    """

    node: str
    kind: str
    group: str
    size: int
    link: LinkClass
    nbytes: int
    seconds: float
    source: str = ""


@dataclass(frozen=True)
class CostAnalysis:
    """The estimated per-rank cost of one run of a step.

    Attributes:
        name: the program's name.
        links: the link model used.
        memory_bytes: the predicted peak memory of one rank, from
            :func:`~sgraph._src.passes.memory.analysis.memory_analysis` (inputs,
            activations, gradients and temporaries, read off the fake tensors).
        collectives: one row per collective, in program order.
        counts: the number of collectives per kind.
        total_bytes: the sum of the rows' ``nbytes``.
        total_seconds: the sum of the rows' ``seconds``. Overlap with compute is not
            modelled: this is an upper bound of the communication the step exposes.
    """

    name: str
    links: Links
    memory_bytes: int
    collectives: tuple[CollectiveCost, ...] = field(repr=False)
    counts: dict[str, int]
    total_bytes: int
    total_seconds: float

    def as_text(self, limit: int = 40) -> str:
        """A readable summary: totals, then per group, then up to ``limit`` collectives
        in program order with their source lines."""
        lines = [
            f"{self.name}: per rank, predicted peak memory {_size(self.memory_bytes)}; "
            f"{_count(len(self.collectives))}, {_size(self.total_bytes)}, "
            f"{_time(self.total_seconds)} of communication (ring model, no overlap with compute)",
            "  by kind: " + (", ".join(f"{kind} {n}" for kind, n in self.counts.items()) or "none"),
        ]
        if not self.collectives:
            return "\n".join(lines)
        lines.append("  by group:")
        for group, rows in _by_group(self.collectives).items():
            head = rows[0]
            total = sum(r.nbytes for r in rows)
            seconds = sum(r.seconds for r in rows)
            lines.append(
                f"    group {group:<8} {head.size:>6} ranks  {head.link:<10} {_count(len(rows)):>16} "
                f"{_size(total):>12} {_time(seconds):>10}"
            )
        lines.append("  collectives, in program order:")
        for row in self.collectives[:limit]:
            where = f"  # {row.source}" if row.source else ""
            lines.append(
                f"    %{row.node:<28} {row.kind:<14} group {row.group:<8} {_size(row.nbytes):>12} "
                f"{_time(row.seconds):>10}{where}"
            )
        if len(self.collectives) > limit:
            lines.append(f"    ... {len(self.collectives) - limit} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


def cost_analysis(program: Program, links: Links | None = None, memory: MemoryAnalysis | None = None) -> CostAnalysis:
    """Estimate what one run of ``program`` costs each rank (see the module docstring).

    Args:
        program: a traced step; its collectives' process groups must exist in this
            process (to see which ranks, hence which links, each group spans).
        links: the link model; ``Links()`` (H200 nodes of 8 GPUs) when None.
        memory: the program's memory analysis when already computed, else it is run.

    Returns:
        The :class:`CostAnalysis`.

    Example:
        >>> print(cost_analysis(lowered.program, Links(inter_node_bandwidth=25e9)))
    """
    links = Links() if links is None else links
    if not isinstance(links, Links):
        raise ArgumentTypeError(f"cost_analysis: links must be an sg.Links or None; found {type(links).__name__}.")
    if memory is None:
        memory = memory_analysis(program)
    elif not isinstance(memory, MemoryAnalysis):
        raise ArgumentTypeError(
            f"cost_analysis: memory must be the program's MemoryAnalysis or None; found {type(memory).__name__}."
        )
    rows = tuple(_row(c, links) for c in _collectives(program))
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.kind] = counts.get(row.kind, 0) + 1
    return CostAnalysis(
        name=program.name,
        links=links,
        memory_bytes=memory.peak_bytes,
        collectives=rows,
        counts=counts,
        total_bytes=sum(r.nbytes for r in rows),
        total_seconds=sum(r.seconds for r in rows),
    )


def _row(collective: Collective, links: Links) -> CollectiveCost:
    source = collective.node.meta.get(SOURCE_KEY)
    where = source.short() if source is not None else ""
    ranks = _ranks(collective, where)
    link = links.link(ranks)
    nbytes = _formula_bytes(collective)
    alpha, bandwidth = links.alpha_bandwidth(link)
    seconds = collective_seconds(collective.kind, nbytes, collective.size, alpha=alpha, bandwidth=bandwidth)
    return CollectiveCost(
        collective.node.name, collective.kind, collective.group, collective.size, link, nbytes, seconds, where
    )


def _collectives(program: Program) -> list[Collective]:
    try:  # an all_reduce records no group size: reading it resolves the group
        return collectives(program.graph)
    except RuntimeError as error:
        raise _missing_group(f"a collective of {program.name}", error) from None


def _ranks(collective: Collective, where: str) -> list[int]:
    try:
        return group_ranks(collective.group)
    except RuntimeError as error:
        at = f" ({where})" if where else ""
        raise _missing_group(f"%{collective.node.name}{at}", error) from None


def _missing_group(what: str, error: RuntimeError) -> UnsupportedError:
    return UnsupportedError(
        f"cost_analysis: {what} runs on a process group that does not exist in this process "
        f"({error}); the model reads the group's ranks to tell intra-node from inter-node links. "
        "Analyse the step in the process that traced it, before destroy_process_group()."
    )


def _formula_bytes(collective: Collective) -> int:
    if collective.kind == "all_gather":
        return collective.output_bytes
    return collective.input_bytes


def _by_group(rows: Sequence[CollectiveCost]) -> dict[str, list[CollectiveCost]]:
    groups: dict[str, list[CollectiveCost]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    return groups


def _check_positive(name: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{_API}: {name} must be a number of {unit}; found {value!r}.")
    if not (value > 0 and math.isfinite(value)):
        raise ArgumentError(f"{_API}: {name} must be a positive, finite number of {unit}; found {value!r}.")


def _count(n: int) -> str:
    return f"{n} collective" if n == 1 else f"{n} collectives"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
