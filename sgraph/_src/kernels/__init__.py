"""sgraph's own kernels, each registered as a torch custom op (one file per kernel)."""

from __future__ import annotations

from typing import Any

__all__ = ["scratch_bytes"]


def scratch_bytes(op: str, args: list[Any]) -> list[tuple[int, str]]:
    """The buffers own op ``op`` (``"sgraph::name"``) allocates inside itself beyond its
    outputs and holds at its peak, as ``(bytes, description)``, for the arguments'
    (fake) tensors ``args``; empty for an op that allocates nothing of its own."""
    if op == "sgraph::linear_cross_entropy":
        from .linear_cross_entropy import scratch_bytes as linear_cross_entropy_scratch

        return linear_cross_entropy_scratch(args[0], args[1])
    if op in ("sgraph::gelu_linear", "sgraph::gelu_linear_backward"):
        from .gelu_mlp import scratch_bytes as gelu_mlp_scratch

        return gelu_mlp_scratch(args[0])
    return []
