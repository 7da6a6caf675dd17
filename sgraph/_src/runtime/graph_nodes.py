"""Count the kernel nodes of a captured CUDA graph through the CUDA runtime API.

PyTorch exposes the ``cudaGraph_t`` (``CUDAGraph.raw_cuda_graph()``, with
``keep_graph=True``) but not its nodes; the CUDA runtime that PyTorch already
loaded answers ``cudaGraphGetNodes`` and ``cudaGraphNodeGetType``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["count_kernels", "new_graph"]

_KERNEL_NODE = 0  # cudaGraphNodeTypeKernel


def new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """A CUDAGraph that keeps its ``cudaGraph_t`` for inspection when torch allows it.

    Returns:
        ``(graph, kept)``; a kept graph must be ``instantiate()``d after capture.
    """
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        return torch.cuda.CUDAGraph(), False


def count_kernels(graph: torch.cuda.CUDAGraph, kept: bool) -> int | None:
    """Kernel nodes in ``graph``, or ``None`` when the runtime or the handle is unavailable.

    A failed runtime call here leaves the CUDA runtime's last error set, which the next
    kernel launch anywhere in the process would report as its own; it is cleared."""
    cudart = _cudart()
    raw = getattr(graph, "raw_cuda_graph", None)
    if cudart is None or raw is None or not kept:
        return None
    try:
        handle = ctypes.c_void_p(raw())
    except RuntimeError:
        return None
    if not handle.value:
        return None
    kernels = _kernel_nodes(cudart, handle)
    if kernels is None:
        cudart.cudaGetLastError()
    return kernels


def _kernel_nodes(cudart: ctypes.CDLL, handle: ctypes.c_void_p) -> int | None:
    """The kernel nodes of the graph ``handle``, or ``None`` if a runtime call failed."""
    count = ctypes.c_size_t(0)
    if cudart.cudaGraphGetNodes(handle, None, ctypes.byref(count)) != 0:
        return None
    if count.value == 0:  # a step with no kernels (all its tensors empty)
        return 0
    nodes = (ctypes.c_void_p * count.value)()
    if cudart.cudaGraphGetNodes(handle, nodes, ctypes.byref(count)) != 0:
        return None
    kind = ctypes.c_int(0)
    kernels = 0
    for node in nodes:
        if cudart.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
            return None
        kernels += kind.value == _KERNEL_NODE
    return kernels


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The libcudart this process loaded (PyTorch's), found through /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
