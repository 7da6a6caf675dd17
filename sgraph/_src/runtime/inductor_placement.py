"""Keep the recomputed copies of a memory-planned step where the plan put them, while
Inductor compiles it (``sg.plan_memory`` under ``sg.fuse``).

Inductor fuses by its own rules and orders kernels by its own estimate of the peak;
either can compute a recomputed copy in the forward after all, and keep it alive to
the backward. :func:`copies_in_place` patches the compile of one graph so that neither
happens; see its docstring.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor import custom_graph_pass

from ..passes.memory.remat import RECOMPUTED_KEY

__all__ = ["copies_in_place"]

_POSITION = "sgraph_position"  # post-grad node meta: where its op sits in the graph given to Inductor
_COPY_RUN = "sgraph_copy_run"  # ...and on a recomputed copy: where its run of copies starts there


@contextlib.contextmanager
def copies_in_place(gm: torch.fx.GraphModule) -> Iterator[None]:
    """In this thread's compile of ``gm``, refuse every fusion that would compute a
    recomputed copy (``sg.plan_memory``) before the place the plan gave it.

    The plan puts each copy just before its first backward reader, in a run of
    copies (a chain of recomputed ops is copied together). Inductor runs a fused
    kernel where its earliest member was, and fuses nodes that read the same buffer
    however far apart they are: a copy fused with its forward twin (both read the
    saved input), or with the forward kernel making that input, is computed in the
    forward after all and kept alive to the backward, and the memory saving is lost.
    So a kernel holding a copy may not fuse with one that holds an op placed before
    the copy's run, however near: the memory plan counts the copy from its run on.
    Fusions with the copies of the same run, with the copy's readers and with
    anything after the run are left to Inductor, as are all fusions of ops that are
    not copies (refusing far-apart fusions wholesale cost 25% in speed on gpt-med).

    Where a kernel's ops sit comes from the provenance Inductor records
    (``meta["from_node"]``: the node meta of ``gm``, ``RECOMPUTED_KEY`` included, does
    not survive its retrace): a post-grad pass (:class:`_MarkPlacement`) writes it on
    Inductor's nodes, and ``V.choices``, set for this thread only, reads it back;
    nodes of unknown provenance are left to Inductor. The pass is patched into the
    config like sgraph's other settings (it marks nothing in another graph) and keys
    Inductor's caches, so kernels cached under another rule are not reused. Combo
    kernels group independent nodes without asking ``can_fuse``, so copies are kept out
    of them (the rest still share launches). Inductor's reordering for peak memory stays
    on (without it the backward's weight gradients run at the end of the backward, and
    every layer's MLP gradient stays alive until then: on the H200, gpt-med's planned
    peak was 9075 MiB without it and 8802 MiB with it), but the order it picks by its
    own estimate may hoist copies into the forward (gpt-med under a 6 GiB budget:
    recomputed matmuls of most layers ran in the forward). So each kernel holding a
    copy is then moved back down to just before the first kernel that depends on it
    (:func:`_sink_copies`).

    Args:
        gm: the graph given to ``compile_fx``; its copies carry ``RECOMPUTED_KEY``
            (without any, nothing is changed).

    Example:
        >>> with copies_in_place(gm):
        ...     compiled = compile_fx(gm, examples)
    """
    from torch._inductor import config
    from torch._inductor.virtualized import V

    positions, runs = _placement(gm.graph)
    if not runs:
        yield
        return
    mark = _MarkPlacement(id(gm.graph), positions, runs, config.post_grad_custom_post_pass)
    rule = _KeepCopiesInPlace(V.choices)
    with config.patch(post_grad_custom_post_pass=mark), V.set_choices_handler(rule), _scheduling(rule):
        yield


_SCHEDULING = threading.local()  # the fusion rule of this thread's compile of a planned step


@contextlib.contextmanager
def _scheduling(rule: _KeepCopiesInPlace) -> Iterator[None]:
    """While compiling in this thread, keep copies out of combo kernels and follow
    Inductor's reordering for peak memory by :func:`_sink_copies`.

    Inductor looks both up when it runs (``reorder_for_peak_memory`` in its module, the
    combo grouping on ``ForeachKernelSchedulerNode``), so they are wrapped there for the
    compile only; the wrappers change nothing for another thread's compile. Where the
    grouping cannot be wrapped, combo kernels are turned off instead."""
    from torch._inductor import config, memory
    from torch._inductor.scheduler import ForeachKernelSchedulerNode as Combo

    reorder = memory.reorder_for_peak_memory
    group = getattr(Combo, "group_algorithm_for_combo_kernels", None)

    def ours() -> bool:
        return getattr(_SCHEDULING, "rule", None) is rule

    def is_copy(node: Any) -> bool:
        return rule.placed(node)[1] is not None

    def reorder_then_sink(nodes: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        order = reorder(nodes, *args, **kwargs)
        return _sink_copies(order, is_copy) if ours() else order

    def groups_without_copies(scheduler: Any) -> list[list[Any]]:
        assert group is not None
        groups = group(scheduler)
        if not ours():
            return groups
        kept = ([n for n in nodes if not is_copy(n)] for nodes in groups)
        return [nodes for nodes in kept if len(nodes) > 1]

    memory.reorder_for_peak_memory = reorder_then_sink
    if group is not None:
        Combo.group_algorithm_for_combo_kernels = groups_without_copies
    _SCHEDULING.rule = rule
    try:
        with config.patch(combo_kernels=config.combo_kernels and group is not None):
            yield
    finally:
        _SCHEDULING.rule = None
        memory.reorder_for_peak_memory = reorder
        if group is not None:
            Combo.group_algorithm_for_combo_kernels = group


def _sink_copies(order: list[Any], is_copy: Callable[[Any], bool]) -> list[Any]:
    """``order`` (Inductor's scheduler nodes, a valid run order) with each node holding
    a recomputed copy moved down to just before the first node depending on it, so the
    copy is made as late as it can be and lives no longer than the plan counted.

    A node depends on another when it reads one of its buffers or must wait for it:
    Inductor records a mutation as a dependency of the mutating node on every earlier
    reader of the buffer, so no copy moves past a write to what it reads. Nodes are
    taken from the last, so a chain of copies sinks as a whole below its reader."""
    order = list(order)
    needs: dict[int, set[str]] = {}

    def needed_by(node: Any) -> set[str]:
        if id(node) not in needs:
            deps = (*node.read_writes.reads, *getattr(node, "unmet_dependencies", ()))
            needs[id(node)] = {dep.name for dep in deps}
        return needs[id(node)]

    for i in range(len(order) - 1, -1, -1):
        node = order[i]
        if not is_copy(node):
            continue
        made = set(node.get_buffer_names())
        j = i + 1
        while j < len(order) and not made & needed_by(order[j]):
            j += 1
        if j - 1 > i:
            order.insert(j - 1, order.pop(i))
    return order


def _placement(graph: torch.fx.Graph) -> tuple[dict[str, int], dict[str, int]]:
    """Each node's position, and each recomputed copy's run start (by node name)."""
    positions: dict[str, int] = {}
    runs: dict[str, int] = {}
    start: int | None = None
    for i, node in enumerate(graph.nodes):
        positions[node.name] = i
        if RECOMPUTED_KEY in node.meta:
            start = i if start is None else start
            runs[node.name] = start
        else:
            start = None
    return positions, runs


class _MarkPlacement(custom_graph_pass.CustomGraphPass):
    """Inductor's post-grad pass writing, on each node, the position of the op of the
    graph given to Inductor it comes from (and the run start of a copy), after
    running the user's own post-grad pass, if any."""

    def __init__(self, graph_id: int, positions: dict[str, int], runs: dict[str, int], inner: Any) -> None:
        self._graph_id, self._positions, self._runs = graph_id, positions, runs
        passes = inner if isinstance(inner, (list, tuple)) else [inner]
        self._inner = tuple(p for p in passes if p is not None)

    def __call__(self, graph: torch.fx.Graph) -> None:
        aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", ())
        for inner in self._inner:
            if isinstance(inner, aware):
                inner(graph, is_inference=True)  # no input of the step requires grad
            else:
                inner(graph)
        for node in graph.nodes:
            names = _sources(node, self._graph_id)
            found = [self._positions[n] for n in names if n in self._positions]
            if found:
                node.meta[_POSITION] = max(found)  # several: a pattern replaced them, the last made the value
            copied = [self._runs[n] for n in names if n in self._runs]
            if copied:
                node.meta[_COPY_RUN] = min(copied)

    def uuid(self) -> Any:
        inner = [getattr(p, "uuid", lambda: None)() for p in self._inner]
        if any(u is None for u in inner):
            return None  # a user's pass without one: Inductor bypasses its caches, as it would anyway
        key = repr((_source_hash(), sorted(self._runs.items()), inner))
        return hashlib.sha256(key.encode()).hexdigest()


def _sources(node: torch.fx.Node, graph_id: int) -> set[str]:
    """Names of the nodes of the graph ``graph_id`` that ``node`` was made from."""
    found: set[str] = set()
    stack = list(node.meta.get("from_node") or ())
    while stack:
        source = stack.pop()
        if getattr(source, "graph_id", None) == graph_id:
            found.add(source.name)
        else:
            stack.extend(getattr(source, "from_node", None) or ())
    return found


@functools.cache
def _source_hash() -> str:
    """This file's hash: a change to the fusion rule makes Inductor's cached kernels stale."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class _KeepCopiesInPlace:
    """Inductor's fusion choices (``inner``, to which everything else is left), but
    refusing the fusions that would compute a copy earlier than its run."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._leaves: dict[str, tuple[int | None, int | None]] = {}  # scheduler node name -> _leaf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        try:
            placed1, placed2 = self.placed(node1), self.placed(node2)
        except AttributeError:  # a scheduler node of another shape: leave the decision to Inductor
            placed1 = placed2 = (None, None)
        if _moves_earlier(placed1, placed2) or _moves_earlier(placed2, placed1):
            _log_refusal(node1, node2)
            return False
        return bool(self._inner.can_fuse(scheduler, node1, node2, shared_data_score))

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        """Inductor's rule for kernels that share reads, but without its distance limit
        where one holds a copy: that limit (no fusing of nodes over 64 apart) keeps
        recomputed ops of far-apart regions from being fused early, which
        :meth:`can_fuse` already refuses exactly; what it would also refuse is the copy
        joining a later backward kernel reading the same input (the recomputed GELU
        with the GELU's gradient), which makes the copy later, never earlier."""
        from torch._inductor import config

        try:
            holds_copy = self.placed(node1)[1] is not None or self.placed(node2)[1] is not None
        except AttributeError:  # a scheduler node of another shape: leave the decision to Inductor
            holds_copy = False
        if holds_copy and shared_data_score >= config.score_fusion_memory_threshold:
            return True
        return bool(self._inner.can_fuse_horizontal(scheduler, node1, node2, shared_data_score))

    def placed(self, node: Any) -> tuple[int | None, int | None]:
        """Where the earliest op of a (fused) scheduler node sits, and the earliest run
        start of the copies it computes (None: unknown, or no copies)."""
        leaves = [self._leaf(leaf) for leaf in node.get_nodes()]
        firsts = [first for first, _ in leaves if first is not None]
        runs = [run for _, run in leaves if run is not None]
        return min(firsts, default=None), min(runs, default=None)

    def _leaf(self, leaf: Any) -> tuple[int | None, int | None]:
        name = leaf.get_name()
        if name not in self._leaves:
            origins = getattr(leaf.node, "origins", None) or ()
            positions = [o.meta[_POSITION] for o in origins if _POSITION in o.meta]
            runs = [o.meta[_COPY_RUN] for o in origins if _COPY_RUN in o.meta]
            # its place is that of the op making its value: the other origins are inlined into it
            self._leaves[name] = (max(positions, default=None), min(runs, default=None))
        return self._leaves[name]


def _moves_earlier(copy: tuple[int | None, int | None], other: tuple[int | None, int | None]) -> bool:
    """Whether fusing would compute ``copy``'s copies before their run: ``other``
    starts earlier (a fused kernel runs where its earliest member was)."""
    run, first = copy[1], other[0]
    return run is not None and first is not None and first < run


def _log_refusal(node1: Any, node2: Any) -> None:
    """Say why where Inductor logs refused fusions (``TORCH_LOGS=fusion``)."""
    from torch._inductor import scheduler

    why = getattr(scheduler, "WhyNoFuse", None)
    if why is not None:
        why(node1, node2)("it would compute a recomputed copy before the place sg.plan_memory gave it")
