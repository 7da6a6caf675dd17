"""Choose what to recompute so the step's predicted peak fits a budget, at least cost.

Candidates are the :class:`~.remat.Group` s (forward buffers the backward reads).
A policy says which may be recomputed; the planner then takes them in order of
bytes freed per second of recompute (estimated), skipping any whose recompute
would keep more bytes alive than it frees: recomputing a value makes its inputs
live into the backward, and recomputing a chain of values from far back (a
residual stream) keeps every link alive anyway. With a budget, it takes the
shortest prefix of that order whose predicted peak (:func:`memory_analysis` of
the rewritten step) fits; with none, only the groups that cost no extra matmul,
reduction or memory pass of their own: pointwise ops and views, which a fused
backward recomputes inside the kernels that read them (on ``sg.fuse``'s kernels,
only those a backward kernel computes anyway: one only matmuls read would be a
kernel and a pass over memory of its own).
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx

from ...capture import SOURCE_KEY
from ...errors import ArgumentError, SgraphWarning
from ...options import MemoryOptions
from ...program import Program, alias_root, memory_root, readers
from ...source import MODULE_KEY
from ...tags import TAGS_KEY
from .analysis import memory_analysis
from .remat import Group, forward_end, groups, library_op, rematerialize

__all__ = ["MemoryPlan", "plan_memory", "device_budget", "warn_unmatched_pins"]

Node = torch.fx.Node


@dataclass(frozen=True)
class MemoryPlan:
    """What ``sg.plan_memory`` decided for one step.

    Attributes:
        policy: the policy applied.
        budget: the budget in bytes, or None.
        peak_before / peak_after: predicted peak bytes without and with the plan.
        recomputed: the recomputed buffers (node names of the forward).
        recomputed_bytes: their total size.
        extra_flops / extra_seconds: the estimated cost of recomputing them.
    """

    policy: str
    budget: int | None
    peak_before: int
    peak_after: int
    recomputed: tuple[str, ...]
    recomputed_bytes: int
    extra_flops: int
    extra_seconds: float

    def as_text(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {_mib(self.budget)}"
        return (
            f"memory plan ({self.policy}, {budget}): predicted peak {_mib(self.peak_before)} -> "
            f"{_mib(self.peak_after)}; {len(self.recomputed)} buffers ({_mib(self.recomputed_bytes)}) "
            f"recomputed in the backward, about {self.extra_flops / 1e9:.1f} GFLOP "
            f"(~{self.extra_seconds * 1e3:.2f} ms on a large GPU)"
        )


def plan_memory(
    program: Program,
    options: MemoryOptions,
    budget: int | None,
    *,
    generated: bool = False,
    as_run: Callable[[Program], Program] | None = None,
) -> tuple[Program, MemoryPlan]:
    """Rematerialize per ``options`` so the predicted peak fits ``budget`` bytes
    (``generated``: the step runs on ``sg.fuse``'s kernels, see :func:`memory_analysis`;
    ``as_run``: the passes after this one, applied to a copy before each peak is
    predicted, so peaks are those of the step as it runs, donation included).

    Raises:
        ArgumentError: the budget cannot be met; the message gives the smallest
            peak the policy reaches.
    """
    pinned, candidates = _ordered(program, options)

    def peak_of(program: Program) -> int:
        return memory_analysis(as_run(program) if as_run else program, generated=generated).peak_bytes

    before = peak_of(program)
    if budget is None:
        free = candidates if options.policy != "min_time" else _free(program, candidates, generated)
        choices = [pinned + free, pinned]
        planned, peak = _best(program, choices, peak_of)
        chosen = choices[0]
    else:
        chosen, planned, peak = _fit(program, pinned, candidates, budget, peak_of)
        if peak > budget:
            raise ArgumentError(_unreachable(program.name, options, budget, peak, before))
    plan = MemoryPlan(
        policy=options.policy,
        budget=budget,
        peak_before=before,
        peak_after=peak,
        recomputed=tuple(g.name for g in chosen),
        recomputed_bytes=sum(g.nbytes for g in chosen),
        extra_flops=sum(g.flops for g in chosen),
        extra_seconds=sum(g.seconds for g in chosen),
    )
    return planned, plan


_FREE = ("pointwise", "view")


def _free(program: Program, candidates: list[Group], generated: bool) -> list[Group]:
    """The groups recomputed at no extra matmul, reduction or memory pass: pointwise ops
    and views; on ``sg.fuse``'s kernels, only those a backward kernel computes anyway
    (:func:`_in_a_kernel`): a copy that only library kernels (matmuls) read is a
    kernel of its own, a pass over memory per step."""
    free = [g for g in candidates if g.kind in _FREE]
    if not generated:
        return free
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = forward_end(program.graph)
    return [g for g in free if _in_a_kernel(g, position, end)]


def _in_a_kernel(g: Group, position: dict[Node, int], end: int) -> bool:
    """Whether sg.fuse can compute ``g``'s copy inside a kernel the backward runs
    anyway: a generated backward op reads the copy (the copy fuses into it), or reads
    what the copy reads, at or after the copy's place (the two fuse side by side, as
    the recomputed GELU with the GELU's gradient)."""
    if g.kind == "view":
        return True
    inside = set(g.members)
    reading = [u for m in g.members for u in _through_views(m) if u not in inside and position[u] >= end]
    if not reading:
        return False
    if any(not library_op(u) for u in reading):
        return True
    first = min(position[u] for u in reading)
    return any(
        not library_op(u) and position[u] >= first for arg in _inputs(g) for u in _through_views(arg) if u not in inside
    )


def _through_views(node: Node) -> list[Node]:
    """The ops reading ``node``'s memory, looking through views (no kernel of their own)."""
    return [u for u in readers(node) if alias_root(u) is u]


def _best(program: Program, choices: list[list[Group]], peak_of: Callable[[Program], int]) -> tuple[Program, int]:
    """The choice with the lowest predicted peak (the first on a tie), rewritten."""
    results: list[tuple[int, int, list[Group], Program]] = []
    for chosen in choices:
        planned = rematerialize(program, chosen)
        results.append((peak_of(planned), len(results), chosen, planned))
    peak, _, chosen, planned = min(results, key=lambda r: (r[0], r[1]))
    choices[:] = [chosen]
    return planned, peak


def _fit(
    program: Program, pinned: list[Group], order: list[Group], budget: int, peak_of: Callable[[Program], int]
) -> tuple[list[Group], Program, int]:
    """``pinned`` and the shortest prefix of ``order`` whose predicted peak fits ``budget``
    (by bisection, the peak falling as more is recomputed), or the lowest-peak prefix tried."""
    tried: dict[int, tuple[int, Program]] = {}

    def peak(k: int) -> int:
        if k not in tried:
            planned = rematerialize(program, pinned + order[:k])
            tried[k] = (peak_of(planned), planned)
        return tried[k][0]

    lo, hi = 0, len(order)
    if peak(hi) <= budget:
        while lo < hi:
            mid = (lo + hi) // 2
            if peak(mid) <= budget:
                hi = mid
            else:
                lo = mid + 1
        return pinned + order[:hi], tried[hi][1], tried[hi][0]
    k = min(tried, key=lambda k: (tried[k][0], k))
    return pinned + order[:k], tried[k][1], tried[k][0]


def _ordered(program: Program, options: MemoryOptions) -> tuple[list[Group], list[Group]]:
    """The groups pinned for recompute, and those the policy allows, cheapest per byte
    first, each kept only where it frees more than it keeps alive (module docstring)."""
    found = groups(program)
    allowed = _policy_filter(options, found)
    pinned = [g for g in found if _matches(g, options.recompute) and not _matches(g, options.save)]
    rest = [g for g in found if allowed(g) and g not in pinned and not _matches(g, options.save)]
    rest.sort(key=lambda g: -g.nbytes / (g.seconds + 1e-9))
    return pinned, _worth_it(program, rest, within_blocks=options.policy == "save_block_inputs")


def _policy_filter(options: MemoryOptions, found: Sequence[Group]) -> Callable[[Group], bool]:
    if options.policy == "save_matmuls":
        return lambda g: g.kind != "matmul"
    if options.policy == "save_block_inputs":
        outputs = _block_outputs(found, options.blocks)
        return lambda g: _block(g.module, options.blocks) is not None and g.root not in outputs
    return lambda g: True


def _worth_it(program: Program, order: list[Group], *, within_blocks: bool) -> list[Group]:
    """Walk ``order``, keeping a group when recomputing it frees more bytes than it makes
    live: inputs of its ops not kept anyway, and recomputed inputs whose copies would
    have to be made long before their own first use (a chain)."""
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = forward_end(program.graph)
    first_use = _first_backward_use(nodes, end, position)
    saved = {memory_root(n) for n in first_use}
    owner = {m: g for g in order for m in g.members}
    firsts = sorted(first_use.values())
    kept: list[Group] = []
    chosen: set[Node] = set()
    for g in order:
        extra = 0
        for arg in _inputs(g):
            root = memory_root(arg)
            if arg.op == "placeholder" or position[arg] >= end or root.op == "placeholder":
                continue
            if root in chosen:
                near = within_blocks or _adjacent(firsts, first_use.get(root), first_use.get(g.root))
                extra += 0 if near else owner[root].nbytes
            elif root not in saved:
                extra += _nbytes(root)
        if g.nbytes > extra:
            kept.append(g)
            chosen.add(g.root)
            saved.discard(g.root)
            saved |= {memory_root(a) for a in _inputs(g) if memory_root(a) not in chosen}
    return kept


def _first_backward_use(nodes: list[Node], end: int, position: dict[Node, int]) -> dict[Node, int]:
    found: dict[Node, int] = {}
    for node in nodes[end:]:
        for arg in node.all_input_nodes:
            if position[arg] < end:
                found.setdefault(memory_root(arg), position[node])
                found.setdefault(arg, position[node])
    return found


def _adjacent(firsts: list[int], a: int | None, b: int | None) -> bool:
    """Whether no other buffer's first backward use falls strictly between ``a`` and ``b``."""
    if a is None or b is None:
        return True
    lo, hi = sorted((a, b))
    return not any(lo < f < hi for f in firsts)


def _inputs(g: Group) -> list[Node]:
    """What the ops of ``g`` read from outside ``g``."""
    inside = set(g.members)
    ops = set(g.members) | {
        m.args[0] for m in g.members if m.target is operator.getitem and isinstance(m.args[0], Node)
    }
    return [a for op in ops for a in op.all_input_nodes if a not in inside and a not in ops]


def _nbytes(node: Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _matches(g: Group, patterns: Sequence[str]) -> bool:
    """Whether a pattern names ``g``'s module path or one of its tags."""
    return any(_names(p, name) for p in patterns for name in (g.module, *g.tags))


def _names(pattern: str, name: str) -> bool:
    """Whether ``pattern`` names ``name`` or what is under it (``blocks.0`` names ``blocks.0.fc``)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def warn_unmatched_pins(program: Program, options: MemoryOptions) -> None:
    """Warn for each ``save``/``recompute`` pattern that names no module path and no
    tag of the step: a typo, or a module not run through ``sg.functional``."""
    if not options.save and not options.recompute:
        return
    names = {str(n.meta[MODULE_KEY]) for n in program.graph.nodes if MODULE_KEY in n.meta}
    names |= {t for n in program.graph.nodes for t in n.meta.get(TAGS_KEY, ())}
    for option, patterns in (("save", options.save), ("recompute", options.recompute)):
        for pattern in patterns:
            if not any(_names(pattern, name) for name in names):
                warnings.warn(_unmatched(program.name, option, pattern, names), SgraphWarning, stacklevel=2)


def _unmatched(step: str, option: str, pattern: str, names: set[str]) -> str:
    # Numbered parts as "*" (blocks.*.fc): what a pattern over repeated blocks looks like.
    general = sorted({".".join("*" if p.isdigit() else p for p in n.split(".")) for n in names} - {""})
    close = difflib.get_close_matches(pattern, general + sorted(names - {""}), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    known = ", ".join(general[:8]) + (f" and {len(general) - 8} more" if len(general) > 8 else "") or "none"
    return (
        f"{step}: sg.plan_memory's {option}={pattern!r} matches no module path and no tag of the step, so it "
        f"pins nothing.{hint} The step's module paths and tags: {known}. Module paths are recorded for "
        "submodules run through sg.functional, tags with sg.checkpoint_name(x, name)."
    )


def _block(module: str, blocks: str | None) -> str | None:
    """The block instance ``module`` is in: the shortest prefix matching ``blocks``, or by
    default the prefix up to its first numeric part (``blocks.3`` of ``blocks.3.fc``)."""
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if (blocks is None and parts[i - 1].isdigit()) or (blocks is not None and fnmatch.fnmatchcase(prefix, blocks)):
            return prefix
    return None


def _block_outputs(found: Sequence[Group], blocks: str | None) -> set[Node]:
    """Roots read by a forward op of another block (or of no block): what leaves a block."""
    outputs = set()
    for g in found:
        block = _block(g.module, blocks)
        for user in g.root.users:
            source = user.meta.get(SOURCE_KEY)
            in_forward = source is not None and not source.backward
            if in_forward and _block(str(user.meta.get(MODULE_KEY, "")), blocks) != block:
                outputs.add(g.root)
    return outputs


def device_budget(fraction: float, program: Program) -> int:
    """``fraction`` of the memory of the CUDA device the step's inputs are on."""
    devices = {leaf.device for leaf in program.tensor_inputs if leaf.device is not None and leaf.device.type == "cuda"}
    if not devices:
        raise ArgumentError(
            f"{program.name}: budget={fraction!r} is a fraction of device memory, but the step's inputs are "
            'not on a CUDA device; give the budget in bytes or as a string such as "4GiB".'
        )
    return int(fraction * torch.cuda.get_device_properties(min(devices, key=str)).total_memory)


def _unreachable(name: str, options: MemoryOptions, budget: int, peak: int, before: int) -> str:
    return (
        f"{name}: sg.plan_memory cannot fit the step in budget={_mib(budget)} with policy={options.policy!r}; "
        f"the smallest predicted peak it reaches is {_mib(peak)} (unplanned: {_mib(before)}). Raise the budget "
        "to at least that, use another policy, or make the step smaller (batch size, sharding)."
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} B"
