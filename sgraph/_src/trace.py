"""Trace a pure step into a :class:`Program`.

Two passes over ``make_fx`` with fake tensors (nothing runs on the device and no
input is touched):

1. The step itself, autograd included: ``torch.autograd.grad`` inside the step
   records its backward ops, so forward, backward and update land in one graph.
   :mod:`capture` guards the step and stamps each node with its user source line.
   BatchNorm's hidden writes of its running statistics are made explicit
   (:mod:`running_stats`).
2. That graph replayed node by node under ``torch.func.functionalize``: in-place
   ops become functional ones, and writes into inputs become trailing ``copy_``
   nodes, allowed only into donated inputs. A graph with no in-place op (the usual
   step: functional optimizers, autograd's own backward) is functional already and
   skips this pass.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from . import guards, tree
from .capture import (
    SOURCE_KEY,
    GuardMode,
    Source,
    SourceMode,
    constant_write_message,
    expanded_write_message,
    has_plain_message,
    is_expanded,
)
from .cudnn_rnn import CudnnRnnGuard
from .dtensors import (
    DistInfo,
    OutLayout,
    compute_scope,
    compute_table,
    dist_info,
    exact_shifts,
    is_dtensor,
    local,
    matching_layout,
    rebuild,
)
from .errors import CaptureError
from .escaped import find_escaped
from .hidden import find_hidden_tensor
from .patterns import GeluMlpMode, LinearCrossEntropyMode
from .program import (
    LeafInfo,
    Program,
    alias_root,
    output_node,
    placeholders,
    returned,
    tensor_constants,
    view_base,
    written_args,
)
from .running_stats import explicit_running_stats, hidden_written_args
from .source import GRAD_MODULE_KEY, MODULE_KEY, where
from .tags import TAGS_KEY

__all__ = ["ArgLayout", "trace", "arg_layout", "positional_names"]

_TRACE_LOCK = threading.RLock()


@dataclass(frozen=True)
class ArgLayout:
    """How a call's arguments flatten: leaf paths, which leaves are donated, argument names."""

    paths: tuple[str, ...]
    donated_leaves: frozenset[int]
    names: tuple[str, ...] = ()


def arg_layout(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    donate: Sequence[str | int],
    *,
    skip: int = 0,
) -> ArgLayout:
    """Name every leaf of ``(args, kwargs)`` after the parameter it belongs to.

    Args:
        fn: the user's step (its signature gives the names).
        args / kwargs: one call's arguments.
        donate: parameter names or positions whose leaves are donated.
        skip: leading parameters already bound (a method's ``self``): ``args[0]``
            is parameter ``skip``, and donated positions count the bound ones.

    Returns:
        Leaf paths in the order :func:`tree.flatten` gives ``(args, kwargs)``.
    """
    names = positional_names(fn, len(args) + skip)[skip:]
    positions = {d - skip for d in donate if isinstance(d, int)}
    named = {d for d in donate if isinstance(d, str)}
    star, star_star, declared = _variadic(fn)
    # donating ``*args`` or ``**kwargs`` by name donates every argument they collect
    in_star = {i for i, n in enumerate(names) if star in named and n.startswith(f"{star}[")}
    paths: list[str] = []
    donated: set[int] = set()
    parts = [(names[i], a, i in positions or names[i] in named or i in in_star) for i, a in enumerate(args)]
    parts += [
        (k, kwargs[k], k in named or _position(fn, k, skip) in positions or (star_star in named and k not in declared))
        for k in sorted(kwargs)
    ]
    for name, value, is_donated in parts:
        leaf_paths = tree.flatten_with_paths(value, prefix=name)[0]
        if is_donated:
            donated.update(range(len(paths), len(paths) + len(leaf_paths)))
        paths += leaf_paths
    return ArgLayout(tuple(paths), frozenset(donated), tuple(name for name, _, _ in parts))


def positional_names(fn: Callable[..., Any], count: int) -> list[str]:
    """The names of ``fn``'s first ``count`` positional parameters (``args[i]`` past them)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [f"args[{i}]" for i in range(count)]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
    return [names[i] if i < len(names) else f"{star}[{i - len(names)}]" for i in range(count)]


def _variadic(fn: Callable[..., Any]) -> tuple[str | None, str | None, frozenset[str]]:
    """The names of ``fn``'s ``*args`` and ``**kwargs`` parameters (None where it has
    none), and of its other parameters."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, None, frozenset()
    star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    star_star = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    return star, star_star, frozenset(p.name for p in params if p.name not in (star, star_star))


def _position(fn: Callable[..., Any], name: str, skip: int) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) - skip if name in params else None


def trace(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    api: str,
    layout: ArgLayout,
    bound: Sequence[Any] = (),
    kernels: Sequence[str] = (),
    compute: Sequence[Any] = (),
    out_layout: OutLayout | None = None,
) -> Program:
    """Trace ``fn(*bound, *args, **kwargs)`` into a functional Program.

    Tracing runs under a process-wide lock: ``make_fx`` keeps global state and
    cannot trace in two threads at once.

    Args:
        fn: the pure step.
        args / kwargs: example arguments (real tensors; only metadata is used).
        api: the transform's name for messages, e.g. ``sg.static(train_step)``.
        layout: leaf paths and donated leaves from :func:`arg_layout`.
        bound: leading arguments that are not traced (a method's ``self``).
        kernels: own kernels whose patterns are matched while tracing (``sg.fuse``'s
            ``kernels`` option; see :mod:`patterns`).
        compute: per leaf, the placements a DTensor leaf is computed with where they
            differ from its own (FSDP's gathered parameters), else None.
        out_layout: the placements of each DTensor the step returns (see
            :data:`OutLayout`); by default each follows the input it matches
            (:func:`dtensors.matching_layout`) and partial sums are summed.

    Returns:
        The Program, before any pass.

    Raises:
        CaptureError: the step breaks the capture contract (see ``docs/errors.md``).
    """
    leaves, in_spec = tree.flatten((tuple(args), dict(kwargs)))
    inputs, tensors = _input_infos(leaves, layout.paths)
    donated = frozenset(
        cast(int, info.graph_index) for i, info in enumerate(inputs) if i in layout.donated_leaves and info.is_tensor
    )
    flat_fn, result = _flat_step(fn, api, in_spec, leaves, bound, kernels, compute, out_layout, layout)
    # GuardMode adds the sync and RNG guards. The graph modules made here generate
    # their Python code when first called (only an eager run calls them), not here.
    with _TRACE_LOCK, guards.tracing() as modules, compute_scope(), exact_shifts(), _use_lazy_graph_module(True):
        try:
            autograd_graph = make_fx(flat_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        except RuntimeError as e:
            _name_devices(e, inputs)
            raise
        _check_constant_writes(autograd_graph, api)
        _check_writes_through_expands(autograd_graph, api)
        _check_class_targets(autograd_graph, api)
        explicit_running_stats(autograd_graph)
        functional = _functionalize(autograd_graph, tensors, api)
        if functional is not autograd_graph:
            _return_written_inputs(autograd_graph, functional)
    _check_outputs(api, result["spec"], result["leaves"])
    _check_nothing_escaped(api, fn, (*bound, *modules))
    outputs = _output_infos(result["spec"], result["leaves"], result["dists"], functional)
    program = Program(
        name=api,
        graph_module=functional,
        in_spec=in_spec,
        out_spec=result["spec"],
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        donated=donated,
        modules=tuple(modules),
    )
    _check_input_writes(autograd_graph, program)
    return program


def _name_devices(error: RuntimeError, inputs: Sequence[LeafInfo]) -> None:
    """Add to a device-mismatch ``error`` which argument leaves are on which device:
    torch's message names the devices and the line, not the arguments to move (eager
    kernels say "same device"; fake tensors, tracing CUDA params, "different devices")."""
    mismatch = any(words in str(error) for words in ("same device", "different devices"))
    if not mismatch or not has_plain_message(error):
        return
    on: dict[str, list[str]] = {}
    for info in inputs:
        if info.device is not None and info.shape:  # a 0-d CPU tensor mixes with any device
            on.setdefault(str(info.device), []).append(info.path)
    if len(on) < 2:
        return

    def listed(paths: list[str]) -> str:
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

    where_ = "; ".join(f"on {device}: {listed(paths)}" for device, paths in on.items())
    most = max(on, key=lambda d: len(on[d]))
    fewest = min((d for d in on if d != most), key=lambda d: len(on[d]))
    name = re.split(r"[\[.]", on[fewest][0], maxsplit=1)[0]
    error.args = (
        f"{error.args[0]}\nThe step's arguments are on {len(on)} devices ({where_}). Move them to one "
        f"device before the call, e.g. {name} = sg.tree.map(lambda t: t.to({most!r}), {name}).",
    )


def _input_infos(leaves: list[Any], paths: Sequence[str]) -> tuple[list[LeafInfo], list[torch.Tensor]]:
    infos: list[LeafInfo] = []
    tensors: list[torch.Tensor] = []
    for leaf, path in zip(leaves, paths):
        if isinstance(leaf, torch.Tensor):
            dist = dist_info(leaf) if is_dtensor(leaf) else None
            shard = local(leaf)
            infos.append(LeafInfo(path, len(tensors), tuple(shard.shape), shard.dtype, shard.device, dist=dist))
            tensors.append(shard.detach())
        else:
            infos.append(LeafInfo(path, None, value=leaf))
    return infos, tensors


def _flat_step(
    fn: Callable[..., Any],
    api: str,
    in_spec: tree.PyTreeSpec,
    leaves: list[Any],
    bound: Sequence[Any],
    kernels: Sequence[str],
    compute: Sequence[Any],
    out_layout: OutLayout | None,
    layout: ArgLayout,
) -> tuple[Callable[..., list[torch.Tensor]], dict[str, Any]]:
    """``fn`` as a function of its tensor leaves only (DTensors as local shards),
    returning its tensor outputs (DTensors as local shards)."""
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    dists = [dist_info(leaves[i]) if is_dtensor(leaves[i]) else None for i in positions]
    gathered = [compute[i] if i < len(compute) else None for i in positions]
    result: dict[str, Any] = {}

    def flat_fn(*tensors: torch.Tensor) -> list[torch.Tensor]:
        full = list(leaves)
        table = compute_table()
        for i, t, dist, placements in zip(positions, tensors, dists, gathered):
            full[i] = t if dist is None else rebuild(t, dist)
            if placements is not None:
                table[id(full[i])] = placements
        args, kwargs = tree.unflatten(in_spec, full)
        patterns = LinearCrossEntropyMode() if "linear_cross_entropy" in kernels else contextlib.nullcontext()
        mlps = GeluMlpMode() if "gelu_mlp" in kernels else contextlib.nullcontext()
        with GuardMode(api), CudnnRnnGuard(api), SourceMode(api), patterns, mlps, _replicated_constants(dists):
            out = fn(*bound, *args, **kwargs)
            _check_arguments_kept(api, args, kwargs, in_spec, full, layout)
            out_leaves, result["spec"] = tree.flatten(out)
            targets = matching_layout(leaves, in_spec)(out)
            if out_layout is not None:  # the out= spec's choices; where it has none, the default
                targets = [d if c is None else c for c, d in zip(out_layout(out), targets)]
            out_leaves, result["dists"] = _local_outputs(out_leaves, targets)
        result["leaves"] = out_leaves
        return [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]

    return flat_fn, result


def _check_arguments_kept(
    api: str, args: Any, kwargs: dict[str, Any], in_spec: tree.PyTreeSpec, before: list[Any], layout: ArgLayout
) -> None:
    """Raise if the step changed its argument containers (a key added to a dict, an item
    appended, a leaf replaced): the step's Python runs once, at trace, so later calls
    would not repeat the change that eager makes on every call."""
    leaves, spec = tree.flatten((tuple(args), dict(kwargs)))
    if spec == in_spec and all(_kept(a, b) for a, b in zip(before, leaves)):
        return
    names = layout.names
    paths: list[str] = []
    for name, value in zip(names, [*args, *(kwargs[k] for k in sorted(kwargs))]):
        paths += tree.flatten_with_paths(value, prefix=name)[0]
    was = dict(zip(layout.paths, before))
    now = dict(zip(paths, leaves))
    changes = [f"adds {p}" for p in now if p not in was] + [f"removes {p}" for p in was if p not in now]
    changes += [f"replaces {p}" for p in now if p in was and not _kept(was[p], now[p])]
    raise CaptureError(
        f"{api}: the step changes its arguments' containers ({'; '.join(changes[:3]) or 'their structure'}). "
        "A compiled step runs your Python once, when it is traced, so later calls would not make that "
        "change, where eager makes it on every call. Build new containers and return them instead "
        "(state = {**state, 'step': step + 1})."
    )


def _check_nothing_escaped(api: str, fn: Callable[..., Any], reached: Sequence[Any]) -> None:
    """Raise if the step left a traced tensor where the user's code can reach it (see
    :mod:`escaped`): eager would store a real tensor there on every call."""
    place = find_escaped(fn, tuple(reached))
    if place is not None:
        raise CaptureError(
            f"{api}: the step stores a tensor it computes outside its outputs, in {place}. A compiled "
            "step runs your Python once, when it is traced, so what is stored there is a placeholder of "
            "the trace, without values, where eager stores a new tensor on every call. Return the tensor "
            "from the step instead (as a metric), and keep it, or a list of them, outside the step; a cache "
            "a module fills in its forward (rotary tables) can be computed before the first call."
        )


def _kept(a: Any, b: Any) -> bool:
    return a is b or (_static_leaf(a) and _same_static(a, b))


def _static_leaf(x: Any) -> bool:
    return not isinstance(x, torch.Tensor)


def _same_static(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return False
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # an object whose == does not give a bool
        return False


def _replicated_constants(dists: Sequence[DistInfo | None]) -> Any:
    """In a step over DTensors, a plain tensor the step makes itself (``torch.arange``
    positions, a mask) is the same on every rank: it joins DTensor ops as replicated."""
    if not any(d is not None for d in dists):
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def _local_outputs(out_leaves: list[Any], targets: list[Any]) -> tuple[list[Any], list[DistInfo | None]]:
    """DTensor outputs laid out as ``targets`` says, as local shards; their layouts."""
    shards: list[Any] = []
    dists: list[DistInfo | None] = []
    for leaf, target in zip(out_leaves, targets):
        if not is_dtensor(leaf):
            shards.append(leaf)
            dists.append(None)
            continue
        if tuple(leaf.placements) != tuple(target):
            leaf = leaf.redistribute(leaf.device_mesh, target)
        shards.append(leaf.to_local())
        dists.append(dist_info(leaf))
    return shards, dists


class _Replay(torch.fx.Interpreter):
    """Runs a graph node by node, exposing the source, module path and tags of the node being run."""

    current: Source | None = None
    carried: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.meta.get(SOURCE_KEY)
        self.carried = {key: n.meta[key] for key in (MODULE_KEY, GRAD_MODULE_KEY, TAGS_KEY) if key in n.meta}
        return super().run_node(n)


def _functionalize(gm: torch.fx.GraphModule, tensors: list[torch.Tensor], api: str) -> torch.fx.GraphModule:
    if not any(written_args(node) for node in gm.graph.nodes):
        return gm  # already functional (the usual step): tracing it again would change nothing
    lifted, constants = _lift_constants(gm)
    replay = _Replay(lifted)

    def run(*args: torch.Tensor) -> Any:
        with SourceMode(api, context=lambda: replay.current, carried=lambda: replay.carried):
            return replay.run(*args)

    functional = torch.func.functionalize(run, remove="mutations")
    out = make_fx(functional, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors, *constants.values())
    _restore_constants(out, constants, api)
    return out


def _return_written_inputs(autograd_graph: torch.fx.GraphModule, functional: torch.fx.GraphModule) -> None:
    """Where the step returns an input it wrote in place (``p.sub_(u); return p``), the
    functional graph returns that input again rather than its new value: eager hands
    back the very tensor passed in, and so does the compiled step (the trailing
    ``copy_`` writes the new value into it, as into any written donated input)."""
    before = {node: i for i, node in enumerate(placeholders(autograd_graph.graph))}
    inputs = placeholders(functional.graph)
    written = {alias_root(a) for node in functional.graph.nodes for a in written_args(node)}
    values = returned(functional.graph)
    changed = False
    for position, node in enumerate(returned(autograd_graph.graph)):
        root = alias_root(node) if isinstance(node, torch.fx.Node) else None
        if root is not None and root.op == "placeholder" and _same_layout(node, root):
            target = inputs[before[root]]
            if target in written and values[position] is not target:
                values[position] = target
                changed = True
    if changed:
        output_node(functional.graph).args = (values,)
        functional.recompile()


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether two aliasing nodes are the same tensor (an in-place op's result and its
    input), not a view of other shape, strides or offset."""
    x, y = a.meta.get("val"), b.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    return (x.shape, x.stride(), x.storage_offset(), x.dtype) == (y.shape, y.stride(), y.storage_offset(), y.dtype)


def _lift_constants(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[str, torch.Tensor]]:
    """A copy of ``gm`` whose tensor constants (what the step closed over) are trailing
    inputs, so that functionalization sees them as tensors of the program: a clone of one
    (``sg.functional``'s buffers read through a closure) written in place is then an
    ordinary functional value, not a plain tensor written with a functional one."""
    constants = {cast(str, node.target): value for node, value in tensor_constants(gm)}
    if not constants:
        return gm, constants
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in placeholders(gm.graph):
        env[node] = graph.node_copy(node, env.__getitem__)
    lifted = {name: graph.placeholder(f"constant_{name}") for name in constants}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in lifted:
            env[node] = lifted[cast(str, node.target)]
        elif node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(gm, graph), constants


def _restore_constants(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor], api: str) -> None:
    """Turn the trailing inputs :func:`_lift_constants` made back into ``gm``'s constants."""
    if not constants:
        return
    inputs = placeholders(gm.graph)[-len(constants) :]
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node, (name, value) in zip(inputs, constants.items()):
        for user in node.users:
            if any(alias_root(a) is node for a in written_args(user)):
                source = user.meta.get(SOURCE_KEY)
                raise CaptureError(constant_write_message(api, user.target, tuple(value.shape), source))
        setattr(gm, name, value)
        with gm.graph.inserting_before(first):
            attr = gm.graph.create_node("get_attr", name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.recompile()


def _check_outputs(api: str, spec: tree.PyTreeSpec, leaves: list[Any]) -> None:
    """Raise for a tensor the step returns inside an object that is not a pytree container."""
    for leaf, path in zip(leaves, tree.paths(spec, prefix="result")):
        if isinstance(leaf, torch.Tensor):
            continue
        inner = find_hidden_tensor(leaf)
        if inner is not None:
            raise CaptureError(
                f"{api}: the step returns a tensor at {path}{inner}, inside an object of type "
                f"{type(leaf).__name__}, which is not a pytree container, so it would come back as a "
                "trace-time placeholder. Register the class: "
                f"sg.tree.register_dataclass({type(leaf).__name__}) for a dataclass, "
                "sg.tree.register_node otherwise; or return the tensors in a dict, list or tuple."
            )


def _output_infos(
    spec: tree.PyTreeSpec, leaves: list[Any], dists: list[DistInfo | None], gm: torch.fx.GraphModule
) -> list[LeafInfo]:
    values = returned(gm.graph)
    infos, index = [], 0
    for leaf, dist, path in zip(leaves, dists, tree.paths(spec, prefix="result")):
        if isinstance(leaf, torch.Tensor):
            val = values[index].meta["val"]
            infos.append(LeafInfo(path, index, tuple(val.shape), val.dtype, val.device, dist=dist))
            index += 1
        else:
            infos.append(LeafInfo(path, None, value=leaf))
    return infos


def _check_constant_writes(gm: torch.fx.GraphModule, api: str) -> None:
    """Raise for a write into a tensor the step closes over that the trace recorded
    (``hist[i] = x``: a view of the constant, written with a traced value)."""
    for node in gm.graph.nodes:
        for arg in written_args(node) + hidden_written_args(node):
            root = alias_root(arg)
            if root.op == "get_attr":
                shape = tuple(getattr(gm, cast(str, root.target)).shape)
                raise CaptureError(constant_write_message(api, node.target, shape, node.meta.get(SOURCE_KEY)))


def _check_writes_through_expands(gm: torch.fx.GraphModule, api: str) -> None:
    """Raise for an in-place write into a view taken of an expanded view
    (``w.expand(2, *w.shape)[0] = x``). The written view's own elements are distinct, so
    the check made while tracing lets it pass, but torch's functionalization writes it
    back through the expand as ``w + sum(new - w)``: not ``x`` in floating point, and NaN
    where ``w`` is infinite."""
    for node in gm.graph.nodes:
        for arg in written_args(node):
            written = arg.meta.get("val")
            if isinstance(written, torch.Tensor) and written.numel() == 0:
                continue  # nothing is written
            view = view_base(arg)
            while view is not None:
                val = view.meta.get("val")
                if isinstance(val, torch.Tensor) and is_expanded(val):
                    raise CaptureError(
                        expanded_write_message(api, node.target, node.meta.get(SOURCE_KEY), of_a_view=True)
                    )
                view = view_base(view)


_CLASS_TARGET_OPS = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)


def _check_class_targets(gm: torch.fx.GraphModule, api: str) -> None:
    """Raise for class targets of a dtype ATen's ``nll_loss`` refuses when it runs: its
    meta kernel does not check them, so a fused step would compute a loss eager cannot."""
    for node in gm.graph.nodes:
        if node.target not in _CLASS_TARGET_OPS:
            continue
        target = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
        if isinstance(target, torch.Tensor) and target.dtype not in (torch.int64, torch.uint8):
            raise CaptureError(
                f"{api}: the loss{where(node.meta.get(SOURCE_KEY))} takes class targets of dtype "
                f"{target.dtype}; cross_entropy / nll_loss take int64 (or uint8) class indices, and "
                "raise for these when run eagerly. Pass the targets as `.long()`."
            )


def _check_input_writes(autograd_graph: torch.fx.GraphModule, program: Program) -> None:
    """Raise for a write into an input that is not donated, naming its path and line."""
    for index in sorted(program.written_inputs() - program.donated):
        where = _write_source(autograd_graph, index)
        at = f" at {where.describe()}" if where else ""
        raise CaptureError(
            f"{program.name}: the step writes in place into input {program.tensor_inputs[index].path}{at}, "
            "which is not "
            "donated. Return the new value as an output instead, or donate the argument to let the "
            "step update it in place: sg.static(step, donate=(...)) names it (sg.fuse alone does not "
            "donate; stack it under sg.static)."
        )


def _write_source(gm: torch.fx.GraphModule, index: int) -> Source | None:
    """The source of the first in-place op that writes into placeholder ``index``."""
    target = placeholders(gm.graph)[index]
    for node in gm.graph.nodes:
        for arg in written_args(node):
            if alias_root(arg) is target:
                return node.meta.get(SOURCE_KEY)
    return None
