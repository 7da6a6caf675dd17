"""The collectives of a traced step: which nodes they are, their groups and bytes.

A sharded step traces into local ATen ops plus torch's functional collectives
(``torch.ops._c10d_functional``): each collective returns a tensor that is ready
only after its ``wait_tensor``. Passes over collectives (elision, bucketing,
overlap) and the cost model read them through :func:`collectives`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

__all__ = [
    "Collective",
    "add_call",
    "collectives",
    "group_name",
    "group_ranks",
    "group_size",
    "is_collective",
    "is_wait",
    "wait_of",
]

_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class Collective:
    """One collective of a program.

    Attributes:
        node: the collective's node (its value is ready only after ``wait``).
        wait: the ``wait_tensor`` node of its result (None if never waited on).
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``
            or ``"broadcast"``.
        group: the process group's name, as the graph records it.
        size: how many ranks take part.
        input_bytes / output_bytes: this rank's bytes in and out.
    """

    node: torch.fx.Node
    wait: torch.fx.Node | None
    kind: str
    group: str
    size: int
    input_bytes: int
    output_bytes: int


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` issues a functional collective (``wait_tensor`` excluded)."""
    return _op_name(node) in _KINDS


def is_wait(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ``_c10d_functional.wait_tensor``."""
    return _op_name(node) == "wait_tensor"


def collectives(graph: torch.fx.Graph) -> list[Collective]:
    """The graph's collectives, in program order.

    Example:
        >>> [c.kind for c in collectives(program.graph)]
        ['all_gather', 'reduce_scatter', 'all_reduce']
    """
    found = []
    for node in graph.nodes:
        name = _op_name(node)
        if name not in _KINDS:
            continue
        group = cast(str, _group_arg(node))
        found.append(
            Collective(
                node,
                wait_of(node),
                _KINDS[name],
                group,
                _size(node, group),
                _bytes(node.args[0]),
                _bytes(node),
            )
        )
    return found


def group_name(node: torch.fx.Node) -> str:
    """The name of the process group a collective ``node`` runs over, as the graph records it."""
    return cast(str, _group_arg(node))


def add_call(
    graph: torch.fx.Graph,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> torch.fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insert point, with its ``meta["val"]``.

    The value is computed in the fake mode of the arguments' values, so later passes
    (bytes, shapes, memory) read new nodes as they read traced ones; a node whose
    arguments carry no fake values gets none.

    Example:
        >>> with graph.inserting_before(node):
        ...     flat = add_call(graph, torch.ops.aten.view.default, (x, [-1]))
    """
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, args, kwargs or {})
    vals, kwvals = torch.fx.node.map_arg((args, kwargs or {}), lambda a: a.meta.get("val"))
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    mode = detect_fake_mode(inputs)
    if mode is not None and all(isinstance(v, torch.Tensor) for v in inputs):
        with mode:
            node.meta["val"] = target(*vals, **kwvals)
    return node


def group_size(group: str) -> int:
    """The number of ranks in the process group named ``group``."""
    return len(group_ranks(group))


def group_ranks(group: str) -> list[int]:
    """The global ranks in the process group named ``group``, in group order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(cast(Any, group))))


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._opname if target.namespace == "_c10d_functional" else None


def _group_arg(node: torch.fx.Node) -> Any:
    schema = cast(torch._ops.OpOverload, node.target)._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("group_name", "tag"):
            return node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
    raise ValueError(f"no group in {node.format_node()}")


def _size(node: torch.fx.Node, group: str) -> int:
    schema = cast(torch._ops.OpOverload, node.target)._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_size":
            return int(cast(Any, node.args[i] if i < len(node.args) else node.kwargs[arg.name]))
    return group_size(group)


def wait_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``wait_tensor`` of collective ``node``'s result (None if nothing waits on it)."""
    for user in node.users:
        if is_wait(user):
            return user
    for user in node.users:  # a coalesced collective: its outputs are waited through getitem
        for inner in user.users:
            if is_wait(inner):
                return inner
    return None


def _bytes(value: Any) -> int:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return sum(_bytes(v) for v in value)
    return 0
