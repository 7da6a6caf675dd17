"""What the own Triton kernels share: whether Triton is installed, and the check that
lets a kernel run on CPU tensors only in Triton's interpreter."""

from __future__ import annotations

import functools
import os

__all__ = ["require_interpreter", "triton_available"]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def require_interpreter(kernel: str, instead: str = "") -> None:
    """Raise unless this process runs Triton in its interpreter, which a kernel on CPU
    tensors needs (``TRITON_INTERPRET=1``, set before Triton is imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{kernel} runs on CPU tensors only in Triton's interpreter: start the process with "
            f"TRITON_INTERPRET=1{instead}."
        )
