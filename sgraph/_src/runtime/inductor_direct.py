"""Compile a step's graph with Inductor directly, without AOTAutograd.

``compile_fx`` hands its graph to AOTAutograd, which traces it twice before Inductor
sees it: once to collect metadata, once more under functionalization with Inductor's
decompositions. sgraph's graph is already what those traces produce: one ATen graph
with no autograd left in it, whose only writes go into donated inputs, as the trailing
``copy_`` of a new value or as the in-place form of one of sgraph's own kernels (the
fused AdamW), which the reinplace pass gives an op only where nothing reads the old
value after it. On the H200 those two traces took 8.7 s of gpt-med's 29.3 s cold
compile.

Here the graph is traced once, plainly, with Inductor's decompositions; then it goes
through Inductor's joint-graph passes and ``compile_fx_inner`` (post-grad passes,
lowering, scheduling, code generation, Inductor's FX graph cache). A small index in
Inductor's cache directory maps the key of sgraph's own graph (computed by Inductor's
FX graph hash, so it covers what Inductor's key covers: the graph, the inputs'
metadata, Inductor's settings, the device, torch and Triton) to the FX graph cache's
key of the compiled graph, so another process loads the generated code without the
retrace and the passes.

:func:`compile_direct` returns None where this torch lacks an entry point used here,
where the graph writes anything else than the two kinds of writes above, or where
Inductor's settings ask for what only ``compile_fx`` sets up (a C++ or FX wrapper,
freezing, a pre-grad pass of the user's; Inductor's own pre-grad passes rewrite
torch-level graphs and leave an ATen graph as it is); the caller then compiles through
``compile_fx``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx

from ..program import placeholders, tensor_constants, written_args
from .cache_files import write_atomically
from .source_keys import remember_source_keys

__all__ = ["compile_direct"]

_INDEX = "sgraph-direct"  # the index's folder, inside Inductor's cache directory


def compile_direct(
    gm: torch.fx.GraphModule, examples: list[torch.Tensor], decompositions: dict | None = None
) -> Callable[..., Any] | None:
    """``gm`` compiled by Inductor below AOTAutograd, called with the step's inputs.

    Args:
        gm: the step's graph as given to ``compile_fx`` (writes into inputs allowed as
            described in the module docstring).
        examples: fake tensors of the inputs, in one fake mode with a shape environment.
        decompositions: decompositions of sgraph's own ops applied in the retrace, with
            Inductor's (their source files are part of the index key).

    Returns:
        A callable taking the inputs positionally and returning the outputs (its
        ``output_code`` attribute is Inductor's compiled graph), or None if this
        torch lacks what is needed.

    Example:
        >>> run = compile_direct(gm, examples)
        >>> outputs = run(*inputs)
    """
    try:
        entry = _entry_points()
    except (ImportError, AttributeError):
        return None
    if _needs_compile_fx(entry["config"]) or not _writes_only_inputs(gm):
        return None
    kwargs = _compile_kwargs(entry)
    fake_mode = _fake_mode(examples)
    own = dict(decompositions or {})
    gm, constants = _lifted_constants(gm)
    examples = [*examples, *(fake_mode.from_tensor(c, static_shapes=True) for c in constants)]
    with _compiling(entry, fake_mode, gm):
        key = _index_key(entry, gm, examples, kwargs, _sources(own))
        compiled = _load(entry, key, examples, kwargs) if key is not None else None
        if compiled is None:
            compiled = _compile(entry, gm, examples, kwargs, fake_mode, own)
            made = getattr(compiled, "_fx_graph_cache_key", None)
            if key is not None and made:
                _store(entry, key, made)
    return _Boxed(compiled, constants)


def _lifted_constants(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``gm`` with its tensor constants (what the step closed over: a module's buffer, a
    mask) read from trailing inputs instead, and those tensors. The retrace runs under a
    fake mode that takes no real tensor, and the compiled code then reads the very
    tensors the step closed over, as the traced graph does: an in-place change to one
    between calls is seen by the next call."""
    found = tensor_constants(gm)
    if not found:
        return gm, []
    lifted = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    nodes = {n.name: n for n in lifted.graph.nodes}
    last = next(n for n in reversed(lifted.graph.nodes) if n.op == "placeholder")
    constants = []
    for i, (old, value) in enumerate(found):
        node = nodes[old.name]
        with lifted.graph.inserting_after(last):
            last = lifted.graph.placeholder(f"sgraph_constant_{i}")
        last.meta = dict(node.meta)
        node.replace_all_uses_with(last)
        lifted.graph.erase_node(node)
        constants.append(value)
    lifted.graph.lint()
    lifted.recompile()
    return lifted, constants


def _needs_compile_fx(config: Any) -> bool:
    """Whether the user's Inductor settings ask for what only ``compile_fx`` sets up: a
    C++ or FX wrapper, freezing, or a pre-grad pass of their own."""
    return bool(
        config.cpp_wrapper
        or getattr(config, "fx_wrapper", False)
        or config.freezing
        or config.pre_grad_custom_pass is not None
    )


def _writes_only_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether every write in ``gm`` (and its subgraphs) goes into a graph input, as
    after AOTAutograd: ``copy_`` into an input, or an own kernel's in-place form whose
    written arguments are inputs. An in-place ATen op on an intermediate would reach
    Inductor unfunctionalized, which it does not expect."""
    return all(_writes_only_own_inputs(m) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def _writes_only_own_inputs(gm: torch.fx.GraphModule) -> bool:
    inputs = set(placeholders(gm.graph))
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        if node.target.namespace == "aten" and node.target is not torch.ops.aten.copy_.default:
            return False
        if not all(v in inputs for v in written_args(node)):
            return False
    return True


class _Boxed:
    """Inductor's compiled graph takes its inputs as one list (which it empties), the
    step's tensor constants after them (see :func:`_lifted_constants`)."""

    def __init__(self, output_code: Any, constants: list[torch.Tensor]) -> None:
        self.output_code = output_code
        self.constants = constants

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.output_code([*inputs, *self.constants])


@functools.cache
def _entry_points() -> dict[str, Any]:
    """The private torch functions used here, looked up once (ImportError or
    AttributeError where this torch does not have one)."""
    from torch._inductor import codecache, compile_fx, debug
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import BoxedBool

    return {
        "compile_fx_inner": compile_fx.compile_fx_inner,
        "joint_graph_passes": compile_fx._recursive_joint_graph_passes,
        "decompositions": select_decomp_table,
        "hash_details": codecache.FxGraphHashDetails,
        "hash_pickler": codecache.FxGraphCachePickler,
        "load_with_key": codecache.FxGraphCache.load_with_key,
        "bypass": codecache.BypassFxGraphCache,
        "constants": CompiledFxGraphConstants,
        "debug": debug,
        "config": inductor_config,
        "cache_dir": cache_dir,
        "boxed_bool": BoxedBool,
    }


def _compile_kwargs(entry: dict[str, Any]) -> dict[str, Any]:
    """What ``compile_fx`` passes ``compile_fx_inner`` for a graph without autograd
    (its own CUDA graphs off: the caller owns the graph)."""
    return {
        "cudagraphs": entry["boxed_bool"](False),
        "static_input_idxs": (),
        "is_backward": False,
        "graph_id": None,
        "cpp_wrapper": False,
        "is_inference": True,
        "boxed_forward_device_index": None,
        "layout_opt": None,
        "extern_node_serializer": None,
    }


def _fake_mode(examples: list[torch.Tensor]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    found = [t.fake_mode for t in examples if hasattr(t, "fake_mode")]
    return found[0] if found else FakeTensorMode(shape_env=ShapeEnv())


def _compile(
    entry: dict[str, Any],
    gm: torch.fx.GraphModule,
    examples: list[torch.Tensor],
    kwargs: dict,
    fake_mode: Any,
    own: dict,
) -> Any:
    decomposed = _decomposed(entry, gm, examples, fake_mode, own)
    decomposed = _joint_graph_passes(entry, decomposed, examples)
    _mark_outputs_user_visible(decomposed)
    return entry["compile_fx_inner"](decomposed, examples, **kwargs)


@contextlib.contextmanager
def _compiling(entry: dict[str, Any], fake_mode: Any, gm: torch.fx.GraphModule) -> Iterator[None]:
    """The state ``compile_fx`` sets up around AOTAutograd and Inductor: the fake mode
    and a tracing context, Python dispatch, node metadata kept through the retrace,
    provenance recorded against ``gm`` (the kernel map reads it), and no autocast or
    autograd (the graph already holds every cast and gradient)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.virtualized import V

    debug = entry["debug"]
    provenance = entry["config"].trace.provenance_tracking_level == 1
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch._C._DisableAutocast())
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(torch.fx.traceback.preserve_node_meta(provenance))
        stack.enter_context(debug.reset_provenance_globals())
        stack.enter_context(V.set_fake_mode(fake_mode))
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
        debug._pre_grad_graph_id = id(gm.graph)
        yield


def _decomposed(
    entry: dict[str, Any], gm: torch.fx.GraphModule, examples: list[torch.Tensor], fake_mode: Any, own: dict
) -> torch.fx.GraphModule:
    """``gm`` traced again with Inductor's decompositions and ``own`` (no
    functionalization: the graph is already functional where it matters, see the
    module docstring)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    table = {**entry["decompositions"](), **own}
    with fake_mode:
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=table)(*examples)


def _joint_graph_passes(
    entry: dict[str, Any], gm: torch.fx.GraphModule, examples: list[torch.Tensor]
) -> torch.fx.GraphModule:
    passes = entry["joint_graph_passes"]
    if "input_device" in inspect.signature(passes).parameters:
        devices = [t.device for t in examples if isinstance(t, torch.Tensor)]
        return passes(gm, input_device=devices[0] if devices else None)
    return passes(gm)


def _mark_outputs_user_visible(gm: torch.fx.GraphModule) -> None:
    """Every output is the user's: Inductor keeps the strides the graph gives them."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]


def _index_key(
    entry: dict[str, Any], gm: torch.fx.GraphModule, examples: list[torch.Tensor], kwargs: dict, sources: tuple
) -> str | None:
    """The index key of ``gm`` (None: Inductor's caches are off, or would be bypassed).

    Inductor's FX graph hash of sgraph's graph (what its ``compiled_fx_graph_hash``
    computes, without the per-component debug text it also builds: a fifth of a second
    on a large graph), with the hashes of this file and of the files defining the own
    decompositions (``sources``): a change there (decompositions, passes) makes entries
    stale."""
    config = entry["config"]
    if config.force_disable_caches or not config.fx_graph_cache:
        return None
    remember_source_keys()
    try:
        details = entry["hash_details"](gm, examples, kwargs, [])
        pickler = entry["hash_pickler"](gm, bool(details.user_defined_triton_source))
        key = pickler.get_hash(details)
    except entry["bypass"]:
        return None
    sources_hash = ":".join(_source_hash(path) for path in (__file__, *sources))
    return hashlib.sha256(f"{key}:{sources_hash}".encode()).hexdigest()


def _sources(decompositions: dict) -> tuple[str, ...]:
    """The files defining ``decompositions``' functions, sorted."""
    return tuple(sorted({inspect.getsourcefile(fn) or "" for fn in decompositions.values()} - {""}))


@functools.cache
def _source_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _index_path(entry: dict[str, Any], key: str) -> Path:
    return Path(entry["cache_dir"]()) / _INDEX / key


def _load(entry: dict[str, Any], key: str, examples: list[torch.Tensor], kwargs: dict) -> Any:
    """The compiled graph the index names for ``key``, from Inductor's FX graph cache;
    None if either has no entry."""
    try:
        fx_key = _index_path(entry, key).read_text().strip()
    except OSError:
        return None
    if not fx_key:
        return None
    constants = entry["constants"]()
    compiled, _ = entry["load_with_key"](fx_key, [], examples, True, None, False, constants)
    if compiled is None:
        return None
    compiled.post_compile(examples, constants, kwargs)
    return compiled


def _store(entry: dict[str, Any], key: str, fx_key: str) -> None:
    """Write the index entry (an unwritable cache only costs the next process a compile)."""
    write_atomically(_index_path(entry, key), fx_key)
