"""Short text forms of tensors for listings and messages."""

from __future__ import annotations

import torch

__all__ = ["describe_tensor", "short_dtype"]


def describe_tensor(dtype: torch.dtype | None, shape: tuple[int, ...], device: torch.device | None = None) -> str:
    """``f32[64, 1024]`` (with ``@cuda:0`` when not on the CPU)."""
    text = f"{short_dtype(dtype)}{list(shape)}"
    return text if device is None or device.type == "cpu" else f"{text}@{device}"


def short_dtype(dtype: torch.dtype | None) -> str:
    """``f32``, ``bf16``, ``i64``...: a dtype as listings write it."""
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


_DTYPE_SHORT: dict[torch.dtype | None, str] = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
