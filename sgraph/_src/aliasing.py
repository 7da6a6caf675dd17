"""Inputs that share memory with a donated input, checked on every call.

A donated input's memory receives the step's new values. Another input that
overlaps it (the same tensor under a second key, a view, an overlapping slice)
would see those writes, which eager PyTorch never does. On every call the inputs'
byte ranges are compared, cheaply (data pointers only; the ranges' lengths are
fixed by the signature, and unchanged pointers need no new check):

- an input that is not donated but overlaps a donated one is copied for this call,
  so the step reads what eager would; unless the step writes into that donated
  input in place, which the other input would see in eager: that raises;
- two donated inputs that overlap raise: each would receive its own new value in
  the same memory;
- a tensor the step closes over (a constant of the graph) that overlaps a donated
  input raises: the step reads it while the donated memory receives new values.

Each error names the argument paths (and the line reading the constant).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from .errors import ArgumentError

__all__ = ["AliasGuard", "copy_exactly", "extent", "overlapping_pairs", "tensor_extent"]


class AliasGuard:
    """Checks one compiled step's tensor inputs against its donated inputs.

    Args:
        name: the step, for messages (``sg.static(train_step)``).
        paths: each tensor input's path.
        extents: each tensor input's bytes from its first element to past its last
            (fixed by the signature: shape, strides, dtype), see :func:`extent`; None
            where the signature does not fix it (a DTensor's local shard, whose
            layout it does not record): read from the tensor on every call.
        donated: positions of donated inputs.
        written: donated positions the step writes in place.
        constants: the tensors the step closes over, each with a description for
            messages (its shape and the line that reads it).
    """

    def __init__(
        self,
        name: str,
        paths: Sequence[str],
        extents: Sequence[int | None],
        donated: frozenset[int],
        written: frozenset[int],
        constants: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        self.constants = [(what, t) for what, t in constants if tensor_extent(t)]
        self.name = name
        self.paths = list(paths)
        self.donated = sorted(donated)
        self.is_donated = [i in donated for i in range(len(extents))]
        self.written = written
        self.extent = [e or 0 for e in extents]
        self._read = [i for i, e in enumerate(extents) if e is None]  # positions read per call
        # The last accepted addresses with their donated ranges (starts and ends, sorted),
        # swapped as one tuple so that concurrent calls never read one call's addresses
        # with another's ranges.
        self._known: tuple[list[int], list[int], list[int]] | None = None

    def prepare(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The inputs to run on: ``tensors`` itself, or with aliasing inputs copied.

        Raises:
            ArgumentError: two donated inputs overlap, or an input overlaps a
                donated input the step writes in place.
        """
        if not self.donated:
            return tensors
        ptrs = list(map(_data_ptr, tensors))
        extents = self.extent
        if self._read:
            extents = list(extents)
            for i in self._read:
                extents[i] = tensor_extent(tensors[i])
        key = ptrs + [extents[i] for i in self._read] if self._read else ptrs  # a changed extent: a changed key
        known = self._known
        if known is not None:
            ok, starts, ends = known
            if key == ok:
                return tensors
            n = len(ptrs)
            changed = [i for i in range(n) if ptrs[i] != ok[i]]
            if (
                key[n:] == ok[n:]  # the extents are the ones the donated ranges were taken with
                and not any(self.is_donated[i] for i in changed)
                and not self._overlapping(ptrs, extents, changed, starts, ends)
            ):
                self._known = (key, starts, ends)
                return tensors
        copies = self._full_check(ptrs, extents)
        if not copies:
            self._remember(key, ptrs, extents)
            return tensors
        out = list(tensors)
        for i in copies:
            out[i] = copy_exactly(out[i])
        return out

    def _overlapping(
        self, ptrs: list[int], extents: list[int], positions: list[int], starts: list[int], ends: list[int]
    ) -> bool:
        """Whether any of ``positions`` overlaps a donated range (``starts``/``ends``:
        the donated inputs', which are unchanged)."""
        for i in positions:
            start, size = ptrs[i], extents[i]
            if not size:
                continue
            k = bisect.bisect_left(starts, start + size) - 1
            if k >= 0 and ends[k] > start:
                return True
        return False

    def _remember(self, key: list[int], ptrs: list[int], extents: list[int]) -> None:
        ranges = sorted((ptrs[i], ptrs[i] + extents[i]) for i in self.donated if extents[i])
        self._known = (key, [s for s, _ in ranges], [e for _, e in ranges])

    def _full_check(self, ptrs: list[int], extents: list[int]) -> list[int]:
        """Positions of non-donated inputs to copy; raises for overlaps it cannot undo."""
        copies = []
        n = len(ptrs)  # positions from n on are the constants
        starts = ptrs + [t.data_ptr() for _, t in self.constants]
        sizes = extents + [tensor_extent(t) for _, t in self.constants]
        donated_at = self.is_donated + [False] * len(self.constants)
        for a, b in overlapping_pairs(starts, sizes):
            if donated_at[a] and donated_at[b]:
                raise ArgumentError(self._both_donated(a, b))
            donated, other = (a, b) if donated_at[a] else (b, a)
            if not donated_at[donated]:
                continue  # neither is donated: nothing writes either
            if other >= n:
                raise ArgumentError(self._constant(donated, self.constants[other - n][0]))
            if donated in self.written:
                raise ArgumentError(self._written(donated, other))
            copies.append(other)
        return sorted(set(copies))

    def _constant(self, donated: int, what: str) -> str:
        return (
            f"{self.name}: the step closes over {what}, which shares memory with donated input "
            f"{self.paths[donated]}; the step would read it while that memory receives the new "
            f"values. Pass it in as an argument (it is then copied for the call), close over a "
            f".clone(), or do not donate {self.paths[donated]}."
        )

    def _both_donated(self, a: int, b: int) -> str:
        return (
            f"{self.name}: donated inputs {self.paths[a]} and {self.paths[b]} share memory (the same "
            "tensor, or overlapping views of one), so each would receive its new value in the same "
            "memory. Pass distinct tensors (clone one of them), or do not donate that argument."
        )

    def _written(self, donated: int, other: int) -> str:
        return (
            f"{self.name}: input {self.paths[other]} shares memory with donated input "
            f"{self.paths[donated]}, which the step writes in place; in eager PyTorch "
            f"{self.paths[other]} would see that write part-way through the step, which a compiled "
            "step cannot reproduce. Pass a copy (.clone()) of one of them, or do not donate "
            f"{self.paths[donated]}."
        )


_data_ptr = torch.Tensor.data_ptr


def extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from a tensor's first element to just past its last (0 when empty)."""
    if any(size == 0 for size in shape):
        return 0
    last = sum((size - 1) * stride for size, stride in zip(shape, strides))
    return (last + 1) * itemsize


def tensor_extent(t: torch.Tensor) -> int:
    """:func:`extent` of tensor ``t``."""
    return extent(t.shape, t.stride(), t.element_size())


def overlapping_pairs(ptrs: list[int], extent: list[int]) -> list[tuple[int, int]]:
    """Every pair of positions whose byte ranges overlap."""
    ranges = sorted((ptrs[i], ptrs[i] + extent[i], i) for i in range(len(ptrs)) if extent[i])
    pairs: list[tuple[int, int]] = []
    open_: list[tuple[int, int]] = []  # (end, position) of ranges that may still overlap
    for start, end, i in ranges:
        open_ = [(e, j) for e, j in open_ if e > start]
        pairs += [(j, i) for _, j in open_]
        open_.append((end, i))
    return pairs


def copy_exactly(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in new memory with the same shape and strides (even for
    overlapping or gapped views), so it matches the signature ``t`` matched."""
    copy = t.clone(memory_format=torch.preserve_format)
    if copy.stride() == t.stride():
        return copy
    span = tensor_extent(t) // t.element_size()
    raw = torch.as_strided(t, (span,), (1,)).clone()
    return raw.as_strided(t.shape, t.stride(), 0)
