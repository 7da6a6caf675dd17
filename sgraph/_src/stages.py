"""The three stages of a transformed step, as in JAX: Traced -> Lowered -> Compiled.

``Traced`` holds the Program straight from tracing; ``Lowered`` the Program after
the passes; ``Compiled`` an executable for it, callable with the same arguments.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from . import tree
from .agreement import DEFAULT_TIMEOUT, agree
from .aliasing import AliasGuard, copy_exactly, extent, overlapping_pairs, tensor_extent
from .argtree import ArgFlattener
from .collector import full_collections_deferred
from .dtensors import dist_info, is_dtensor, local, wrap
from .errors import ArgumentTypeError
from .guards import autocast_enabled, autocast_off, global_state
from .options import Options
from .passes.memory.analysis import MemoryAnalysis, memory_analysis
from .passes.memory.plan import MemoryPlan
from .passes.pipeline import lower as run_passes
from .passes.pipeline import replays_as_graph
from .passes.shard.cost import CostAnalysis, Links, cost_analysis
from .program import Program, compute_ops, memory_root, placeholders, returned, tensor_constants
from .runtime.eager import EagerExecutable
from .signature import ClosureCheck, Signature, signature_of
from .source import SOURCE_KEY, where
from .text import describe_tensor
from .trace import ArgLayout

__all__ = ["Traced", "Lowered", "Compiled", "CompiledStats", "Counters"]


@dataclass
class Counters:
    """Shared between a transformed function and everything compiled from it."""

    traces: int = 0
    retraces: int = 0


@dataclass(frozen=True)
class CompiledStats:
    """A snapshot of a compiled step's counters.

    Attributes:
        runtime: ``"eager"`` (graph run op by op), ``"cudagraph"`` (eager kernels in
            one CUDA graph), ``"inductor"`` (generated kernels, no graph: ``sg.fuse``
            alone, or on CPU) or ``"inductor+cudagraph"``.
        kernel_launches: kernels per step, counted from the captured CUDA graph
            (``None`` when there is no graph).
        capture_seconds: time spent warming up and capturing (``None`` without a graph).
        kernels_unfused: under ``sg.fuse``, the kernels the same lowered step
            launches op by op: its ATen ops that compute data (views excluded; a
            multi-tensor op counts once, though ATen may split it into a few launches).
        kernels_fused: under ``sg.fuse``, the kernel calls of the generated code per
            step (generated kernels, library matmuls and own kernels alike).
        compile_seconds: under ``sg.fuse``, time spent generating kernels (on-disk
            cache hits included).
        inductor_entry: under ``sg.fuse``, how the step entered Inductor: ``"direct"``
            (below AOTAutograd, see docs/fuse.md) or ``"compile_fx"``.
        block_calls / block_subgraphs: under ``sg.fuse``, how many copies of repeated
            blocks (forward and backward apart) call code compiled once, and how many
            distinct compiled blocks they call (``sg.fuse(reuse_blocks=...)``; 0 when
            none was found).
        memory_predicted: the predicted peak bytes of one step
            (``Lowered.memory_analysis()``).
        memory_measured: under ``sg.static`` on a GPU, the peak bytes allocated
            during the call that warmed up and captured the graph, counted like the
            prediction: the step's inputs plus what the call allocated beyond what
            was allocated before it. Read from the process's peak counter when that
            call raised it, else ``None`` (sgraph never resets your counters).
        memory_reserved: the bytes the caching allocator held after that call (the
            process's, cached blocks included: beyond allocated is cache and
            fragmentation).
        calls: how many times this compiled step ran (replays, for a CUDA graph).
        traces / retraces: of the transformed function, at snapshot time.
        trace_seconds / lower_seconds: time spent in those stages for this signature.
    """

    runtime: str
    kernel_launches: int | None
    capture_seconds: float | None
    calls: int
    traces: int
    retraces: int
    trace_seconds: float
    lower_seconds: float
    kernels_unfused: int | None = None
    kernels_fused: int | None = None
    compile_seconds: float | None = None
    inductor_entry: str | None = None
    block_calls: int | None = None
    block_subgraphs: int | None = None
    memory_predicted: int | None = None
    memory_measured: int | None = None
    memory_reserved: int | None = None

    def __repr__(self) -> str:
        fields = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL_STATS:
                continue  # only sg.fuse, or a captured graph, has them
            fields.append(f"{f.name}={value:.3g}" if isinstance(value, float) else f"{f.name}={value!r}")
        return f"CompiledStats({', '.join(fields)})"


_OPTIONAL_STATS = (
    "kernels_unfused",
    "kernels_fused",
    "compile_seconds",
    "inductor_entry",
    "block_calls",
    "block_subgraphs",
    "memory_measured",
    "memory_reserved",
)


class _Stage:
    program: Program

    def as_text(self) -> str:
        """A readable listing of the graph's ATen ops with the user's source lines."""
        return self.program.as_text()

    @property
    def graph(self) -> torch.fx.Graph:
        """The FX graph (forward, backward and update in one)."""
        return self.program.graph

    def _summary(self) -> str:
        p = self.program
        return f"{p.name}: {len(p.ops())} ops, {len(p.tensor_inputs)} tensor inputs"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._summary()})"

    def _repr_html_(self) -> str:
        body = html.escape(self.as_text())
        return (
            f"<details><summary><code>{html.escape(repr(self))}</code></summary>"
            f"<pre style='font-size:smaller'>{body}</pre></details>"
        )


class Traced(_Stage):
    """A step traced into one graph, before any pass.

    Attributes:
        program: the :class:`Program`.
        signature: the argument signature it was traced for.
    """

    def __init__(
        self,
        program: Program,
        signature: Signature,
        layout: ArgLayout,
        options: Options,
        counters: Counters,
        seconds: float,
        layout_of: Callable[[Sequence[Any], dict[str, Any]], ArgLayout] | None = None,
    ) -> None:
        self.program = program
        self.signature = signature
        self.layout = layout
        self.layout_of = layout_of  # another call's leaf paths, for messages
        self.options = options
        self.counters = counters
        self.seconds = seconds

    def lower(self) -> Lowered:
        """Run the passes (cleanup, donation, and those the transforms ask for)."""
        start = time.perf_counter()
        with full_collections_deferred(), autocast_off():
            program = run_passes(self.program, self.options)
        return Lowered(program, self, time.perf_counter() - start)


class Lowered(_Stage):
    """A step after the passes; ``compile()`` makes it callable."""

    def __init__(self, program: Program, traced: Traced, seconds: float) -> None:
        self.program = program
        self.traced = traced
        self.seconds = seconds
        self._memory: MemoryAnalysis | None = None

    def memory_analysis(self) -> MemoryAnalysis:
        """The predicted memory of one run of this step: peak bytes, the op at the peak
        with its source line, bytes by kind, the largest live buffers (fake tensors
        only: nothing runs). See :mod:`sgraph._src.passes.memory.analysis`.

        Example:
            >>> print(train_step.lower(params, opt_state, batch).memory_analysis())
        """
        if self._memory is None:
            self._memory = memory_analysis(self.program, generated=self.traced.options.fuse is not None)
        return self._memory

    def cost_analysis(self, links: Links | None = None) -> CostAnalysis:
        """What one run costs each rank: its predicted peak memory and, per collective,
        the bytes it moves and its time under an alpha-beta model of the links (``links``,
        else ``sg.shard``'s, else H200 nodes of 8; see :class:`sg.Links`).

        Example:
            >>> print(train_step.lower(params, opt_state, batch).cost_analysis())
        """
        shard = self.traced.options.shard
        chosen = links or (shard.links if shard is not None else None)
        return cost_analysis(self.program, chosen, self.memory_analysis())

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """What ``sg.plan_memory`` decided for this step (None without it).

        Example:
            >>> print(train_step.lower(params, opt_state, batch).memory_plan.as_text())
        """
        return cast("MemoryPlan | None", self.program.memory_plan)

    def compile(self) -> Compiled:
        """An executable for this Program: its ATen ops run eagerly, or under ``sg.fuse``
        generated kernels; under ``sg.static`` on a GPU, either replays as one CUDA graph."""
        options = self.traced.options
        graph = replays_as_graph(self.program, options)
        if graph:
            from .runtime.cudagraph import check_devices

            check_devices(self.program)  # before a long compile, not after
        body: Any = None
        if options.fuse is not None:
            from .runtime.inductor import InductorExecutable

            with full_collections_deferred(), autocast_off():
                body = InductorExecutable(self.program, options.fuse)
        if graph:
            from .runtime.cudagraph import CudaGraphExecutable

            return Compiled(self, CudaGraphExecutable(self.program, options.effective_static, body))
        return Compiled(self, body if body is not None else EagerExecutable(self.program))


class Compiled(_Stage):
    """A callable compiled step for one argument signature.

    Calling it with arguments of another signature raises ``TypeError`` naming the
    leaf that differs (the transformed function, not this stage, retraces).
    """

    def __init__(self, lowered: Lowered, executable: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]) -> None:
        self.program = lowered.program
        self.lowered = lowered
        self.executable = executable
        self.calls = 0
        traced = lowered.traced
        self._signature, self._layout, self._counters = traced.signature, traced.layout, traced.counters
        self._layout_of = traced.layout_of
        self._positions = [i for i, leaf in enumerate(self.program.inputs) if leaf.is_tensor]
        outputs = self.program.outputs
        # Output leaves in order: the graph's outputs as they are when every leaf is a
        # tensor in graph order (the usual case), else a plan of (graph index, constant).
        self._plain_outputs = all(o.graph_index == i for i, o in enumerate(outputs))
        self._output_plan = [(o.graph_index, o.value) for o in outputs]
        constants = _constants(traced.program)
        self.alias = _alias_guard(self.program, traced, constants)
        self._passed_through = _passed_through(self.program)
        self.closure = ClosureCheck(constants)
        self._sharded = any(leaf.dist is not None for leaf in (*self.program.inputs, *outputs))
        self._out_dists = [o.dist for o in outputs if o.is_tensor]
        self._out_specs: list[Any] = [None] * len(self._out_dists)
        self._returned_inputs: dict[int, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, structure = ArgFlattener().flatten(args, kwargs)
        expected = self._signature
        signature = signature_of(
            leaves, structure, self._layout.paths, global_state(), expected.modules.now(), self._layout.names
        )
        if signature != expected:
            raise ArgumentTypeError(
                f"{self.program.name}: this compiled step was made for other arguments: "
                f"{self._named(args, kwargs, signature).difference(expected)}. Call the transformed "
                "function instead (it traces again for new signatures)."
            )
        if not self.closure.holds():
            raise ArgumentTypeError(
                f"{self.program.name}: this compiled step was made for other closed-over tensors: "
                f"{self.closure.change()}. Call the transformed function instead (it traces again)."
            )
        if autocast_enabled():
            with autocast_off():
                return self.call_flat(leaves)
        return self.call_flat(leaves)

    def _named(self, args: Sequence[Any], kwargs: dict[str, Any], signature: Signature) -> Signature:
        """``signature`` with this call's own leaf paths (it was built with the traced ones)."""
        if self._layout_of is None:
            return signature
        layout = self._layout_of(args, kwargs)  # a call the step cannot take raises Python's TypeError
        return dataclasses.replace(signature, paths=layout.paths, names=layout.names)

    def call_flat(self, leaves: list[Any]) -> Any:
        """Run on already-flattened, already-checked arguments."""
        return self.call_tensors([leaves[i] for i in self._positions])

    def call_tensors(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Run on the call's tensor leaves alone (signature already checked); inputs that
        share memory with donated ones are checked here, on every call."""
        if self._sharded:
            return self._call_sharded(tensors)
        outputs = self.executable(self.alias.prepare(tensors))
        self.calls += 1
        if self._passed_through:
            _copy_repeated(outputs, self._passed_through)
        if self._plain_outputs:
            return tree.unflatten(self.program.out_spec, outputs)
        result = [value if i is None else outputs[i] for i, value in self._output_plan]
        return tree.unflatten(self.program.out_spec, result)

    def _call_sharded(self, tensors: Sequence[torch.Tensor]) -> Any:
        """DTensors in as local shards, out as DTensors (a donated input's own object
        where its output was written into it)."""
        if self.calls == 0:
            shard = self.lowered.traced.options.shard
            timeout = datetime.timedelta(seconds=shard.timeout if shard is not None else DEFAULT_TIMEOUT)
            agree(self.program, tensors, timeout)  # before the first collective: a mismatch would hang
            self._returned_inputs = {
                out: into
                for out, into in self.program.aliases
                if is_dtensor(tensors[into]) and self._out_dists[out] == dist_info(tensors[into])
            }  # the signature fixes every later call's layouts: these hold for them too
        outputs = self.executable(self.alias.prepare([local(t) for t in tensors]))
        self.calls += 1
        if self._passed_through:
            _copy_repeated(outputs, self._passed_through)  # on the local shards, before wrapping
        for out, into in self._returned_inputs.items():
            outputs[out] = tensors[into]
        wrap(outputs, self._out_dists, self._out_specs, skip=self._returned_inputs)
        result = [value if i is None else outputs[i] for i, value in self._output_plan]
        return tree.unflatten(self.program.out_spec, result)

    @property
    def stats(self) -> CompiledStats:
        """Counters of this compiled step (see :class:`CompiledStats`)."""
        ex = self.executable
        fused = self._fused
        measured = getattr(ex, "memory_measured", None)
        return CompiledStats(
            runtime=getattr(ex, "runtime", "eager"),
            kernel_launches=getattr(ex, "kernel_launches", None),
            capture_seconds=getattr(ex, "capture_seconds", None),
            calls=self.calls,
            traces=self._counters.traces,
            retraces=self._counters.retraces,
            trace_seconds=self.lowered.traced.seconds,
            lower_seconds=self.lowered.seconds,
            kernels_unfused=None if fused is None else compute_ops(self.program),
            kernels_fused=None if fused is None else fused.kernels.count,
            compile_seconds=None if fused is None else fused.compile_seconds,
            inductor_entry=None if fused is None else fused.entry,
            block_calls=None if fused is None else fused.block_calls,
            block_subgraphs=None if fused is None else fused.block_subgraphs,
            memory_predicted=self.lowered.memory_analysis().peak_bytes,
            memory_measured=None if measured is None else measured[0],
            memory_reserved=None if measured is None else measured[1],
        )

    @property
    def _fused(self) -> Any:
        """The Inductor executable, alone or inside the CUDA graph (None without ``sg.fuse``)."""
        ex = self.executable
        inner = getattr(ex, "body", None)
        for candidate in (ex, inner):
            if getattr(candidate, "runtime", None) == "inductor":
                return candidate
        return None

    def as_text(self) -> str:
        """The listing of :meth:`Program.as_text`; under ``sg.fuse`` each op also names the
        generated kernel call(s) computing it (``#3 triton_per_fused_...``), and the
        kernels follow, in the order they run, with the ops each one computes; then the
        kernel calls inside each repeated block's shared code (``sg.fuse(reuse_blocks=True)``)."""
        fused = self._fused
        if fused is None or not fused.kernels.of_node:
            return self.program.as_text()
        notes = {name: ", ".join(k.label for k in ks[:3]) for name, ks in fused.kernels.of_node.items()}
        lines = [self.program.as_text(notes), f"  kernels ({fused.kernels.count} calls per step):"]
        for kernel in fused.kernels.kernels:
            ops = ", ".join(f"%{n}" for n in kernel.nodes[:8]) + (" ..." if len(kernel.nodes) > 8 else "")
            lines.append(f"    {kernel.label}: {ops}")
        for block in fused.kernels.blocks:  # Inductor's record does not say which of a block's nodes each kernel runs
            lines.append(f"  block code {block.name} ({block.calls} calls per step), its kernel calls:")
            lines += [f"    {block.name}.{i} {name}" for i, name in enumerate(block.kernels, 1)]
        return "\n".join(lines)


def _alias_guard(program: Program, traced: Traced, constants: list[tuple[str, torch.Tensor]]) -> AliasGuard:
    """The per-call aliasing check of a program, from the byte extents its signature fixes."""
    keys = [key for key in traced.signature.leaves if key[0] in ("tensor", "dtensor")]
    # a DTensor's key does not fix its local shard's layout: that extent is read per call
    extents = [extent(key[1], key[4], key[2].itemsize) if key[0] == "tensor" else None for key in keys]
    written = traced.program.written_inputs()  # the step's own writes, before reinplacing adds ours
    return AliasGuard(
        program.name,
        [leaf.path for leaf in program.tensor_inputs],
        extents,
        program.donated,
        frozenset(written & program.donated),
        constants,
    )


def _passed_through(program: Program) -> list[int]:
    """The graph outputs that are (views of) inputs not donated, where there are two or
    more and the step donates: inputs that are one tensor on a call (``step(w, w)``)
    come back as one tensor at two places, which :func:`_copy_repeated` separates."""
    if not program.donated:
        return []
    inputs = {node: i for i, node in enumerate(placeholders(program.graph))}
    found = []
    for k, value in enumerate(returned(program.graph)):
        root = memory_root(value) if isinstance(value, torch.fx.Node) else None
        if root in inputs and inputs[root] not in program.donated:
            found.append(k)
    return found if len(found) > 1 else []


def _copy_repeated(outputs: list[torch.Tensor], positions: Sequence[int]) -> None:
    """Replace each of ``outputs[positions]`` that shares memory with an earlier one left
    as it is by a copy: a step with donated arguments never returns one tensor at two
    places, since the user may pass either back donated (the graph itself makes sure of
    that for one input returned twice; two inputs that are one tensor are known on the
    call only)."""
    tensors = [outputs[k] for k in positions]
    sizes = [tensor_extent(t) for t in tensors]
    earlier: dict[int, set[int]] = {}
    for a, b in overlapping_pairs([t.data_ptr() for t in tensors], sizes):
        earlier.setdefault(max(a, b), set()).add(min(a, b))
    copied: set[int] = set()
    for i in sorted(earlier):
        if earlier[i] - copied:
            outputs[positions[i]] = copy_exactly(tensors[i])
            copied.add(i)


def _constants(program: Program) -> list[tuple[str, torch.Tensor]]:
    """The tensors the step closed over, each described by its shape and the line reading it."""
    found = []
    for node, value in tensor_constants(program.graph_module):
        source = next((u.meta[SOURCE_KEY] for u in node.users if SOURCE_KEY in u.meta), None)
        found.append((f"a tensor {describe_tensor(value.dtype, tuple(value.shape))}{where(source)}", value))
    return found
