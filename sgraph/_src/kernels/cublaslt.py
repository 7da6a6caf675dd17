"""cuBLASLt matmuls with a GELU epilogue, called through ``ctypes``.

torch runs its matmuls on cuBLAS(Lt) but exposes only the bias epilogue. cuBLASLt also
applies the tanh GELU in the matmul's epilogue, writing both the activation and its
input (``GELU_AUX_BIAS``), and in the backward multiplies the product by the GELU's
derivative (``DGELU``). Each saves a pass over the ``rows x hidden`` activations that
a separate kernel would make.

The library is the one torch already loaded (found in ``/proc/self/maps``), so its
version is torch's. For each matmul shape the fastest of cuBLASLt's candidate
algorithms is kept (its first guess was 22% slower on one of gpt-med's shapes), timed
once and remembered in Inductor's cache directory, per GPU and library version, so a
later process takes it without timing. Calls go on torch's current stream, with a
workspace from torch's allocator, so they are captured into a CUDA graph like any
other kernel. A matmul
cuBLASLt has no algorithm for (a layout, alignment or dtype it does not take) raises
:class:`Unsupported`; callers fall back to ATen.

Layouts: torch's row-major ``[rows, cols]`` is cuBLAS's column-major ``cols x rows``,
so ``D = X @ W.T`` (``X [n, k]``, ``W [m, k]``) is the column-major ``D' = W' X'``
with ``W`` transposed: ``m = hidden``, the bias of length ``m``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..runtime.cache_files import read_json, write_atomically

__all__ = ["WORKSPACE_BYTES", "Unsupported", "available", "dgelu_matmul", "gelu_matmul"]

_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}
_OP_N, _OP_T = 0, 1

# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER = 3, 4, 7, 8
_AUX_POINTER, _AUX_LD, _BIAS_DATA_TYPE = 11, 12, 26
# cublasLtEpilogue_t
_GELU_AUX, _GELU_AUX_BIAS, _DGELU = 160, 164, 192
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
WORKSPACE_BYTES = 4 << 20
"""The most workspace a call takes (allocated per call from torch's allocator)."""
_ALIGN = 16
_CANDIDATES = 8
_TIMED_RUNS = 5


class Unsupported(RuntimeError):
    """cuBLASLt has no algorithm for this matmul (or no library was found)."""


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@functools.cache
def _library() -> Any:
    """torch's own libcublasLt, loaded once torch has initialized CUDA."""
    torch.cuda.init()
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS and cuBLASLt
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    except OSError:
        pass
    for name in paths + ["libcublasLt.so", "libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def available() -> bool:
    """Whether cuBLASLt can be called here (a GPU, and torch's library found)."""
    return torch.cuda.is_available() and torch.version.cuda is not None and _library() is not None


def _check(status: int, call: str) -> None:
    if status != 0:
        raise Unsupported(f"{call} returned cuBLAS status {status}")


_handles: dict[int, ctypes.c_void_p] = {}
_lock = threading.Lock()


def _handle(device: int) -> ctypes.c_void_p:
    with _lock:
        if device not in _handles:
            handle = ctypes.c_void_p()
            _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            _handles[device] = handle
        return _handles[device]


def _set(lib: Any, desc: ctypes.c_void_p, attribute: int, value: Any) -> None:
    _check(
        lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))),
        "cublasLtMatmulDescSetAttribute",
    )


def _layout(lib: Any, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    layout = ctypes.c_void_p()
    _check(
        lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)
        ),
        "cublasLtMatrixLayoutCreate",
    )
    return layout


class _Plan:
    """The descriptors and chosen algorithm of one matmul shape (kept for the process:
    a step's matmuls have a few shapes). Pointers are set on each call."""

    def __init__(self, device: int, key: tuple) -> None:
        dtype, trans_a, a_shape, b_shape, d_shape, epilogue = key
        lib = _library()
        self.lib, self.handle, self.lock = lib, _handle(device), threading.Lock()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        _set(lib, self.desc, _TRANSA, ctypes.c_int32(trans_a))
        _set(lib, self.desc, _TRANSB, ctypes.c_int32(_OP_N))
        _set(lib, self.desc, _EPILOGUE, ctypes.c_uint32(epilogue))
        _set(lib, self.desc, _AUX_LD, ctypes.c_int64(d_shape[0]))
        if epilogue == _GELU_AUX_BIAS:
            _set(lib, self.desc, _BIAS_DATA_TYPE, ctypes.c_int32(dtype))
        # Column-major shapes (rows, cols), leading dimension = rows (dense).
        self.a, self.b, self.d = (_layout(lib, dtype, r, c, r) for r, c in (a_shape, b_shape, d_shape))
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.c_size_t(ctypes.sizeof(limit))
            ),
            "cublasLtMatmulPreferenceSetAttribute",
        )
        for attribute in _PREF_MIN_ALIGNMENT:  # what _ready checks, not the default 256 bytes
            align = ctypes.c_uint32(_ALIGN)
            lib.cublasLtMatmulPreferenceSetAttribute(
                preference, attribute, ctypes.byref(align), ctypes.c_size_t(ctypes.sizeof(align))
            )
        results = (_Heuristic * _CANDIDATES)()
        found = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a, self.b, self.d, self.d, preference, _CANDIDATES,
            results, ctypes.byref(found),
        )  # fmt: skip
        lib.cublasLtMatmulPreferenceDestroy(preference)
        if status != 0 or found.value < 1:
            raise Unsupported(f"no cuBLASLt algorithm for {key} (status {status})")
        self.candidates = [results[i] for i in range(found.value) if results[i].state == 0]
        self.heuristic = self.candidates[0]
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.epilogue, self.tuned = epilogue, None if len(self.candidates) > 1 else 0
        self.name = f"{key}/{len(self.candidates)}"

    def run(self, a: Tensor, b: Tensor, d: Tensor, aux: Tensor, bias: Tensor | None) -> None:
        if self.tuned is None:
            self._tune(a, b, d, aux, bias)
        self._enqueue(self.heuristic, a, b, d, aux, bias)

    def _tune(self, a: Tensor, b: Tensor, d: Tensor, aux: Tensor, bias: Tensor | None) -> None:
        """Keep the fastest of cuBLASLt's candidates on these tensors (its first guess was
        22% slower on one of gpt-med's shapes), timed into scratch outputs. Not while a CUDA
        graph is being captured: there the first guess is taken, and timed later."""
        if len(self.candidates) == 1 or torch.cuda.is_current_stream_capturing():
            return
        remembered = _choices().get(self.name)
        if isinstance(remembered, int) and 0 <= remembered < len(self.candidates):
            self.tuned = remembered
            self.heuristic = self.candidates[remembered]
            return
        d, aux = torch.empty_like(d), aux if self.epilogue == _DGELU else torch.empty_like(aux)  # DGELU reads aux
        times = []
        for candidate in self.candidates:
            for _ in range(2):
                self._enqueue(candidate, a, b, d, aux, bias)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(_TIMED_RUNS):
                self._enqueue(candidate, a, b, d, aux, bias)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        self.tuned = min(range(len(times)), key=times.__getitem__)
        self.heuristic = self.candidates[self.tuned]
        _remember(self.name, self.tuned)

    def _enqueue(self, algo: _Heuristic, a: Tensor, b: Tensor, d: Tensor, aux: Tensor, bias: Tensor | None) -> None:
        workspace = torch.empty(max(int(algo.workspace), 1), dtype=torch.uint8, device=d.device)
        stream = ctypes.c_void_p(torch.cuda.current_stream(d.device).cuda_stream)
        with self.lock:  # the descriptor holds this call's pointers until it is enqueued
            if bias is not None:
                _set(self.lib, self.desc, _BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
            _set(self.lib, self.desc, _AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
            _check(
                self.lib.cublasLtMatmul(
                    self.handle, self.desc, ctypes.byref(self.alpha),
                    ctypes.c_void_p(a.data_ptr()), self.a, ctypes.c_void_p(b.data_ptr()), self.b,
                    ctypes.byref(self.beta), ctypes.c_void_p(d.data_ptr()), self.d,
                    ctypes.c_void_p(d.data_ptr()), self.d, ctypes.byref(algo.algo),
                    ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(workspace.numel()), stream,
                ),
                "cublasLtMatmul",
            )  # fmt: skip


_plans: dict[tuple, _Plan] = {}
_chosen: dict[str, int] | None = None


def _choices_path() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    version = _library().cublasLtGetVersion()
    gpu = torch.cuda.get_device_name().replace(" ", "-").replace("/", "-")
    return Path(cache_dir()) / "sgraph-cublaslt" / f"{gpu}-{version}.json"


def _choices() -> dict[str, int]:
    """The algorithm indices timed by earlier processes on this GPU and library."""
    global _chosen
    if _chosen is None:
        found = read_json(_choices_path())
        _chosen = found if isinstance(found, dict) else {}
    return _chosen


def _remember(name: str, index: int) -> None:
    choices = _choices()
    choices[name] = index
    write_atomically(_choices_path(), json.dumps(choices, sort_keys=True))


def _plan(device: int, key: tuple) -> _Plan:
    with _lock:
        plan = _plans.get(key + (device,))
    if plan is None:
        plan = _Plan(device, key)
        with _lock:
            _plans[key + (device,)] = plan
    return plan


def _ready(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is None:
            continue
        if not (t.is_cuda and t.is_contiguous() and t.dtype in _DTYPES and t.data_ptr() % _ALIGN == 0):
            raise Unsupported("cuBLASLt's GELU epilogues take contiguous, 16-byte aligned bf16 / fp16 CUDA tensors")
    if not available():
        raise Unsupported("cuBLASLt is not available")


def gelu_matmul(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(gelu_tanh(h), h)`` with ``h = x @ weight.T + bias``, in one cuBLASLt matmul.

    ``x [n, k]``, ``weight [m, k]``, ``bias [m]`` (or ``None``), one dtype. Raises
    :class:`Unsupported` where cuBLASLt does not take them.
    """
    _ready(x, weight, bias)
    (n, k), m = x.shape, weight.shape[0]
    if m % 8:
        raise Unsupported("the GELU input's leading dimension must be a multiple of 8")
    out = torch.empty(n, m, dtype=x.dtype, device=x.device)
    pre = torch.empty(n, m, dtype=x.dtype, device=x.device)
    epilogue = _GELU_AUX if bias is None else _GELU_AUX_BIAS
    key = (_DTYPES[x.dtype], _OP_T, (k, m), (k, n), (m, n), epilogue)
    _plan(x.device.index or 0, key).run(weight, x, out, pre, bias)
    return out, pre


def dgelu_matmul(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """``gelu_tanh'(pre) * (grad @ weight)`` in one cuBLASLt matmul.

    ``grad [n, k]``, ``weight [k, m]``, ``pre [n, m]``, one dtype. (cuBLASLt can also sum
    the bias gradient in this epilogue, ``DGELU_BGRAD``; on an H200 that made the matmul
    3.4 times as slow as a separate sum, so the sum is left to the caller.)
    """
    _ready(grad, weight, pre)
    (n, k), m = grad.shape, weight.shape[1]
    if m % 8:
        raise Unsupported("the GELU input's leading dimension must be a multiple of 8")
    out = torch.empty(n, m, dtype=grad.dtype, device=grad.device)
    key = (_DTYPES[grad.dtype], _OP_N, (m, k), (k, n), (m, n), _DGELU)
    _plan(grad.device.index or 0, key).run(weight, grad, out, pre, None)
    return out
