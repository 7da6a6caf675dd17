"""Short text forms of tensors for listings and messages."""

from __future__ import annotations

import torch

__all__ = ["describe_tensor"]


def describe_tensor(dtype: torch.dtype | None, shape: tuple[int, ...], device: torch.device | None = None) -> str:
    """``f32[64, 1024]`` (with ``@cuda:0`` when not on the CPU)."""
    text = f"{_DTYPE_SHORT.get(dtype, str(dtype).replace('torch.', ''))}{list(shape)}"
    return text if device is None or device.type == "cpu" else f"{text}@{device}"


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
