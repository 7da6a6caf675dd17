"""Compute donated outputs in place, in the donated input's own memory.

After :mod:`donation`, output ``o`` is to be written into donated input ``i``. When
``o`` is made by an elementwise (or foreach) op whose first argument is input ``i``
itself -- or an intermediate made that way and read by nothing else -- and nothing
reads the old value afterwards, the op's in-place form produces ``o`` directly in
``i``'s memory: no new buffer, and no copy back at the end of the step.
``new_mu = lerp(mu, g)`` becomes ``mu.lerp_(g)``; ``new_p = p + u`` becomes
``p.add_(u)``; foreach ops likewise, all their lists' tensors at once.

The result is no longer purely functional (it writes into its inputs), so this
pass runs last, and only for runtimes that execute the graph as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import torch
import torch.fx

from ..kernels.adamw import INPLACE_FORMS, written_lists
from ..program import Program, alias_root, memory_root, placeholders, readers, returned

__all__ = ["reinplace"]

Node = torch.fx.Node


def reinplace(program: Program, *, in_place: bool = False, aten: bool = True) -> Program:
    """Rewrite the ops producing donated outputs into their in-place forms where safe.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).
        aten: rewrite ATen's elementwise and foreach ops too; with False only sgraph's
            own kernels (a program for Inductor, which writes an ATen op's result into
            the donated input itself, given the trailing ``copy_``, and takes in-place
            ATen ops on intermediates wrongly when no functionalization ran before it).

    Example:
        >>> [n.target for n in reinplace(program).ops()][-1]
        aten._foreach_add_.List
    """
    gm = program.graph_module_to_edit(in_place)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = placeholders(graph)
    values = returned(graph)
    target_of = {values[o]: inputs[i] for o, i in program.aliases}
    pending = {op for op in map(_producer, target_of) if op is not None}
    while pending:
        # Latest first: rewriting an op can make the op producing its input eligible.
        op = max(pending, key=order.__getitem__)
        pending.discard(op)
        selves = _rewrite(graph, op, target_of, order) if aten or op.target in INPLACE_FORMS else []
        pending.update(p for p in map(_producer, selves) if p is not None)
    graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("reinplace",))


def _producer(node: Node) -> Node | None:
    """The op making ``node`` (for a foreach result, the foreach op)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        return node.args[0]
    return node


def _rewrite(graph: torch.fx.Graph, op: Node, target_of: dict[Node, Node], order: dict[Node, int]) -> list[Node]:
    """Replace ``op`` by its in-place form if every written tensor is safe to overwrite.

    Returns:
        The tensors now written in place (empty when ``op`` was left alone).
    """
    inplace = _inplace_variant(op.target)
    if inplace is None or _rounds_its_scalar(op):
        return []
    selves = _selves(op)
    results = _results(op, len(selves))
    if results is None:
        return []
    args = _ArgRoots(op, selves)
    if not all(_safe(s, r, op, args, target_of, order) for s, r in zip(selves, results)):
        return []
    with graph.inserting_before(op):
        new = graph.call_function(inplace, op.args, op.kwargs)
    new.meta = {k: v for k, v in op.meta.items() if k != "val" or not _returns_list(op)}
    order[new] = order[op]
    for self_node, result in zip(selves, results):
        if result is None:
            continue
        replacement = self_node if _returns_list(op) else new
        result.replace_all_uses_with(replacement)
        if result in target_of:
            target_of[replacement] = target_of[self_node] = target_of.pop(result)
        if result is not op:
            graph.erase_node(result)
    graph.erase_node(op)
    return [s for s in selves if s.op != "placeholder"]


def _selves(op: Node) -> list[Node]:
    """The tensors the in-place form writes, in the order the op returns their new values."""
    if op.target in INPLACE_FORMS:
        return written_lists(op.args)
    return list(cast("Sequence[Node]", op.args[0])) if _returns_list(op) else [cast(Node, op.args[0])]


def _results(op: Node, count: int) -> list[Node | None] | None:
    """Per written tensor, the node reading its new value (getitem for list results)."""
    if not _returns_list(op):
        return [op]
    results: list[Node | None] = [None] * count
    for user in op.users:
        if user.target is not operator.getitem or cast(int, user.args[1]) >= count:
            return None
        results[cast(int, user.args[1])] = user
    return results


def _safe(
    self_node: object,
    result: Node | None,
    op: Node,
    args: _ArgRoots,
    target_of: dict[Node, Node],
    order: dict[Node, int],
) -> bool:
    if not isinstance(self_node, Node):
        return False
    if result is not None and not _same_layout(self_node, result):
        return False
    if self_node.op == "placeholder":
        # Only into the donated input this very result is written into.
        if result is None or target_of.get(result) is not self_node:
            return False
    elif len(self_node.users) != 1 or memory_root(self_node) is not self_node:
        return False  # read again later, or a view: its base may be an input or read elsewhere
    if args.other_reads(self_node):
        return False
    return all(order[r] <= order[op] for r in readers(self_node))


class _ArgRoots:
    """An op's tensor arguments and the memory each views, computed once per op (a fused
    optimizer update takes hundreds of lists' worth of arguments)."""

    def __init__(self, op: Node, selves: list[Node]) -> None:
        others = [a for a in torch.utils._pytree.tree_leaves((op.args, op.kwargs)) if isinstance(a, Node)]
        written = set(selves)
        self.count: dict[Node, int] = {}
        for a in others:
            self.count[a] = self.count.get(a, 0) + 1
        self.roots: dict[Node, int] = {}  # memory root -> arguments other than the written ones viewing it
        for a in others:
            if a not in written:
                root = alias_root(a)
                self.roots[root] = self.roots.get(root, 0) + 1

    def other_reads(self, self_node: Node) -> bool:
        """Whether another argument reads ``self_node``'s memory (through a view, or twice)."""
        return self.count.get(self_node, 0) > 1 or self.roots.get(alias_root(self_node), 0) > 0


def _same_layout(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return va.dtype == vb.dtype and va.shape == vb.shape and va.stride() == vb.stride() and va.device == vb.device


def _returns_list(op: Node) -> bool:
    return op.target in INPLACE_FORMS or cast(torch._ops.OpOverload, op.target)._schema.name.startswith(
        "aten::_foreach_"
    )


_SCALAR_MULS = {torch.ops.aten._foreach_mul.Scalar, torch.ops.aten._foreach_mul.ScalarList}
_LOW = (torch.bfloat16, torch.float16)


def _rounds_its_scalar(op: Node) -> bool:
    """Whether the in-place form would compute another value: on CPU tensors of bf16 or
    fp16, ATen's ``_foreach_mul_`` by a Python number rounds the number to the tensors'
    dtype first (``0.9`` -> ``0.8984375`` in bf16), the out-of-place op does not (an SGD
    momentum buffer drifted 1.3% in six steps). Such an op keeps its out-of-place form,
    and its result is copied into the donated input after the step."""
    if op.target not in _SCALAR_MULS:
        return False
    tensors = [t.meta.get("val") for t in cast("Sequence[Node]", op.args[0])]
    return any(isinstance(t, torch.Tensor) and t.dtype in _LOW and t.device.type == "cpu" for t in tensors)


def _inplace_variant(target: object) -> torch._ops.OpOverload | None:
    """``aten.add.Tensor`` -> ``aten.add_.Tensor`` for elementwise and foreach ops, and
    sgraph's own kernels' in-place forms; None for anything else."""
    if target in INPLACE_FORMS:
        return INPLACE_FORMS[target]
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[1]
    if not (name.startswith("_foreach_") or torch.Tag.pointwise in target.tags):
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    variant = getattr(packet, target._overloadname, None) if packet is not None else None
    if variant is None or len(variant._schema.arguments) != len(target._schema.arguments):
        return None
    return variant
