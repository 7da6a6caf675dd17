"""Algebraic folds that remove whole passes over memory.

``p + (x - p) -> x``: an optimizer that returns ``updates = new_p - p`` followed by
``apply_updates`` computes ``p + (new_p - p)``, which equals ``new_p`` exactly
whenever ``new_p`` is within a factor of two of ``p`` (Sterbenz), and otherwise
differs from it by at most one rounding. Folding it saves two passes over every
parameter, for the foreach (list) and the single-tensor forms alike (a sharded
step's foreach ops come as single ones).

Only ``sg.optim``'s own nodes are folded (marked with ``FOLDABLE_KEY`` when traced):
the same arithmetic in user code keeps eager's values, which differ where ``p`` is
large against ``x`` or not finite (``p + (x - p)`` is NaN for an infinite ``p``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import torch

from ..program import Program
from ..tags import FOLDABLE_KEY

__all__ = ["simplify"]

Node = torch.fx.Node
aten = torch.ops.aten


def simplify(program: Program, *, in_place: bool = False) -> Program:
    """Fold ``p + (x - p)`` into ``x`` where the difference is used for nothing else.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> aten._foreach_add.List in {n.target for n in simplify(program).ops()}
        False
    """
    gm = program.graph_module_to_edit(in_place)
    for node in list(gm.graph.nodes):
        if node.target is aten._foreach_add.List and not node.kwargs:
            _fold_list(node)
        elif node.target is aten.add.Tensor and not node.kwargs:
            _fold_single(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return program.replace(graph_module=gm, passes=program.passes + ("simplify",))


def _fold_single(add: Node) -> None:
    p, diff = add.args
    if (
        isinstance(diff, Node)
        and _foldable(add, diff)
        and diff.target is aten.sub.Tensor
        and not diff.kwargs
        and diff.args[1] is p
        and len(diff.users) == 1
        and _same_meta(add, diff.args[0])
    ):
        add.replace_all_uses_with(cast(Node, diff.args[0]))


def _fold_list(add: Node) -> None:
    params, diffs = cast("tuple[Sequence[Node], Sequence[Node]]", add.args)
    subs = {d.args[0] for d in diffs if isinstance(d, Node) and d.target is operator.getitem}
    if len(subs) != 1 or len(diffs) != len(params):
        return
    sub = cast(Node, subs.pop())
    if (
        sub.target is not aten._foreach_sub.List
        or sub.kwargs
        or list(cast("Sequence[Node]", sub.args[1])) != list(params)
    ):
        return
    if any(d.target is not operator.getitem or d.args[1] != k or len(d.users) != 1 for k, d in enumerate(diffs)):
        return
    if not _foldable(*diffs):
        return
    news = cast("Sequence[Node]", sub.args[0])
    for user in list(add.users):
        if user.target is operator.getitem and _foldable(user) and _same_meta(user, news[cast(int, user.args[1])]):
            user.replace_all_uses_with(news[cast(int, user.args[1])])


def _foldable(*nodes: Node) -> bool:
    return all(n.meta.get(FOLDABLE_KEY, False) for n in nodes)


def _same_meta(a: Node, b: object) -> bool:
    va, vb = a.meta.get("val"), getattr(b, "meta", {}).get("val")
    return (
        isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and va.shape == vb.shape
    )
