"""Remember which SIMD instruction sets Inductor's C++ code may use on this machine.

Before its first C++ compile in a process, Inductor checks each instruction set the
CPU reports (AVX-512 with VNNI, AVX-512, AVX2) by building a small library with it
and loading that in a fresh Python subprocess: about 1.4 s of every process's first
compile on the CI machine, cache hit or not. The answer depends only on the machine,
the C++ compiler and torch, so sgraph remembers it per installation, in
``<Inductor cache>/sgraph-vec-isa/<fingerprint>``, and hands it over before a CPU step's
first compile: each instruction set's check is answered from the file, and Inductor
keeps the answers for the process as if it had checked itself.

The fingerprint hashes torch's version and the path, size and modification time of
``libtorch_cpu`` (whose vector functions the library links), of the Python that
loads it and of the compiler, with the CPU's flags: a change of any makes the next
process check again. x86-64 Linux only (elsewhere Inductor checks as before); nothing
when Inductor's caches are off or ``torch._inductor.config.cpp.vec_isa_ok`` decides.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .cache_files import file_stats, read_json, write_atomically

__all__ = ["remember_vec_isa"]

_FOLDER = "sgraph-vec-isa"


@functools.cache
def remember_vec_isa() -> None:
    """Hand Inductor the remembered answers of its instruction-set checks, or make the
    checks now and remember them (once per process).

    Example:
        >>> remember_vec_isa()  # before a CPU step's first compile
    """
    try:
        from torch._inductor import config
        from torch._inductor import cpu_vec_isa as isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return
    if sys.platform != "linux" or platform.machine() != "x86_64" or not hasattr(isa.VecISA, "check_build"):
        return
    if config.cpp.vec_isa_ok is not None or config.force_disable_caches or config.is_fbcode():
        return
    flags = set(isa.x86_isa_checker())
    checked = [i for i in isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
    path = Path(cache_dir()) / _FOLDER / _fingerprint(sorted(flags))
    known = _read(path)
    if known is not None and set(known) == {str(i) for i in checked}:
        _hand_over(isa, checked, known)
        return
    valid = {str(i) for i in isa.valid_vec_isa_list()}  # Inductor checks, as it would have
    write_atomically(path, json.dumps({str(i): str(i) in valid for i in checked}))  # unwritable: checked again


def _hand_over(isa: Any, checked: list[Any], known: dict[str, bool]) -> None:
    """Answer each instruction set's check from ``known``: Inductor caches each answer
    per instruction set for the process (``VecISA.__bool__``), so no check runs later."""
    original = isa.VecISA.check_build
    isa.VecISA.check_build = lambda self, code: bool(known[str(self)])
    try:
        for each in checked:
            bool(each)
    finally:
        isa.VecISA.check_build = original


def _fingerprint(flags: list[str]) -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    parts = [torch.__version__, *flags, *file_stats([str(lib), sys.executable, compiler])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read(path: Path) -> dict[str, bool] | None:
    found = read_json(path)
    ok = isinstance(found, dict) and all(isinstance(v, bool) for v in found.values())
    return found if ok else None
