"""Recompute chosen forward values in the backward instead of keeping them alive.

A whole-step graph keeps every forward value the backward reads (an *activation*)
alive from where the forward makes it to where the backward last reads it. This
pass takes a set of such values and, for each, copies the ops that make it into
the backward, just before the first backward op that reads it; the backward then
reads the copy, and the forward value dies after its last forward read. A copied op
reads what it read in the forward: values that are kept (saved) or recomputed in
turn, so chains of recomputed ops start from saved values or the step's inputs.

Recomputed ops are the same ATen ops on the same inputs, so results are bitwise
those of the unplanned step. Ops that draw random numbers, write their inputs or
talk to other processes are never recomputed, nor an op reading a buffer that the
step writes in place between the op and the value's first backward read (the copy
would read the new values).

The unit of choice is a :class:`Group`: a buffer the backward reads (through the
value itself or views of it) together with those views, since keeping any of them
keeps the whole buffer.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ...capture import SOURCE_KEY
from ...program import Program, memory_root, pure_op, written_args
from ...source import MODULE_KEY
from ...tags import TAGS_KEY

__all__ = ["Group", "RECOMPUTED_KEY", "forward_end", "groups", "library_op", "rematerialize"]

Node = torch.fx.Node

RECOMPUTED_KEY = "sgraph_recomputed"
"""Node meta key on a recomputed copy: the name of the forward node it copies."""

_MATMULS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_convolution",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)
# Backward ops that, like the matmuls, run in a library (cuBLAS, cuDNN, ATen's fused kernels).
_LIBRARY_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn", "cudnn", "_fused")
_LIBRARY = _MATMULS | {"convolution_backward"}
# A rough accelerator: what matters is the ratio of matmul time to memory-bound time.
_FLOPS_PER_S = 4e14
_BYTES_PER_S = 3e12


@dataclass(frozen=True)
class Group:
    """A buffer the backward reads from the forward, with its views that it reads.

    Attributes:
        root: the node owning the memory.
        members: ``root`` first, then the views of it the backward reads and the
            views between: everything copied when the group is recomputed.
        nbytes: the buffer's size.
        kind: ``"view"``, ``"pointwise"``, ``"matmul"`` or ``"other"`` (reductions,
            norms, gathers...), from the op making ``root``.
        flops / seconds: the estimated cost of recomputing the op making ``root``.
        module: the path of the submodule that made ``root`` (``""`` if unknown).
        tags: the names given with ``sg.checkpoint_name`` to ``root`` or to any
            view of its buffer in the forward.
    """

    root: Node
    members: tuple[Node, ...]
    nbytes: int
    kind: str
    flops: int
    seconds: float
    module: str
    tags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.root.name


def forward_end(graph: torch.fx.Graph) -> int:
    """The position of the first backward op (the forward is every node before it), or
    the number of nodes when the step has no backward."""
    for i, node in enumerate(graph.nodes):
        source = node.meta.get(SOURCE_KEY)
        if node.op == "call_function" and source is not None and source.backward and not _communicates(node):
            return i
    return len(graph.nodes)


def _communicates(node: Node) -> bool:
    """A collective or its wait: the overlap pass issues the backward's early, inside
    the forward, so they do not mark where the backward starts."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional"


def groups(program: Program) -> list[Group]:
    """Every forward buffer the backward reads that could be recomputed, in graph order."""
    nodes = list(program.graph.nodes)
    end = forward_end(program.graph)
    forward = set(nodes[:end])
    members: dict[Node, list[Node]] = {}
    first_read: dict[Node, int] = {}
    for i, node in enumerate(nodes[end:], end):
        for arg in _node_args(node):
            if arg in forward and arg.op == "call_function" and _tensor(arg):
                root = memory_root(arg)
                members.setdefault(root, []).append(arg)
                first_read.setdefault(root, i)
    tags = _tags_by_buffer(nodes[:end])
    position = {n: i for i, n in enumerate(nodes)}
    writes = _writes(nodes)
    found = []
    for root, read in members.items():
        closure = _closure(root, read)
        if (
            root in forward
            and root.op == "call_function"
            and all(recomputable(n) for n in closure)
            and not any(_overwritten(n, first_read[root], position, writes) for n in closure)
        ):
            found.append(_group(root, closure, tags.get(root, ())))
    return sorted(found, key=lambda g: position[g.root])


def _writes(nodes: list[Node]) -> dict[Node, list[int]]:
    """For each buffer the step writes in place (an input written back, a donated
    update), the positions of the ops writing it."""
    found: dict[Node, list[int]] = {}
    for i, node in enumerate(nodes):
        for arg in written_args(node):
            found.setdefault(memory_root(arg), []).append(i)
    return found


def _overwritten(node: Node, before: int, position: dict[Node, int], writes: dict[Node, list[int]]) -> bool:
    """Whether a buffer ``node`` reads is written after ``node`` and before position
    ``before``: a copy of ``node`` made there would read the new values (a step's
    ``x.neg_()`` after ``y = x * 2``, with ``y`` returned, kept for the output)."""
    at = position[node]
    return any(at < w < before for arg in _node_args(node) for w in writes.get(memory_root(arg), ()))


def recomputable(node: Node) -> bool:
    """Whether copying ``node`` gives the same values: a pure ATen op, no randomness."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and recomputable(node.args[0])
    target = node.target
    return pure_op(target) and target.overloadpacket.__name__ not in ("_local_scalar_dense", "copy_")


def rematerialize(program: Program, recompute: Collection[Group]) -> Program:
    """``program`` with the buffers of ``recompute`` recomputed in the backward.

    Returns:
        A new Program; copies carry ``meta[RECOMPUTED_KEY]`` (the forward node's name).

    Example:
        >>> planned = rematerialize(program, [g for g in groups(program) if g.kind == "pointwise"])
    """
    if not recompute:
        return program
    gm = program.copy_graph_module()
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    chosen = {by_name[m.name] for g in recompute for m in g.members}
    chosen |= {n.args[0] for n in chosen if n.target is operator.getitem}
    nodes = list(graph.nodes)
    copies: dict[Node, Node] = {}
    for node in nodes[forward_end(graph) :]:
        if any(a in chosen for a in _node_args(node)):
            with graph.inserting_before(node):
                node.args, node.kwargs = _mapped((node.args, node.kwargs), lambda a: _copy(graph, a, chosen, copies))
    graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("remat",))


def _copy(graph: torch.fx.Graph, node: Node, chosen: set[Node], copies: dict[Node, Node]) -> Node:
    """The backward's copy of ``node`` (made once, at its first use), or ``node`` itself."""
    if node not in chosen:
        return node
    if node not in copies:
        copy = graph.node_copy(node, lambda a: _copy(graph, a, chosen, copies))
        copy.meta[RECOMPUTED_KEY] = node.name
        copies[node] = copy
    return copies[node]


def _mapped(value: Any, fn: Any) -> Any:
    return torch.fx.node.map_arg(value, fn)


def _node_args(node: Node) -> Iterator[Node]:
    found: list[Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return iter(found)


def _tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _closure(root: Node, read: Iterable[Node]) -> list[Node]:
    """``root``, the views of it that are read, and the views between (a view copied
    must read a copied base, or it would keep the forward's buffer alive)."""
    found: dict[Node, None] = {root: None}
    stack = list(read)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found[node] = None
        if node.op == "call_function" and node.args and isinstance(node.args[0], Node):
            stack.append(node.args[0])
    return list(found)


def _tags_by_buffer(forward: list[Node]) -> dict[Node, tuple[str, ...]]:
    """The tags of each forward buffer: a tag on a view names the buffer it shows."""
    found: dict[Node, dict[str, None]] = {}
    for node in forward:
        for tag in node.meta.get(TAGS_KEY, ()):
            found.setdefault(memory_root(node), {})[tag] = None
    return {root: tuple(tags) for root, tags in found.items()}


def _group(root: Node, closure: list[Node], tags: tuple[str, ...]) -> Group:
    val = root.meta["val"]
    nbytes = val.untyped_storage().nbytes() if val.device.type != "meta" else val.numel() * val.element_size()
    op = root.args[0] if root.target is operator.getitem else root
    assert isinstance(op, Node)
    flops, moved = _cost(op)
    return Group(
        root=root,
        members=tuple(closure),
        nbytes=int(nbytes),
        kind=_kind(op),
        flops=flops,
        seconds=flops / _FLOPS_PER_S + moved / _BYTES_PER_S,
        module=str(root.meta.get(MODULE_KEY, "")),
        tags=tags,
    )


def library_op(node: Node) -> bool:
    """Whether ``node`` runs in a library rather than in a kernel ``sg.fuse`` generates
    (a custom op, a matmul, attention, a convolution): nothing fuses into it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return True
    if target.namespace not in ("aten", "prims"):
        return True
    name = target.overloadpacket.__name__
    return name in _LIBRARY or name.startswith(_LIBRARY_PREFIXES)


def _kind(op: Node) -> str:
    target = op.target
    if not isinstance(target, torch._ops.OpOverload):
        return "other"
    if target.overloadpacket.__name__ in _MATMULS:
        return "matmul"
    if target.is_view or torch.Tag.view_copy in target.tags:
        return "view"
    if torch.Tag.pointwise in target.tags or target.overloadpacket.__name__ in ("_to_copy", "clone"):
        return "pointwise"
    return "other"


def _cost(op: Node) -> tuple[int, int]:
    """Estimated FLOPs and bytes moved by ``op`` (its tensor inputs read, outputs written)."""
    # Imported here: importing it with sgraph upsets Triton's interpreter (TRITON_INTERPRET=1).
    from torch.utils.flop_counter import flop_registry

    vals = [a.meta.get("val") for a in _node_args(op)]
    moved = sum(_bytes(v) for v in vals) + _bytes(op.meta.get("val"))
    target = op.target
    formula = flop_registry.get(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else None
    if formula is None:
        return 0, moved
    args, kwargs = _mapped((op.args, op.kwargs), lambda a: a.meta.get("val"))
    try:
        return int(formula(*args, **kwargs, out_val=op.meta.get("val"))), moved
    except Exception:  # a formula that does not take this overload's arguments
        return 0, moved


def _bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0
