"""Inductor's Triton compile workers, started before the step is traced.

Inductor compiles each generated Triton kernel in a pool of worker processes, but only
once that pool has answered; until then it compiles them one by one in the calling
process. The pool takes seconds to start (each worker imports torch), and when the
first kernel asks for it the compile has already begun, so most of a cold compile's
kernels were built serially. ``torch.compile`` starts the pool as soon as its backend
is called; sgraph starts it on a fused CUDA step's first call, just before the step is
traced, so the workers come up while it is traced and its passes run (``.trace()``
alone, which compiles nothing, starts none). Triton's own key is started there too, in
a thread (:func:`~.source_keys.start_triton_key`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .source_keys import remember_source_keys, start_triton_key

__all__ = ["start_compile_workers"]


def start_compile_workers(devices: Iterable[torch.device]) -> bool:
    """Start Inductor's compile worker pool if any of ``devices`` is a CUDA device
    (Inductor compiles C++ for the CPU in threads: no pool then); whether it was asked
    to start. Inductor's own switches apply (``TORCH_WARM_POOL=0``,
    ``TORCHINDUCTOR_COMPILE_THREADS=1`` keep it from starting)."""
    if not any(device.type == "cuda" for device in devices):
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without Inductor's pool: it compiles as it always did
        return False
    remember_source_keys(compute=False)  # the pool's start hashes torch's sources unless handed the key
    start_triton_key()
    try:
        maybe_warm_pool()
    except Exception:  # noqa: BLE001 - only a head start: Inductor starts it (or reports why not) when it compiles
        return False
    return True
