"""Capture a Program once as one CUDA graph, then replay it.

Buffers:
- a donated input is used in place: the user's own tensor is the graph's buffer,
  and the graph writes the matching output into it (one multi-tensor copy at the
  end of the graph), so the result holds the very same tensor objects;
- every other input is copied before each replay into a static buffer laid out as
  the program reads it: as the input is (the same strides and shared elements: see
  :class:`StaticBuffer`), except that a gapped input gets a dense buffer (the program
  was given a dense layout for it, ``passes/dense_inputs.py``);
- outputs not written into a donated input are copied out after each replay
  (``outputs="copy"``), so what the user holds is never overwritten by a later
  replay; ``outputs="view"`` hands out the graph's own buffers instead.

The first call runs the step eagerly (that run is also the warm-up: library
handles and workspaces get made outside the capture), then captures; later calls
replay. Before each replay the donated inputs' addresses are compared with those the graph
was captured for; a replaced tensor makes the graph capture again (or raise, under
``retrace="error"``) rather than run on memory the user no longer passes.

A failed capture leaves the process as it was: the current stream, the capture
mode and the CUDA RNG state are restored, whatever raised. Calls from several
threads take turns (the graph's static buffers are shared).
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..aliasing import extent
from ..capture import SOURCE_KEY
from ..errors import CaptureError, FallbackWarning, RetraceWarning, SgraphWarning, StaleBufferError, warn
from ..options import StaticOptions
from ..passes.dense_inputs import element_reach
from ..program import Program, placeholders, returned
from .eager import copy_lists, write_back
from .graph_nodes import count_kernels, new_graph
from .keepalive import kept_with

__all__ = ["CudaGraphExecutable", "StaticBuffer", "check_devices", "relaid"]


class CudaGraphExecutable:
    """One CUDA graph for a Program; see the module docstring for buffer rules.

    Args:
        program: the lowered step.
        options: ``sg.static``'s options.
        body: what the graph captures, called with the inputs and returning the
            outputs with donated ones already written (``sg.fuse``'s generated code);
            ``None`` runs the Program's ATen ops one by one.
    """

    def __init__(self, program: Program, options: StaticOptions, body: Any = None) -> None:
        check_devices(program)
        self.program = program
        self.body = body
        self.runtime = "cudagraph" if body is None else "inductor+cudagraph"
        self.options = options
        self.graph_module = program.graph_module
        self.aliases = program.aliases
        self.donated = sorted(program.donated)
        self.aliased_outputs = {o for o, _ in program.aliases}
        self.placeholder_outputs = _placeholder_outputs(program, self.aliased_outputs)
        kept = self.aliased_outputs | set(self.placeholder_outputs)
        count = sum(leaf.is_tensor for leaf in program.outputs)
        self.copied_outputs = [] if options.outputs == "view" else [i for i in range(count) if i not in kept]
        # How the program reads each input (a pass may have laid a gapped one out densely).
        self.layouts = [n.meta.get("val") for n in placeholders(program.graph)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.kept_alive: list[Any] = []  # replaced with the graph at each capture
        self.uncaptured = False
        self.captures = 0
        self.kernel_launches: int | None = None
        self.capture_seconds: float | None = None
        self.memory_measured: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._lock:
            if self.uncaptured:
                return self._run_eagerly(inputs, torch.cuda.current_stream())
            if self.graph is None or self._donated_moved(inputs):
                return self._run_then_capture(inputs)
            if self.static_inputs:
                copy_lists(self.static_buffers, [source(inputs[i]) for i, source in self.static_sources])
            self.graph.replay()
            return self._outputs(inputs)

    def _outputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        results = list(self.static_outputs)
        if self.copied_outputs:
            copies = [torch.empty_like(results[i]) for i in self.copied_outputs]
            copy_lists(copies, [results[i] for i in self.copied_outputs])
            for i, copy in zip(self.copied_outputs, copies):
                results[i] = copy
        for i, p in self.placeholder_outputs.items():
            results[i] = inputs[p]
        return results

    def _donated_moved(self, inputs: Sequence[torch.Tensor]) -> bool:
        if [inputs[i].data_ptr() for i in self.donated] == self.donated_ptrs:
            return False
        moved = [i for i, ptr in zip(self.donated, self.donated_ptrs) if inputs[i].data_ptr() != ptr]
        path = self.program.tensor_inputs[moved[0]].path
        message = (
            f"{self.program.name}: donated input {path} is not the tensor the CUDA graph was captured "
            "with (a new tensor or address was passed)"
        )
        if self.options.retrace == "error":
            raise StaleBufferError(
                message + ". Pass back the tensors the step returned, or allow a new capture with retrace='warn'."
            )
        if self.options.retrace == "warn":
            warn(message + "; capturing again. Pass back the tensors the step returned to avoid it.", RetraceWarning)
        return True

    def _run_then_capture(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the step eagerly on the capture stream (this is the call's real step, and
        the warm-up that creates library handles and workspaces outside the capture),
        then capture the graph the later calls replay."""
        start = time.perf_counter()
        self.graph, self.kept_alive = None, []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        peaks = _peaks()
        # The step's own peak is counted like the prediction: its inputs, plus what it allocates.
        base = torch.cuda.memory_allocated() - _storage_bytes(inputs)
        try:
            results = self._run_eagerly(inputs, stream)
            try:
                self._capture(inputs, stream)
            except CaptureError as error:
                self._give_up_capturing(error)
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        self.capture_seconds = time.perf_counter() - start
        after = _peaks()
        # Only a new process-wide peak is this step's own; the user's counters are not reset.
        self.memory_measured = (after[0] - base, torch.cuda.memory_reserved()) if after[0] > peaks[0] else None
        if self.memory_measured is not None and self.program.memory_plan is not None:
            _check_plan(self.program, *self.memory_measured, generated=self.body is not None)
        return results

    def _run_eagerly(self, inputs: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> list[torch.Tensor]:
        with torch.no_grad(), torch.cuda.stream(stream):
            inputs = [t if i in self.donated else relaid(t, self.layouts[i]) for i, t in enumerate(inputs)]
            if self.body is not None:
                return list(self.body(inputs))
            results = list(self.graph_module(*inputs))
            write_back(inputs, results, self.aliases)
        return results

    def _give_up_capturing(self, error: CaptureError) -> None:
        """Raise, or under ``fallback="eager"`` warn once and run uncaptured from now on.

        Either way this call's step already ran (eagerly, before the capture), so the
        donated inputs hold its results; the message says so.
        """
        note = " This call's step ran eagerly before the capture, so donated inputs hold its results."
        if self.options.fallback != "eager":
            raise CaptureError(str(error) + note) from error
        self.uncaptured = True
        warn(f"{error} Running this step uncaptured from now on (fallback='eager').", FallbackWarning)

    def _capture(self, inputs: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
        donated = set(self.donated)
        buffers = {i: StaticBuffer(t, self.layouts[i]) for i, t in enumerate(inputs) if i not in donated}
        self.static_inputs = {i: b.view for i, b in buffers.items()}
        self.static_buffers = [b.filled for b in buffers.values()]
        self.static_sources = [(i, b.source) for i, b in buffers.items()]
        graph_inputs = [self.static_inputs.get(i, t) for i, t in enumerate(inputs)]
        self.donated_ptrs = [inputs[i].data_ptr() for i in self.donated]
        graph, kept = new_graph()
        recorder = _NamingInterpreter(self.program)
        outputs: list[torch.Tensor] = []
        kept_alive: list[Any] = []  # what the graph reads that no tensor of it holds (keepalive.py)
        with kept_with(kept_alive):
            if self.body is not None:
                failure = _captured(graph, stream, lambda: outputs.extend(self.body(graph_inputs)))
            else:
                body = lambda: outputs.extend(_record(recorder, graph_inputs, self.aliases))  # noqa: E731
                failure = _captured(graph, stream, body)
        if failure is not None:
            raise recorder.capture_error(failure) from failure
        if kept:
            graph.instantiate()
        self.graph, self.static_outputs, self.kept_alive = graph, outputs, kept_alive
        self.captures += 1
        self.kernel_launches = count_kernels(graph, kept)


def _peaks() -> tuple[int, int]:
    """The process's peak allocated and reserved bytes on the current device so far."""
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


def _check_plan(program: Program, allocated: int, reserved: int, *, generated: bool) -> None:
    """Warn, with the predicted breakdown, when a planned step went over its budget, or
    (with no budget) over 10% and 128 MiB beyond the planned peak."""
    from ..passes.memory.analysis import memory_analysis

    predicted = memory_analysis(program, generated=generated)
    budget = program.memory_plan.budget
    limit = budget if budget is not None else max(1.1 * predicted.peak_bytes, predicted.peak_bytes + 2**27)
    if allocated <= limit:
        return
    kinds = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(predicted.by_kind.items(), key=lambda kv: -kv[1]))
    warn(
        f"{program.name}: the first step allocated {allocated / 2**20:.0f} MiB at its peak ({reserved / 2**20:.0f} "
        f"MiB reserved), over the {limit / 2**20:.0f} MiB allowed by sg.plan_memory's plan of "
        f"{predicted.peak_bytes / 2**20:.0f} MiB (MiB by kind at "
        f"the planned peak: {kinds}). The difference is memory the plan does not see: copies of inputs that "
        "are not donated, buffers generated kernels keep to themselves, workspaces of libraries other than "
        "cuBLAS, or tensors allocated outside the step. Lower the budget by that much to fit.",
        SgraphWarning,
    )


def _record(recorder: _NamingInterpreter, inputs: list[torch.Tensor], aliases: Any) -> list[torch.Tensor]:
    outputs = list(recorder.run(*inputs))
    write_back(inputs, outputs, aliases)
    return outputs


def _captured(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, body: Any) -> Exception | None:
    """Capture ``body()`` into ``graph`` on ``stream``; return what raised, if anything.

    Unlike ``torch.cuda.graph``, the capture always ends and the previous stream is
    always current again, even when the body or the end of the capture raises.
    Other threads may use the GPU meanwhile (thread-local capture mode).
    """
    failure: Exception | None = None
    torch.cuda.synchronize()
    rng = _rng_snapshot()
    with torch.no_grad(), torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        except Exception as error:
            failure = error
        finally:
            try:
                with warnings.catch_warnings():
                    # A step whose tensors are all empty launches nothing; torch's warning
                    # would blame a wrong device or stream, and neither is the case here.
                    warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                    graph.capture_end()
            except Exception as error:
                failure = failure or error
    if failure is not None:
        _rng_restore(rng)
    return failure


def _rng_snapshot() -> tuple[Any, Any]:
    """The CUDA generator and a copy of its state, taken before a capture."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    if hasattr(generator, "clone_state") and hasattr(generator, "graphsafe_set_state"):
        return generator, generator.clone_state()
    return None, torch.cuda.get_rng_state()


def _rng_restore(snapshot: tuple[Any, Any]) -> None:
    """Undo a failed capture's hold on the CUDA generator.

    A capture registers the generator's state; when the capture fails, torch never
    releases it, and every later random op raises "Offset increment outside graph
    capture". Swapping in the copy taken before the capture gives the generator a
    fresh state object with the numbers it had then.
    """
    generator, saved = snapshot
    if generator is not None:
        generator.graphsafe_set_state(saved)
    else:
        torch.cuda.set_rng_state(saved)


class _NamingInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node during capture, remembering which node failed."""

    def __init__(self, program: Program) -> None:
        super().__init__(program.graph_module)
        self.program = program
        self.failed: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            self.failed = self.failed or n
            raise

    def capture_error(self, error: Exception) -> CaptureError:
        node = self.failed
        if node is None:
            what = "capturing the CUDA graph failed"
        else:
            source = node.meta.get(SOURCE_KEY)
            where = f" at {source.describe()}" if source else ""
            what = f"{node.target} (node %{node.name}){where} cannot be captured into a CUDA graph"
        return CaptureError(
            f"{self.program.name}: {what}: {type(error).__name__}: {error}. Ops that synchronize "
            "with the host or allocate host memory cannot run inside a graph; rewrite that line "
            "with device-side tensor ops, or pass fallback='eager' to run this step uncaptured."
        )


class StaticBuffer:
    """The graph's buffer for a non-donated input ``t``, refilled before every replay.

    ``view`` is what the graph reads: new memory with the strides the program reads,
    which generated code has built in (code compiled for ``y[:, ::2]`` reads every
    other element; a contiguous buffer would feed it the wrong ones). Those are
    ``layout``'s where it is laid out otherwise than ``t`` (a dense layout for a
    gapped input, ``passes/dense_inputs.py``), else ``t``'s own. ``filled`` is what
    the refill writes, from ``source(input)``: ``view`` itself, or, for a tensor whose
    elements may share memory (an expanded view, an overlapping ``as_strided``), which
    ``copy_`` cannot write, the flat span of memory from its first element to its last,
    copied whole from the same span of the input (the signature guarantees each call's
    input the traced strides).
    """

    def __init__(self, t: torch.Tensor, layout: Any = None) -> None:
        t = t.detach()
        if _laid_out_otherwise(t, layout):
            self.view = self.filled = torch.empty_strided(t.shape, layout.stride(), dtype=t.dtype, device=t.device)
            self.source = _itself
        elif _elements_are_apart(t):
            self.view = self.filled = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self.source = _itself
        else:
            span = extent(t.shape, t.stride(), 1)
            self.filled = torch.empty(span, dtype=t.dtype, device=t.device)
            self.view = self.filled.as_strided(t.shape, t.stride(), 0)
            self.source = functools.partial(_span, span=span)
        self.filled.copy_(self.source(t))


def relaid(t: torch.Tensor, layout: Any) -> torch.Tensor:
    """``t``, or a copy of it with ``layout``'s strides where the program reads it so."""
    if not _laid_out_otherwise(t, layout):
        return t
    copy = torch.empty_strided(t.shape, layout.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t.detach())


def _laid_out_otherwise(t: torch.Tensor, layout: Any) -> bool:
    """Whether ``layout`` (a placeholder's value) has strides other than ``t``'s, in a
    dimension of more than one element."""
    if not isinstance(layout, torch.Tensor) or layout.shape != t.shape:
        return False
    return any(n > 1 and a != b for n, a, b in zip(t.shape, t.stride(), layout.stride()))


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _span(t: torch.Tensor, span: int) -> torch.Tensor:
    return t.detach().as_strided((span,), (1,))


def _elements_are_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` can share memory (a layout that fails this may
    still not overlap; it is then copied as a span, which is right for any layout)."""
    return element_reach(t) is not None


def check_devices(program: Program) -> None:
    """Raise :class:`CaptureError` naming the first input that is not a CUDA tensor."""
    for leaf in program.tensor_inputs:
        if leaf.device is not None and leaf.device.type != "cuda":
            raise CaptureError(
                f"{program.name}: input {leaf.path} is a {leaf.device.type} tensor while the step runs "
                "as a CUDA graph, which would freeze its value at capture time. Move it to the GPU "
                "(or pass it as a Python number, a static argument)."
            )


def _placeholder_outputs(program: Program, aliased: set[int]) -> dict[int, int]:
    """Outputs that are inputs returned unchanged (and not donated): output index -> placeholder index."""
    inputs = placeholders(program.graph)
    values = returned(program.graph)
    return {i: inputs.index(node) for i, node in enumerate(values) if node in inputs and i not in aliased}
