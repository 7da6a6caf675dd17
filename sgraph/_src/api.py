"""The public transforms: validate options once, record them, wrap the step.

Each transform returns a :class:`Transformed`; stacking transforms adds records to
the same :class:`Options`, and the pass pipeline reads them in one canonical order,
so the order of the decorators does not change the meaning.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, overload

from . import guards
from .argtree import ArgFlattener, CallStructure
from .collector import full_collections_deferred
from .dispatch import Entry, check_call_inputs, nearest
from .errors import ArgumentError, ArgumentTypeError, CaptureError, FallbackWarning, RetraceError, RetraceWarning, warn
from .options import (
    Fallback,
    FuseOptions,
    MemoryOptions,
    MemoryPolicy,
    Options,
    OutputMode,
    Retrace,
    StaticOptions,
    check_budget,
    check_donate,
    check_kernels,
    check_literal,
    check_patterns,
    check_unknown,
)
from .passes.shard.cost import Links
from .placing import Sharder, ShardOptions, check_shard_options, check_spec_names, check_specs
from .runtime.workers import start_compile_workers
from .sharding import mesh_axes
from .signature import Signature, signature_of
from .stages import Compiled, Counters, Traced
from .trace import ArgLayout, arg_layout, positional_names, trace

__all__ = ["static", "fuse", "plan_memory", "shard", "Transformed"]


class Transformed:
    """A step wrapped by sgraph transforms: call it, or stage it with ``.trace``.

    Calls from several threads are safe: a new signature is traced once (the other
    threads wait for it), and calls of compiled signatures do not wait for each other.

    Attributes:
        fn: the user's step.
        options: the validated options of every transform applied.
        trace_count: how many times the step was traced.
    """

    def __init__(self, fn: Callable[..., Any], options: Options, *, bound: Any = None) -> None:
        self.fn = fn
        self.options = options
        self._entries: dict[CallStructure, list[Entry]] = {}
        self._flattener = ArgFlattener()
        self._last: Entry | None = None
        self._counters = Counters()
        self._fallback_reason: str | None = None
        self._lock = threading.RLock()
        self._bound = weakref.ref(bound) if bound is not None else None
        self._methods: weakref.WeakKeyDictionary[Any, Transformed] = weakref.WeakKeyDictionary()
        self._sharder = None if options.shard is None else Sharder(self.api, options.shard)
        self._positional: dict[int, list[str]] = {}
        functools.update_wrapper(self, fn)

    @property
    def api(self) -> str:
        """How messages name this step, e.g. ``sg.static(train_step)`` (the outermost
        transform that decides how it runs: ``sg.static``, else ``sg.fuse``)."""
        options = self.options
        transform = next(
            (name for name, record in (("fuse", options.fuse), ("plan_memory", options.memory)) if record is not None),
            "shard" if options.shard is not None else "static",
        )
        return f"sg.{'static' if options.static is not None else transform}({_name(self.fn)})"

    @property
    def trace_count(self) -> int:
        """How many times the step has been traced (one per new signature, plus explicit ``.trace``)."""
        return self._counters.traces

    @property
    def last_compiled(self) -> Compiled | None:
        """The compiled step that ran on the latest call (its ``.stats``, listing...);
        None before the first call.

        Raises:
            CaptureError: the step fell back to running eagerly (``fallback="eager"``),
                so no compiled step runs; the message gives the reason.
        """
        if self._fallback_reason is not None:
            raise CaptureError(
                f"{self.api} runs eagerly since it could not be captured (fallback='eager'), so there is "
                f"no compiled step. Reason: {self._fallback_reason}"
            )
        return self._last.compiled if self._last is not None else None

    # ----------------------------------------------------------------------- calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if guards.is_tracing() or self._fallback_reason is not None:
            # Inside another step's trace this step is part of that step, as jit inside jit.
            return self._call_fn(args, kwargs)
        if self._sharder is not None:
            args, kwargs = self._placed(args, kwargs)
        leaves, structure = self._flattener.flatten(args, kwargs)
        state = guards.global_state()
        found = self._lookup(leaves, structure, state)
        if found is not None:
            return found[0].run(found[1])
        return self._first_call(args, kwargs, leaves, structure, state)

    def _lookup(
        self, leaves: list[Any], structure: CallStructure, state: guards.GlobalState
    ) -> tuple[Entry, Sequence[Any]] | None:
        """The compiled entry that accepts this call, with the call's tensors."""
        for entry in self._entries.get(structure, ()):
            tensors = entry.accepts(leaves, state)
            if tensors is not None:
                self._last = entry
                return entry, tensors
        return None

    def _call_fn(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self._bound is None:
            return self.fn(*args, **kwargs)
        return self.fn(self._instance(), *args, **kwargs)

    def _first_call(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        leaves: list[Any],
        structure: CallStructure,
        state: guards.GlobalState,
    ) -> Any:
        """Trace, lower and compile for a new signature, then run (a CUDA graph captures on its first run)."""
        with self._lock:
            found = self._lookup(leaves, structure, state)  # another thread may have made it meanwhile
            if found is not None:
                return found[0].run(found[1])
            if self._fallback_reason is not None:
                return self._call_fn(args, kwargs)
            self._check_binding(args, kwargs)
            layout = self._layout(args, kwargs)
            check_call_inputs(self.api, leaves, layout.paths, layout.donated_leaves)
            # One full collection after the first call instead of several during it
            # (each walks the whole heap; see collector.py).
            with full_collections_deferred():
                signature = signature_of(leaves, structure, layout.paths, state, names=layout.names)
                self._check_retrace(signature)
                if self.options.fuse is not None:  # the step will be compiled: its workers start while it is traced
                    start_compile_workers(signature.devices())
                try:
                    traced = self._trace(args, kwargs, layout, signature)
                    entry = Entry(traced.lower().compile(), traced.signature, leaves)
                    result = entry.run(entry.first_call(leaves, state))
                except CaptureError as e:
                    if self._static.fallback != "eager":
                        raise
                    self._fall_back(e)
                    return self._call_fn(args, kwargs)
            self._entries.setdefault(structure, []).append(entry)
            self._last = entry
            return result

    def _check_binding(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise the ``TypeError`` Python would for a call the step cannot take."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        try:
            sig.bind(*((None,) if self._bound is not None else ()), *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{_name(self.fn)}(): {e}") from None

    def _check_retrace(self, signature: Signature) -> None:
        entries = [e for es in self._entries.values() for e in es]
        if not entries:
            return
        change = nearest(signature, entries)
        policy = self._static.retrace
        message = (
            f"{self.api} is traced again (trace {self._counters.traces + 1}) because {change}. "
            "Each new signature compiles a new program; keep shapes and static arguments fixed "
            "(pad the last batch, pass changing numbers as tensors)"
        )
        if policy == "error":
            raise RetraceError(message + ", or pass retrace='warn' to allow it.")
        if policy == "warn":
            warn(message + ", or pass retrace='allow' to silence this.", RetraceWarning)
        self._counters.retraces += 1

    # ----------------------------------------------------------------------- stages

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace the step for these arguments into one graph (no cache, no retrace policy).

        Example:
            >>> print(train_step.trace(params, opt_state, batch).as_text())
        """
        if self._sharder is not None:
            args, kwargs = self._placed(args, kwargs)
        leaves, structure = ArgFlattener().flatten(args, kwargs)
        self._check_binding(args, kwargs)
        layout = self._layout(args, kwargs)
        check_call_inputs(self.api, leaves, layout.paths, layout.donated_leaves)
        signature = signature_of(leaves, structure, layout.paths, guards.global_state(), names=layout.names)
        return self._trace(args, kwargs, layout, signature)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Shorthand for ``self.trace(*args, **kwargs).lower()``."""
        return self.trace(*args, **kwargs).lower()

    def _trace(self, args: Sequence[Any], kwargs: dict[str, Any], layout: ArgLayout, signature: Signature) -> Traced:
        start = time.perf_counter()
        bound = () if self._bound is None else (self._instance(),)
        kernels = self.options.fuse.kernels if self.options.fuse is not None else ()
        if self.options.memory is not None:
            # The GELU stays generated code, which a memory plan can recompute instead
            # of saving; the own MLP kernel's GELU comes out of a matmul.
            kernels = tuple(k for k in kernels if k != "gelu_mlp")
        compute, out_layout = [], None
        if self._sharder is not None:
            compute = self._sharder.compute(self._named(args, kwargs))
            out_layout = self._sharder.out_layout()
        with full_collections_deferred():
            program = trace(
                self.fn,
                args,
                kwargs,
                api=self.api,
                layout=layout,
                bound=bound,
                kernels=kernels,
                compute=compute,
                out_layout=out_layout,
            )
        self._counters.traces += 1
        signature = Signature(
            signature.structure,
            signature.leaves,
            signature.state,
            guards.ModuleFlags.of([*program.modules, *guards.modules_in(self.fn, [*bound, *args, *kwargs.values()])]),
            signature.paths,
            signature.names,
        )
        return Traced(
            program, signature, layout, self.options, self._counters, time.perf_counter() - start, self._bound_layout
        )

    def _named(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
        """The arguments with their parameter names, in the order their leaves flatten
        (the names of each count of positional arguments are read from the signature once:
        a sharded step calls this on every call)."""
        names = self._positional.get(len(args))
        if names is None:
            skip = 0 if self._bound is None else 1
            names = self._positional[len(args)] = positional_names(self.fn, len(args) + skip)[skip:]
        return [*zip(names, args), *((k, kwargs[k]) for k in sorted(kwargs))]

    def _placed(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with plain tensors laid out as DTensors, as ``sg.shard``'s specs say."""
        assert self._sharder is not None
        placed = self._sharder.place(self._named(args, kwargs))
        n = len(args)
        return tuple(placed[:n]), dict(zip(sorted(kwargs), placed[n:]))

    def _bound_layout(self, args: Sequence[Any], kwargs: dict[str, Any]) -> ArgLayout:
        """The layout of a call Python would take; raises Python's ``TypeError`` otherwise."""
        self._check_binding(args, kwargs)
        return self._layout(args, kwargs)

    def _layout(self, args: Sequence[Any], kwargs: dict[str, Any]) -> ArgLayout:
        return arg_layout(self.fn, args, kwargs, self._static.donate, skip=0 if self._bound is None else 1)

    @property
    def _static(self) -> StaticOptions:
        return self.options.effective_static

    def _fall_back(self, error: CaptureError) -> None:
        self._fallback_reason = str(error)
        warn(
            f"{self.api}: the step cannot be captured, so it runs eagerly from now on "
            f"(fallback='eager'). Reason: {error}",
            FallbackWarning,
        )

    # ----------------------------------------------------------------------- methods

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@sg.static`` on a method: each instance gets its own compiled steps."""
        if instance is None or self._bound is not None:
            return self
        try:
            found = self._methods.get(instance)
            if found is None:
                found = self._methods[instance] = Transformed(self.fn, self.options, bound=instance)
            return found
        except TypeError:  # an instance that cannot be weakly referenced or hashed
            return functools.partial(self, instance)

    def _instance(self) -> Any:
        assert self._bound is not None
        instance = self._bound()
        if instance is None:
            raise ReferenceError(f"{self.api}: the object this method was bound to no longer exists.")
        return instance

    # ----------------------------------------------------------------------- display

    def __repr__(self) -> str:
        n = sum(len(es) for es in self._entries.values())
        options, default = self._static, StaticOptions()
        shown = [
            f" {k}={getattr(options, k)!r}"
            for k in ("donate", "retrace", "fallback", "outputs")
            if getattr(options, k) != getattr(default, k)
        ]
        fuse = self.options.fuse
        if fuse is not None:
            fuse_shown = [
                f"{k}={getattr(fuse, k)!r}"
                for k in ("autotune", "kernels", "reuse_blocks", "channels_last")
                if getattr(fuse, k) != getattr(FuseOptions(), k)
            ]
            if self.options.static is not None:
                shown.append(f" fuse({', '.join(fuse_shown)})")
            else:
                shown += [f" {item}" for item in fuse_shown]
        head = f"<{self.api}{''.join(shown)}: {n} compiled signature{'s' * (n != 1)}, {self.trace_count} traces"
        if self._fallback_reason is not None:
            return head + f"; fell back to eager: {self._fallback_reason[:120]}>"
        return head + ">"


@overload
def static(fn: Callable[..., Any], /) -> Transformed: ...
@overload
def static(
    *,
    donate: str | int | Sequence[str | int] = (),
    retrace: Retrace = "warn",
    fallback: Fallback = "none",
    outputs: OutputMode = "copy",
) -> Callable[[Callable[..., Any]], Transformed]: ...


def static(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    donate: str | int | Sequence[str | int] = (),
    retrace: Retrace = "warn",
    fallback: Fallback = "none",
    outputs: OutputMode = "copy",
    **unknown: Any,
) -> Transformed | Callable[[Callable[..., Any]], Transformed]:
    """Capture the whole step once and replay it: one CUDA graph on a GPU, the same
    compiled program without a graph on CPU.

    Args:
        fn: the pure step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.
        donate: argument names or positions whose tensors the step may overwrite:
            each donated leaf receives the output of the same shape and dtype (in
            order), and the result holds the very same tensor objects.
        retrace: what a call with a new signature (shape, dtype, device, static
            value, dict key order, global mode, module training flag) does:
            ``"warn"`` (trace again, warn naming what changed), ``"error"`` (raise
            :class:`RetraceError`), ``"allow"`` (trace silently).
        fallback: ``"none"`` raises :class:`CaptureError` for a step that cannot be
            captured; ``"eager"`` warns once and runs it uncaptured instead.
        outputs: ``"copy"`` returns outputs no later call can overwrite; ``"view"``
            returns the CUDA graph's own output buffers (faster, but the next call
            overwrites them: read or clone them first).

    Returns:
        A :class:`Transformed` step (``.trace``, ``.lower``, ``.trace_count``...).

    Raises:
        ArgumentError / ArgumentTypeError: an option has a wrong value or type, or
            is not an option of ``sg.static``.

    Example:
        >>> @sg.static(donate=("params", "opt_state"))
        ... def train_step(params, opt_state, batch): ...
    """
    check_unknown("sg.static", unknown, ("donate", "retrace", "fallback", "outputs"))

    def wrap(f: Callable[..., Any]) -> Transformed:
        api = f"sg.static({_name(f)})"
        check_literal(api, "retrace", retrace, Retrace)
        check_literal(api, "fallback", fallback, Fallback)
        check_literal(api, "outputs", outputs, OutputMode)
        base, options = _unwrap(f, "static")
        record = StaticOptions(check_donate(api, base, donate), retrace, fallback, outputs)
        return Transformed(base, options.with_static(record))

    return wrap if fn is None else wrap(fn)


@overload
def fuse(fn: Callable[..., Any], /) -> Transformed: ...
@overload
def fuse(
    *,
    autotune: bool = False,
    kernels: str | Sequence[str] = "all",
    reuse_blocks: bool = True,
    channels_last: bool = True,
) -> Callable[[Callable[..., Any]], Transformed]: ...


def fuse(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    autotune: bool = False,
    kernels: str | Sequence[str] = "all",
    reuse_blocks: bool = True,
    channels_last: bool = True,
    **unknown: Any,
) -> Transformed | Callable[[Callable[..., Any]], Transformed]:
    """Compile the whole step into generated kernels (Triton on a GPU, C++ on CPU).

    The traced step (forward, backward and update in one graph, after the other
    passes) is lowered through TorchInductor as a library: pointwise ops, reductions
    and casts fuse with their neighbours, the optimizer update runs as a few
    multi-tensor kernels writing donated params and state in place, and known
    patterns run on sgraph's own kernels. Inductor's settings are patched only while
    sgraph compiles (your own ``torch.compile`` elsewhere is unaffected), and
    sgraph, not Inductor, owns the CUDA graph. Under ``sg.static`` the fused step is
    captured as one CUDA graph; alone, it runs without a graph.

    Args:
        fn: the pure step.
        autotune: let Inductor benchmark kernel configurations (matmul templates
            included) while compiling: slower first call, sometimes faster steps.
        kernels: the own kernels to use where their pattern appears: ``"all"``,
            a name, a tuple of names, or ``()`` for none. Known:
            ``"linear_cross_entropy"`` (``F.cross_entropy(x @ W.T, y)`` computed in
            row chunks, never materializing the full logits) and ``"adamw"`` (the
            AdamW update reads bf16 / fp16 gradients as they are, without their fp32
            copies, in one multi-tensor launch per gradient dtype) and ``"gelu_mlp"``
            (``F.linear(F.gelu(F.linear(x, W1, b1), approximate="tanh"), W2, b2)`` on a
            GPU in bf16 / fp16, the GELU and its gradient in cuBLASLt's matmul
            epilogues; not under ``sg.plan_memory``, which may recompute the GELU).
        reuse_blocks: compile a repeated block (the copies of an entry of an
            ``nn.ModuleList`` or ``nn.Sequential``: a transformer's layers) once,
            forward and backward, and call that code for each copy, instead of
            lowering and scheduling every copy: a shorter first call (on the H200,
            gpt-med's cold first call 22.5 s -> 11.8 s), at the cost of the fusions
            across a block's edge (+0.5% to +1.4% per step on the benchmark GPTs).
            ``False`` compiles every copy inline. Not applied to a step planned by
            ``sg.plan_memory`` (its recomputed copies are placed across blocks).
        channels_last: run 2-D convolutions on channels-last (NHWC) tensors, forward
            and backward, where Inductor's layout rule would (none grouped, not all
            small): the weights and the batch are copied into that layout inside the
            step, and cuDNN then transposes nothing; weight gradients and the step's
            outputs keep their layouts. ``False`` keeps the traced layouts.

    Returns:
        A :class:`Transformed` step; stack with ``sg.static`` in either order.

    Raises:
        ArgumentError / ArgumentTypeError: an option has a wrong value or type, or
            is not an option of ``sg.fuse``.

    Example:
        >>> @sg.static(donate=("params", "opt_state"))
        ... @sg.fuse
        ... def train_step(params, opt_state, batch): ...
    """
    check_unknown("sg.fuse", unknown, ("autotune", "kernels", "reuse_blocks", "channels_last"))

    def wrap(f: Callable[..., Any]) -> Transformed:
        api = f"sg.fuse({_name(f)})"
        if not isinstance(autotune, bool):
            raise ArgumentTypeError(f"{api}: autotune must be True or False; found {autotune!r}.")
        if not isinstance(reuse_blocks, bool):
            raise ArgumentTypeError(f"{api}: reuse_blocks must be True or False; found {reuse_blocks!r}.")
        if not isinstance(channels_last, bool):
            raise ArgumentTypeError(f"{api}: channels_last must be True or False; found {channels_last!r}.")
        base, options = _unwrap(f, "fuse")
        fuse_options = FuseOptions(autotune, check_kernels(api, kernels), reuse_blocks, channels_last)
        return Transformed(base, options.with_fuse(fuse_options))

    return wrap if fn is None else wrap(fn)


@overload
def plan_memory(fn: Callable[..., Any], /) -> Transformed: ...
@overload
def plan_memory(
    *,
    budget: int | float | str | None = None,
    policy: MemoryPolicy = "min_time",
    save: str | Sequence[str] = (),
    recompute: str | Sequence[str] = (),
    blocks: str | None = None,
) -> Callable[[Callable[..., Any]], Transformed]: ...


def plan_memory(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    budget: int | float | str | None = None,
    policy: MemoryPolicy = "min_time",
    save: str | Sequence[str] = (),
    recompute: str | Sequence[str] = (),
    blocks: str | None = None,
    **unknown: Any,
) -> Transformed | Callable[[Callable[..., Any]], Transformed]:
    """Plan the step's memory before it runs: recompute activations in the backward
    instead of keeping them, so the predicted peak fits ``budget`` at the least cost.

    Recomputed ops are the forward's own ops on the same inputs, so results are bitwise
    those of the unplanned step. ``Lowered.memory_plan`` says what was decided;
    ``Lowered.memory_analysis()`` gives the planned peak.

    Args:
        fn: the pure step.
        budget: the most memory one step may use: bytes, a size string
            (``"40GiB"``, ``"512MB"``), or a fraction of the device's memory
            (``0.8``). ``None``: recompute only what costs no matmul, reduction or
            memory pass of its own (pointwise ops and views; under ``sg.fuse``, only
            those a backward kernel computes anyway, alongside its other work).
        policy: which activations may be recomputed. ``"min_time"``: any, cheapest
            per byte first, only as many as the budget needs. ``"save_matmuls"``:
            keep only matmul and attention outputs. ``"save_block_inputs"``: keep
            nothing made inside a block but what leaves it (blocks: see ``blocks``).
        save: patterns (``"blocks.*.attn"``) whose values are never recomputed. A
            pattern names a value by the path of the submodule that made it (run
            through ``sg.functional``) or by a tag given with ``sg.checkpoint_name``,
            as :mod:`fnmatch` matches, and names what is under it too (``blocks.0``
            names ``blocks.0.fc``). A tag on a view names the buffer it shows. A
            pattern naming nothing in the step warns (``SgraphWarning``) when the
            step is lowered.
        recompute: patterns, as for ``save``, whose values are always recomputed
            (``save`` wins where both name a value).
        blocks: the pattern naming a block (``"layers.*"``); by default the first
            numbered part of a path (``blocks.3`` in ``blocks.3.fc``).

    Returns:
        A :class:`Transformed` step; stack with ``sg.static`` and ``sg.fuse`` in any order.

    Raises:
        ArgumentError / ArgumentTypeError: a bad option; when lowering, a budget the
            policy cannot reach (the message gives the smallest reachable peak).

    Example:
        >>> @sg.static(donate=("params", "opt_state"))
        ... @sg.plan_memory(budget="6GiB", recompute="attn_scores")  # a tag
        ... def train_step(params, opt_state, batch): ...  # sg.checkpoint_name(s, "attn_scores")
    """
    check_unknown("sg.plan_memory", unknown, ("budget", "policy", "save", "recompute", "blocks"))

    def wrap(f: Callable[..., Any]) -> Transformed:
        api = f"sg.plan_memory({_name(f)})"
        check_literal(api, "policy", policy, MemoryPolicy)
        if blocks is not None and not isinstance(blocks, str):
            raise ArgumentTypeError(f'{api}: blocks must be a module path pattern ("layers.*"); found {blocks!r}.')
        record = MemoryOptions(
            check_budget(api, budget),
            policy,
            check_patterns(api, "save", save),
            check_patterns(api, "recompute", recompute),
            blocks,
        )
        base, options = _unwrap(f, "memory")
        return Transformed(base, options.with_memory(record))

    return wrap if fn is None else wrap(fn)


def shard(
    mesh: Any,
    /,
    *,
    out: Any = None,
    links: Links | None = None,
    bucket_bytes: int | None = None,
    timeout: float = 300.0,
    reshard_after_forward: bool = True,
    **specs: Any,
) -> Callable[[Callable[..., Any]], Transformed]:
    """Run the step over a device mesh: the step is written for whole tensors, and its
    arguments are DTensors laid out as the specs say; DTensor's propagation turns the
    step into local ops and collectives, which the compiled program holds (and, under
    ``sg.static`` on GPUs, captures in its one CUDA graph).

    Args:
        mesh: a mesh with named axes (``sg.mesh(dp=2)``, or a torch ``DeviceMesh``).
        out: specs for the step's result (a prefix of its structure); by default each
            DTensor output is laid out like the input it matches (new params like
            params, new optimizer state like the old), and sums over ranks are done.
        links: the links between ranks (``sg.Links``: latency and bandwidth within and
            between nodes) for ``Lowered.cost_analysis()`` and the bucket size.
        bucket_bytes: merge small collectives into buckets of at most this many bytes;
            by default the size at which a collective's latency costs about 10% of
            its time on the slowest link, from ``links``.
        timeout: seconds the ranks wait for each other to agree on the program at the
            first call (collectives themselves time out as their process group says:
            ``init_process_group(timeout=...)``).
        reshard_after_forward: gather each FSDP-sharded parameter again for the
            backward rather than keep the forward's gathered copy alive (as FSDP2's
            option of that name): the peak holds a few gathered weights, not all of
            them, for one more all-gather per parameter.
        **specs: per argument name, a spec (``sg.P("dp")``, ``sg.fsdp("dp")``, ...) or a
            prefix tree of specs. A plain tensor is this rank's shard of the DTensor
            the spec describes (a replicated one must hold the same values on every
            rank); a DTensor must already be laid out so. Arguments without a spec
            follow ``params`` where their leaves match a parameter (optimizer moments)
            and are replicated otherwise.

    Returns:
        A decorator; stack it with ``sg.static``, ``sg.fuse`` and ``sg.plan_memory`` in any order.

    Raises:
        ArgumentError / ArgumentTypeError: an unnamed mesh, a spec naming an axis the
            mesh lacks, an argument the step does not take.

    Example:
        >>> @sg.static(donate=("params", "opt_state"))
        ... @sg.shard(mesh, params=sg.fsdp("dp"), batch=sg.P("dp"))
        ... def train_step(params, opt_state, batch): ...
    """

    def wrap(f: Callable[..., Any]) -> Transformed:
        base = f.fn if isinstance(f, Transformed) else f
        api = f"sg.shard({_name(base)})"
        mesh_axes(mesh, api)
        check_shard_options(api, links, bucket_bytes, timeout)
        if not isinstance(reshard_after_forward, bool):
            raise ArgumentTypeError(
                f"{api}: reshard_after_forward must be True or False; found {reshard_after_forward!r}."
            )
        check_spec_names(api, base, specs)
        for name, spec in [*specs.items(), ("out", out)]:
            check_specs(api, mesh, name if name != "out" else "out", spec)
        base, options = _unwrap(f, "shard")
        record = ShardOptions(
            mesh, tuple(specs.items()), out, links, bucket_bytes, float(timeout), reshard_after_forward
        )
        return Transformed(base, options.with_shard(record))

    return wrap


def _unwrap(f: Callable[..., Any], transform: str) -> tuple[Callable[..., Any], Options]:
    public = "plan_memory" if transform == "memory" else transform
    if isinstance(f, Transformed):
        if getattr(f.options, transform) is not None:
            raise ArgumentError(f"{f.api}: sg.{public} is applied twice; apply it once.")
        return f.fn, f.options
    if not callable(f):
        raise ArgumentTypeError(f"sg.{public}: expected a function to transform; found {type(f).__name__}.")
    return f, Options()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
