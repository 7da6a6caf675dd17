"""``Program``: one traced step as a functional ATen FX graph plus its pytree specs.

Passes take a Program and return a new one; executables run one. The graph's
placeholders are the step's tensor leaves in flattening order; its output is the
list of the step's tensor outputs. Non-tensor leaves are static: inputs are part
of the signature, outputs are constants recorded here.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .capture import SOURCE_KEY, Source
from .text import describe_tensor
from .tree import PyTreeSpec

__all__ = [
    "LeafInfo",
    "Program",
    "alias_root",
    "compute_ops",
    "fake_mode",
    "graph_module",
    "memory_root",
    "pure_op",
    "readers",
    "output_node",
    "placeholders",
    "returned",
    "written_args",
]


@dataclass(frozen=True)
class LeafInfo:
    """One leaf of the step's inputs or outputs.

    ``graph_index`` is the leaf's placeholder (inputs) or output position (outputs)
    in the graph, or ``None`` for a static leaf, whose value is ``value``. A DTensor
    leaf enters and leaves the graph as its local shard (``shape`` is the shard's);
    ``dist`` says how that shard makes the DTensor.
    """

    path: str
    graph_index: int | None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    value: Any = None
    dist: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.graph_index is not None

    def describe(self) -> str:
        if not self.is_tensor:
            return f"static {self.value!r}"
        text = describe_tensor(self.dtype, self.shape, self.device)
        return text if self.dist is None else f"{text}, shard of {self.dist.describe()}"


@dataclass(frozen=True)
class Program:
    """A traced step: graph, input/output specs, per-leaf metadata.

    Attributes:
        name: the transform and function, e.g. ``sg.static(train_step)``.
        graph_module: functional ATen graph; inputs are mutated only by trailing
            ``copy_`` nodes into donated inputs.
        in_spec / out_spec: pytree structures of ``(args, kwargs)`` and of the result.
        inputs / outputs: one :class:`LeafInfo` per leaf, in flattening order.
        donated: placeholder indices the user donated.
        aliases: ``(output graph index, placeholder index)`` pairs: that output is
            written into that donated input, which is then returned in its place.
        passes: names of the passes applied so far, in order.
        modules: the modules whose training flags the trace read (through
            ``sg.functional`` apply functions).
        memory_plan: what ``sg.plan_memory`` decided (a ``MemoryPlan``), if it ran.
    """

    name: str
    graph_module: torch.fx.GraphModule
    in_spec: PyTreeSpec
    out_spec: PyTreeSpec
    inputs: tuple[LeafInfo, ...]
    outputs: tuple[LeafInfo, ...]
    donated: frozenset[int] = frozenset()
    aliases: tuple[tuple[int, int], ...] = ()
    passes: tuple[str, ...] = field(default=())
    modules: tuple[Any, ...] = field(default=())
    memory_plan: Any = None

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    @property
    def tensor_inputs(self) -> list[LeafInfo]:
        return [leaf for leaf in self.inputs if leaf.is_tensor]

    def replace(self, **changes: Any) -> Program:
        """A copy with some fields changed (passes build new Programs this way)."""
        return dataclasses.replace(self, **changes)

    def copy_graph_module(self) -> torch.fx.GraphModule:
        """A new graph module over a copy of the graph, for a pass to edit.

        Its Python code is generated on its first call, not here: most passes only
        read and edit the graph, and generating code for a large graph takes a
        noticeable fraction of a second each time."""
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(self.graph, {}))
        return graph_module(self.graph_module, graph)

    def graph_module_to_edit(self, in_place: bool) -> torch.fx.GraphModule:
        """What a pass edits: this program's own graph module when ``in_place`` (its
        caller owns the program, as the pipeline owns its copy of the traced one), else
        :meth:`copy_graph_module`."""
        return self.graph_module if in_place else self.copy_graph_module()

    def written_inputs(self) -> set[int]:
        """Placeholder indices the graph writes into, directly or through a view."""
        index = {n: i for i, n in enumerate(placeholders(self.graph))}
        return {
            index[root] for node in self.graph.nodes for arg in written_args(node) if (root := alias_root(arg)) in index
        }

    def ops(self) -> list[torch.fx.Node]:
        """The call nodes of the graph, in order."""
        return [n for n in self.graph.nodes if n.op == "call_function"]

    def as_text(self, notes: dict[str, str] | None = None) -> str:
        """A readable listing: inputs with their paths, each op with its user source line
        (and ``notes[node name]`` after it, where given)."""
        return _listing(self, notes or {})


def compute_ops(program: Program) -> int:
    """The ops of the graph that compute data when run one by one: every call except
    views, ``getitem`` and constants (a multi-tensor op counts once)."""
    count = 0
    for node in program.ops():
        target = node.target
        if target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
            continue
        returns = target._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            continue  # a view
        count += 1
    return count


def _listing(program: Program, notes: dict[str, str]) -> str:
    tensor_inputs = program.tensor_inputs
    lines = [
        f"{program.name}: {len(program.ops())} ops, {len(tensor_inputs)} tensor inputs, "
        f"{sum(o.is_tensor for o in program.outputs)} tensor outputs"
        + (f"  [passes: {', '.join(program.passes)}]" if program.passes else "")
    ]
    for node, leaf in zip(placeholders(program.graph), tensor_inputs):
        donated = "  (donated)" if leaf.graph_index in program.donated else ""
        lines.append(f"  %{node.name}: {leaf.describe()}  <- {leaf.path}{donated}")
    width = 0
    body = []
    for node in program.graph.nodes:
        if node.op in ("call_function", "get_attr"):
            text = f"  %{node.name} = {_target(node)}({_args(node)})"
            note = notes.get(node.name)
            body.append((text, _meta(node) + (f"  -> {note}" if note else "")))
            width = max(width, len(text))
    width = min(width, 88)
    lines += [f"{text:<{width}}  {meta}".rstrip() for text, meta in body]
    lines += _output_lines(program)
    return "\n".join(lines)


def _target(node: torch.fx.Node) -> str:
    if node.op == "get_attr":
        return f"constant {node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.__name__
        return f"aten.{name.replace('.default', '')}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _args(node: torch.fx.Node) -> str:
    def fmt(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{a.name}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in a) + "]"
        return repr(a)

    parts = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 60 else text[:57] + "..."


def _meta(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    kind = describe_tensor(val.dtype, tuple(val.shape)) if isinstance(val, torch.Tensor) else ""
    source: Source | None = node.meta.get(SOURCE_KEY)
    where = f"# {source.short()}: {source.code}" if source else ""
    return f"{kind:<18} {where}"


def _output_lines(program: Program) -> list[str]:
    values = returned(program.graph)
    aliased = dict(program.aliases)
    lines = ["  return"]
    for leaf in program.outputs:
        if leaf.is_tensor:
            node = values[cast(int, leaf.graph_index)]
            into = aliased.get(cast(int, leaf.graph_index))
            note = f"  (written into donated input {program.tensor_inputs[into].path})" if into is not None else ""
            name = f"%{node.name}" if isinstance(node, torch.fx.Node) else repr(node)
            lines.append(f"    {leaf.path or '<result>'} = {name}: {leaf.describe()}{note}")
        else:
            lines.append(f"    {leaf.path or '<result>'} = {leaf.value!r}")
    return lines


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow views (ops whose result aliases their first argument) back to their base.

    Every output of a multi-output op counts as that op (conservative: for a foreach op
    the outputs are in fact distinct tensors; see :func:`memory_root`)."""
    return _root(node, fresh_outputs_are_roots=False)


def readers(node: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node that reads ``node``'s memory: its users and the users of its views
    (the views included)."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            found.add(user)
            if user.op == "call_function" and alias_root(user) is not user:
                stack.append(user)
    return found


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module over ``graph`` (attributes from ``root``) whose Python code is
    generated on its first call: a pass that only reads and edits graphs never pays
    for generating code for a large one."""
    return _LazyGraphModule(root, graph)


def memory_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node`` lives in: like :func:`alias_root`, except that an
    output of an op returning fresh tensors (a foreach op, a fused optimizer) is its own
    memory, not its siblings', and that a collective's ``wait_tensor`` is the memory of
    the collective's result, which it returns."""
    return _root(node, fresh_outputs_are_roots=True)


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _root(node: torch.fx.Node, *, fresh_outputs_are_roots: bool) -> torch.fx.Node:
    while node.op == "call_function":
        if fresh_outputs_are_roots and node.target is _WAIT:
            node = cast(torch.fx.Node, node.args[0])  # a collective's wait returns its buffer
            continue
        base = view_base(node)
        if base is None or fresh_outputs_are_roots and node.target is operator.getitem and not _returns_views(base):
            break
        node = base
    return node


def view_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node`` is a view of (or the input an in-place op returns, or the op
    whose outputs a ``getitem`` picks from), else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    target = node.target
    if target is operator.getitem:
        return node.args[0]
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return None
    returns, first = target._schema.returns, target._schema.arguments[0]
    if not returns or returns[0].alias_info is None or first.alias_info is None:
        return None
    return node.args[0]


def pure_op(target: Any) -> TypeGuard[torch._ops.OpOverload]:
    """Whether ``target`` is an ATen (or prims) op that writes none of its arguments and
    draws no random numbers: run again on the same inputs, it gives the same values."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _returns_views(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True  # unknown: assume shared memory, the safe answer
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments an op writes into (``Tensor(a!)`` in its schema); lists are expanded."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    found = []
    for i, arg in enumerate(node.target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.fx.Node)]
    return found


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's inputs, in order (placeholder ``i`` is tensor input ``i``)."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def fake_mode(graph: torch.fx.Graph) -> Any:
    """The fake mode of ``graph``'s placeholder values (``None`` where it has none)."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in placeholders(graph)]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def tensor_constants(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    """The graph's ``get_attr`` nodes that read a tensor (what the step closed over: a
    module's buffer, a mask), in graph order, each with its tensor."""
    found = []
    for node in gm.graph.nodes:
        value = getattr(gm, cast(str, node.target), None) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor):
            found.append((node, value))
    return found


def output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's output node; its ``args[0]`` lists the returned values."""
    return next(n for n in graph.nodes if n.op == "output")


def returned(graph: torch.fx.Graph) -> list[Any]:
    """The values the graph returns (output nodes, or constants), in order."""
    return list(cast("Sequence[Any]", output_node(graph).args[0]))
