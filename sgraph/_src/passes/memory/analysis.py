"""How much memory one run of a lowered step needs, read off its graph before running.

Every tensor the graph makes is a buffer, allocated where the op producing it runs
and freed after the last op that reads it or any view of it; inputs (parameters,
optimizer state, the batch) are the user's and live throughout; values the step
returns live to its end. A view or an in-place op allocates nothing; each tensor of
a multi-output op (a foreach op, layer norm's mean and rstd) is its own buffer. The
sizes come from the fake tensors the trace recorded, so a step meant for a large GPU
is analysed before it runs (a train step for CUDA needs the device to be traced: see
docs/memory.md).

Two kinds of memory no tensor of the graph shows are counted as ``workspace``: the
cuBLAS and cuBLASLt workspaces of the stream a CUDA step runs on, from its first
matmul to its end (``sg.static`` runs the step on a stream of its own, so they are
the step's; ``CUBLAS_WORKSPACE_CONFIG`` and ``CUBLASLT_WORKSPACE_SIZE`` are read as
torch reads them), the buffers sgraph's own kernels allocate inside the op (the
chunk of logits of the fused linear + cross-entropy), during that op, and, for a
step run on ``sg.fuse``'s generated kernels on CUDA, the buffer Inductor flushes the
L2 cache with while it times kernel configurations at their first launch (the size
of the L2 cache; the first call only, at any point of it, so it is counted through
the step), and the copies it times a kernel writing its inputs in place on (an AdamW
update it generates: one leaf's param and moments, at the update).

Not counted: the memory of other ops' insides (cuDNN workspaces, the buffers a
generated kernel keeps to itself), the CUDA-graph runtime's copies of non-donated
inputs and of returned values, and allocator fragmentation. CUDA buffers are rounded
up to the caching allocator's 512-byte blocks.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx

from ...capture import SOURCE_KEY
from ...program import Program, memory_root, placeholders, returned
from ...text import describe_tensor
from ..shard.collectives import is_collective, wait_of

__all__ = ["Buffer", "MemoryAnalysis", "memory_analysis"]

_CUDA_BLOCK = 512


@dataclass(frozen=True)
class Buffer:
    """One tensor's memory: what made it, how big, its kind, and its lifetime as
    positions in the graph (``start`` to ``end``, both included)."""

    name: str
    nbytes: int
    kind: str
    start: int
    end: int
    describe: str = ""
    source: str = ""


@dataclass(frozen=True)
class MemoryAnalysis:
    """The predicted memory of one run of a step.

    Attributes:
        peak_bytes: the most bytes live at once.
        peak_index: the position of the peak in the graph (an index of ``timeline``).
        peak_node: the op at which the peak is reached (its name in the listing).
        peak_source: that op's line in the user's code.
        by_kind: bytes live at the peak, per kind: ``input:<argument>`` for the
            step's arguments, ``activation`` (made in the forward, read by the
            backward), ``gradient`` (made by backward ops), ``output`` (returned),
            ``temporary`` (anything else).
        top: the largest buffers live at the peak, largest first.
        timeline: bytes live at each node of the graph, in order.
        buffers: every buffer, in allocation order.
    """

    name: str
    peak_bytes: int
    peak_index: int
    peak_node: str
    peak_source: str
    by_kind: dict[str, int]
    top: tuple[Buffer, ...]
    timeline: tuple[int, ...] = field(repr=False)
    buffers: tuple[Buffer, ...] = field(repr=False)

    def as_text(self, top: int = 10) -> str:
        """A readable summary: the peak, where it is, the split by kind, the top buffers."""
        lines = [
            f"{self.name}: predicted peak {_mib(self.peak_bytes)} at %{self.peak_node}"
            + (f" ({self.peak_source})" if self.peak_source else ""),
            "  live at the peak, by kind:",
        ]
        for kind, nbytes in sorted(self.by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {kind:<24} {_mib(nbytes):>12}")
        lines.append("  largest buffers live at the peak:")
        for buffer in self.top[:top]:
            where = f"  # {buffer.source}" if buffer.source else ""
            size = _mib(buffer.nbytes)
            lines.append(f"    %{buffer.name:<28} {size:>12}  {buffer.kind:<16} {buffer.describe}{where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()

    def by_kind_timeline(self) -> dict[str, list[int]]:
        """Bytes live at each node, per kind (the stacked series of :meth:`plot`)."""
        kinds = dict.fromkeys(b.kind for b in self.buffers)
        return {k: _live([b for b in self.buffers if b.kind == k], len(self.timeline)) for k in kinds}

    def plot(self, path: str | os.PathLike[str] | None = None, *, top: int = 3) -> Any:
        """Live bytes across the step's nodes, stacked by kind, with the peak marked and
        the largest buffers the step makes there labelled; saved as PNG at ``path``.

        Needs matplotlib (``pip install matplotlib``); pyplot is not used, so no
        window opens and your backend is left alone.

        Returns:
            The ``matplotlib.figure.Figure``.

        Example:
            >>> lowered.memory_analysis().plot("step-memory.png")
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("MemoryAnalysis.plot needs matplotlib: pip install matplotlib") from error
        figure = Figure(figsize=(10, 4.5), layout="constrained")
        axes = figure.add_subplot()
        series = self.by_kind_timeline()
        order = sorted(series, key=_kind_order)
        x = _highest_per_bin(self.timeline, bins=600)  # a one-node spike must stay visible
        bottom = [0.0] * len(x)
        for kind in order:  # stacked as steps: a one-node peak is a plateau, not a sliver
            top_ = [b + series[kind][i] / 2**20 for b, i in zip(bottom, x)]
            axes.fill_between(x, bottom, top_, step="post", label=kind, alpha=0.85, linewidth=0)
            bottom = top_
        axes.axvline(self.peak_index, color="black", linewidth=0.8, linestyle="--")
        labels = [f"peak {_mib(self.peak_bytes)} at %{self.peak_node}"]
        made = [b for b in self.top if not b.kind.startswith("input:")]  # inputs are flat bands
        labels += [f"%{b.name} {_mib(b.nbytes)} {b.kind}" for b in made[:top]]
        axes.annotate(
            "\n".join(labels),
            (self.peak_index, self.peak_bytes / 2**20),
            fontsize=8,
            xytext=(8, -8),
            textcoords="offset points",
            va="top",
        )
        axes.set(xlabel="node of the lowered graph (run order)", ylabel="MiB live", title=self.name)
        axes.legend(loc="upper left", fontsize=8)
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure

    def _repr_html_(self) -> str:
        text = f"<pre style='font-size:smaller'>{html.escape(self.as_text())}</pre>"
        try:
            buffer = io.BytesIO()
            self.plot().savefig(buffer, format="png", dpi=80)
        except ImportError:
            return text
        image = base64.b64encode(buffer.getvalue()).decode()
        return f"<img src='data:image/png;base64,{image}'/>" + text


def memory_analysis(program: Program, *, generated: bool = False) -> MemoryAnalysis:
    """Predict the memory of one run of ``program`` (see the module docstring);
    ``generated``: it runs on ``sg.fuse``'s generated kernels.

    Example:
        >>> print(train_step.lower(params, opt_state, batch).memory_analysis())
    """
    graph = program.graph
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    end = len(nodes) - 1
    kinds = _input_kinds(program)
    live_to_end = {memory_root(v) for v in returned(graph) if isinstance(v, torch.fx.Node)}
    last_read = _last_reads(nodes, position)
    buffers = []
    for node in nodes:
        if node.op == "placeholder":
            buffers.append(_buffer(node, kinds.get(node, "input"), 0, end))
            continue
        start = _allocated_at(node, position)
        if start is None:
            continue
        finish = end if node in live_to_end else max(start, last_read.get(node, start))
        kind = "output" if node in live_to_end else _kind(node, nodes, finish)
        buffers.append(_buffer(node, kind, start, finish))
    buffers += _inside_ops(nodes) + _library_workspaces(nodes)
    buffers += (_autotuning(nodes) + _update_clones(nodes, position)) if generated else []
    return _summary(program.name, nodes, buffers)


def _allocated_at(node: torch.fx.Node, position: dict[torch.fx.Node, int]) -> int | None:
    """Where ``node``'s own memory is allocated, or None when it has none (a view,
    an in-place op, a multi-output op whose outputs are buffers of their own)."""
    if node.op != "call_function" or memory_root(node) is not node:
        return None
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return position[node.args[0]]  # allocated by the multi-output op itself
    return position[node]


def _last_reads(nodes: list[torch.fx.Node], position: dict[torch.fx.Node, int]) -> dict[torch.fx.Node, int]:
    """Per buffer (memory root), the position of the last op reading it or a view of it.
    A collective reads its input until its wait: the communication runs in between."""
    last: dict[torch.fx.Node, int] = {}
    for node in nodes:
        if not node.users:
            continue
        root = memory_root(node)
        last[root] = max(last.get(root, 0), *(position[_read_until(user)] for user in node.users))
    return last


def _read_until(user: torch.fx.Node) -> torch.fx.Node:
    if not is_collective(user):
        return user
    wait = wait_of(user)
    return wait if wait is not None else user


def _kind(node: torch.fx.Node, nodes: list[torch.fx.Node], finish: int) -> str:
    source = node.meta.get(SOURCE_KEY)
    if source is not None and source.backward:
        return "gradient"
    reader = nodes[finish]
    reader_source = reader.meta.get(SOURCE_KEY)
    if reader_source is not None and reader_source.backward:
        return "activation"
    return "temporary"


_CUBLAS_OPS = frozenset(
    f"aten::{name}"
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot", "_scaled_mm")
) | {"sgraph::linear_cross_entropy"}


def _library_workspaces(nodes: list[torch.fx.Node]) -> list[Buffer]:
    """The cuBLAS and cuBLASLt workspaces, from the first CUDA matmul to the end:
    allocated on a stream's first matmul and kept by torch for the stream's life."""
    for i, node in enumerate(nodes):
        if _op_name(node) not in _CUBLAS_OPS:
            continue
        val = node.meta.get("val")
        out = val[0] if isinstance(val, (tuple, list)) else val
        if not isinstance(out, torch.Tensor) or out.device.type != "cuda":
            return []
        device = out.device
        end = len(nodes) - 1
        return [
            Buffer("cublas_workspace", _cublas_workspace_bytes(device), "workspace", i, end, "cuBLAS workspace"),
            Buffer("cublaslt_workspace", _cublaslt_workspace_bytes(), "workspace", i, end, "cuBLASLt workspace"),
        ]
    return []


def _autotuning(nodes: list[torch.fx.Node]) -> list[Buffer]:
    """Inductor's L2 flush buffer, for a CUDA step (see the module docstring)."""
    devices = {v.device for n in nodes if isinstance(v := n.meta.get("val"), torch.Tensor)}
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return []
    nbytes = 60 * 2**20  # an H200's, without a GPU to ask
    if torch.cuda.is_available():
        nbytes = torch.cuda.get_device_properties(cuda[0].index or 0).L2_cache_size
    return [Buffer("autotuning_l2_flush", nbytes, "workspace", 0, len(nodes) - 1, "L2 flush of kernel timing")]


def _update_clones(nodes: list[torch.fx.Node], position: dict[torch.fx.Node, int]) -> list[Buffer]:
    """What Inductor copies while it times a generated kernel that writes its inputs in
    place, for a CUDA step: the params and moments an AdamW update written in place
    (``sgraph::adamw_``) is lowered to write when ``sg.fuse`` generates it (see
    ``kernels/adamw.py``). Each leaf's update is a kernel of its own, timed alone with
    copies of the three tensors it writes, at the update (the first call only)."""
    from ...kernels.adamw import GENERATED_LEAVES, leaves_updated

    if leaves_updated(nodes) > GENERATED_LEAVES:  # not generated: ATen's multi-tensor kernel runs it
        return []
    found = []
    for node in nodes:
        sizes = _written_per_leaf(node) if node.target is torch.ops.sgraph.adamw_.default else []
        if sizes:
            at = position[node]
            found.append(
                Buffer(f"{node.name}.timing_copies", max(sizes), "workspace", at, at, "copies for kernel timing")
            )
    return found


def _written_per_leaf(update: torch.fx.Node) -> list[int]:
    """Bytes of each leaf's param and moments an in-place AdamW writes (CUDA only)."""
    params, _, mu, nu = (cast("list[torch.fx.Node]", update.args[i]) for i in range(4))
    sizes = []
    for leaf in zip(params, mu, nu):
        vals = [t.meta.get("val") for t in leaf]
        tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.device.type == "cuda"]
        if len(tensors) == len(vals):
            sizes.append(sum(_nbytes(v) for v in tensors))
    return sizes


def _cublas_workspace_bytes(device: torch.device) -> int:
    """torch's cuBLAS workspace per handle and stream: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs) if set, else 32 MiB on Hopper (compute capability 9)
    and later, 8 MiB + 128 KiB before. Without a GPU to ask, Hopper's is assumed."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * int(count) for size, count in pairs) * 1024
    major = 9
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability(device.index if device.index is not None else None)[0]
    return (4096 * 8 if major >= 9 else 4096 * 2 + 16 * 8) * 1024


def _cublaslt_workspace_bytes() -> int:
    """torch's cuBLASLt workspace: ``CUBLASLT_WORKSPACE_SIZE`` KiB, 1 MiB by default."""
    size = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    return int(size) * 1024 if size.isdigit() else 2**20


def _inside_ops(nodes: list[torch.fx.Node]) -> list[Buffer]:
    """What sgraph's own kernels allocate inside the op, beyond their outputs, live
    during the op (the sizes come from the kernel's own accounting)."""
    from ...kernels import scratch_bytes

    found = []
    for i, node in enumerate(nodes):
        op = _op_name(node)
        if not op.startswith("sgraph::"):
            continue
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        device = args[0].device if isinstance(args[0], torch.Tensor) else torch.device("cpu")
        source = node.meta.get(SOURCE_KEY)
        where = source.short() if source is not None else ""
        for k, (nbytes, describe) in enumerate(scratch_bytes(op, args)):
            size = _allocated(nbytes, device)
            found.append(Buffer(f"{node.name}.inside{k}", size, "workspace", i, i, describe, where))
    return found


def _op_name(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return ""
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else ""


def _input_kinds(program: Program) -> dict[torch.fx.Node, str]:
    """``input:<argument>`` per placeholder, from the leaf paths (``params['w']`` -> params)."""
    found = {}
    for node, leaf in zip(placeholders(program.graph), program.tensor_inputs):
        argument = re.split(r"[\[.]", leaf.path, maxsplit=1)[0] or "input"
        found[node] = f"input:{argument}"
    return found


def _buffer(node: torch.fx.Node, kind: str, start: int, end: int) -> Buffer:
    val = node.meta.get("val")
    nbytes = _nbytes(val) if isinstance(val, torch.Tensor) else 0
    source = node.meta.get(SOURCE_KEY)
    text = describe_tensor(val.dtype, tuple(val.shape)) if isinstance(val, torch.Tensor) else ""
    return Buffer(node.name, nbytes, kind, start, end, text, source.short() if source is not None else "")


def _nbytes(val: torch.Tensor) -> int:
    try:
        nbytes = int(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        nbytes = val.numel() * val.element_size()
    return _allocated(nbytes, val.device)


def _allocated(nbytes: int, device: torch.device) -> int:
    """What ``nbytes`` takes on ``device``: CUDA's caching allocator rounds up to its blocks."""
    return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK if device.type == "cuda" else nbytes


def _live(buffers: Sequence[Buffer], length: int) -> list[int]:
    """Bytes live at each of ``length`` graph positions, over ``buffers``."""
    delta = [0] * (length + 1)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[b.end + 1] -= b.nbytes
    return list(itertools.accumulate(delta[:-1]))


def _summary(name: str, nodes: list[torch.fx.Node], buffers: list[Buffer]) -> MemoryAnalysis:
    timeline = _live(buffers, len(nodes))
    peak_at = max(range(len(timeline)), key=timeline.__getitem__) if timeline else 0
    at_peak = sorted((b for b in buffers if b.start <= peak_at <= b.end), key=lambda b: -b.nbytes)
    by_kind: dict[str, int] = {}
    for b in at_peak:
        by_kind[b.kind] = by_kind.get(b.kind, 0) + b.nbytes
    node = nodes[peak_at] if nodes else None
    source = node.meta.get(SOURCE_KEY) if node is not None else None
    return MemoryAnalysis(
        name=name,
        peak_bytes=timeline[peak_at] if timeline else 0,
        peak_index=peak_at,
        peak_node=node.name if node is not None else "",
        peak_source=source.short() if source is not None else "",
        by_kind=by_kind,
        top=tuple(at_peak[:20]),
        timeline=tuple(timeline),
        buffers=tuple(buffers),
    )


def _highest_per_bin(timeline: tuple[int, ...], bins: int) -> list[int]:
    """Node indices to draw: all of them for a small graph, else the highest node of
    each of ``bins`` equal runs (and the peak), so no peak is lost between pixels."""
    if len(timeline) <= bins:
        return list(range(len(timeline)))
    width = -(-len(timeline) // bins)
    runs = (range(i, min(i + width, len(timeline))) for i in range(0, len(timeline), width))
    return [max(run, key=timeline.__getitem__) for run in runs]


def _kind_order(kind: str) -> tuple[int, str]:
    rank = {"workspace": 5, "output": 4, "temporary": 3, "gradient": 2, "activation": 1}
    return (0 if kind.startswith("input:") else rank.get(kind, 6), kind)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} B"
