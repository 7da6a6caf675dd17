"""Torch's and Triton's source keys, remembered per installation.

Every key of Inductor's caches includes a hash of torch's source files (``torch_key``:
about 2,000 modules) and one of Triton's (``triton_key``, most of it the 400 MB
``libtriton.so``). A process computes both on its first compile, cache hit or not: on
the H200 machine 0.2 and 0.4 s of a warm first call, on the CPU 0.2 and 0.4 s as well.
On a GPU, loading generated Triton kernels asks for Triton's key once more, hashed with
the GPU backend's (``torch.utils._triton.triton_hash_with_backend``, cached for the
process): another 0.4 s of a warm first call on the H200 machine. And Triton asks for
its own key (cached by Triton for the process) at the first launch of each Triton kernel
it compiles or loads itself, such as sgraph's own kernels: a further 0.4 s there. That
one is computed by Triton's own function, in a thread started before the step is traced
(:func:`start_triton_key`): hashing reads files and runs SHA-256, both outside Python's
lock, so it takes little from the trace.

sgraph remembers the two keys in a small file next to its index, under a fingerprint of
the installation: the path, size and modification time of every file the two hashes
read (module files of torch's packages and two more; every file under Triton's folder),
with torch's version. That is the check Python itself makes before trusting a module's
cached bytecode. When the fingerprint has a file, its keys are handed to Inductor, which
then does not hash (the backend's hash is taken from the remembered key too, where the
process already uses the GPU); a file changed, added or removed changes the fingerprint and the
keys are computed afresh, then remembered.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .cache_files import file_stats, read_json, write_atomically

__all__ = ["remember_source_keys", "start_triton_key"]

_FOLDER = "sgraph-source-keys"  # inside Inductor's cache directory
_SUFFIXES = tuple(importlib.machinery.all_suffixes())
_INITS = frozenset(f"__init__{suffix}" for suffix in _SUFFIXES)
_TORCH_EXTRA = ("_inductor/codegen/aoti_runtime/interface.cpp", "_inductor/script.ld")  # torch_key reads them too
_looked = False  # this process has looked for remembered keys
_missing: Path | None = None  # where to write them down, when none were found


def remember_source_keys(*, compute: bool = True) -> bool:
    """Hand Inductor the source keys remembered for this installation; once per process,
    before anything of Inductor's asks for them (starting its compile workers does).
    Whether remembered keys were handed over.

    Args:
        compute: where none were remembered, compute both now and write them down
            (Inductor is about to compute them anyway). Without it nothing is hashed
            here: starting the compile workers computes torch's key itself, unhindered,
            and the first call with ``compute`` writes both down.

    Returns:
        True if both keys came from the file (nothing was hashed); False where they
        were computed, where this torch offers no way to hand them over, and where
        Inductor's caches are forced off (nothing is read or written then).

    Example:
        >>> remember_source_keys(compute=False)  # then maybe_warm_pool()
        >>> remember_source_keys()  # before Inductor's cache key
    """
    global _looked, _missing
    if not _looked:
        _looked = True
        found = _inductor()
        if found is None:
            return False
        cache_dir, hand = found
        path = Path(cache_dir) / _FOLDER / _fingerprint()
        remembered = _read(path)
        if remembered is not None:
            return hand(remembered)
        _missing = path
    if compute and _missing is not None:
        path, _missing = _missing, None
        write_atomically(path, json.dumps(_computed()))  # unwritable: the next process hashes
    return False


def start_triton_key() -> threading.Thread | None:
    """Start Triton's own key (its hash of its files, kept by Triton for the process)
    in a thread, unless Triton has it already; the thread, or None where nothing started.
    Called before a GPU step is traced, so that the first launch of a Triton kernel
    Triton itself compiles or loads finds the key kept. Triton's function computes it, so
    the key is Triton's own; a call racing the thread computes it once more, as today."""
    try:
        from triton.runtime import cache
    except ImportError:
        return None
    compute = getattr(cache, "triton_key", None)
    if compute is None or not hasattr(compute, "cache_info") or compute.cache_info().currsize:
        return None

    def run() -> None:
        with contextlib.suppress(Exception):  # only a head start: Triton computes (or reports) it when it needs it
            compute()

    thread = threading.Thread(target=run, name="sgraph-triton-key", daemon=True)
    thread.start()
    return thread


def _inductor() -> tuple[str, Callable[[dict], bool]] | None:
    """Inductor's cache directory and a function handing it keys; None where this
    torch has no way to take them, or its caches are forced off."""
    try:
        from torch._inductor import codecache
        from torch._inductor import config as inductor_config
        from torch._inductor.runtime import triton_compat
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    if not hasattr(codecache.torch_key, "set") or not hasattr(codecache, "CacheBase"):
        return None
    if inductor_config.force_disable_caches:
        return None

    def hand(keys: dict) -> bool:
        with contextlib.suppress(AssertionError, RuntimeError):  # already computed in this process
            codecache.torch_key.set(bytes.fromhex(keys["torch"]))  # type: ignore[attr-defined]
        if getattr(triton_compat, "HAS_TRITON", False) and keys["triton"] is not None:
            with _triton_key_as(keys["triton"]):
                codecache.CacheBase.get_system()  # caches the system info, Triton's key in it
                _backend_hash()
        return True

    return cache_dir(), hand


@contextlib.contextmanager
def _triton_key_as(key: str) -> Iterator[None]:
    """Triton's key function answering ``key`` while inside, wherever torch imports it
    by name as it computes: from ``triton_compat`` (torch 2.11, 2.13), from Triton's
    modules in older versions."""
    from torch._inductor.runtime import triton_compat

    names = ("triton.compiler.compiler", "triton.runtime.cache")
    modules = [triton_compat, *(m for m in map(sys.modules.get, names) if m is not None)]
    real = [(m, m.triton_key) for m in modules if hasattr(m, "triton_key")]
    for module, _ in real:
        module.triton_key = lambda: key  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, function in real:
            module.triton_key = function  # type: ignore[attr-defined]


def _backend_hash() -> None:
    """Have torch compute (and keep for the process) its hash of Triton's key with the
    GPU backend's, inside :func:`_triton_key_as`, so that loading Triton kernels does not
    hash Triton's files again. Only where the process already uses the GPU: the backend's
    hash asks Triton's driver for the current device, which would otherwise start CUDA."""
    if not _gpu_in_use():
        return
    try:
        from torch.utils import _triton
    except ImportError:
        return
    compute = getattr(_triton, "triton_hash_with_backend", None)
    if compute is None or not hasattr(compute, "cache_info"):  # not cached: nothing to keep
        return
    with contextlib.suppress(RuntimeError, ImportError):  # no active GPU driver: computed later, as before
        compute()


def _gpu_in_use() -> bool:
    return torch.cuda.is_initialized()


def _computed() -> dict:
    """Both keys computed the way Inductor computes them."""
    from torch._inductor import codecache
    from torch._inductor.runtime import triton_compat

    triton = triton_compat.triton_key() if getattr(triton_compat, "HAS_TRITON", False) else None
    return {"torch": codecache.torch_key().hex(), "triton": triton}


def _fingerprint() -> str:
    """The installation's fingerprint: versions, then path, size and modification time
    of each file the keys read."""
    hasher = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    torch_root = os.path.dirname(torch.__file__)
    listed = _listing(torch_root, packages_only=True)
    listed += file_stats(os.path.join(torch_root, extra) for extra in _TORCH_EXTRA)
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):  # a triton module without a spec: none installed as a package
        spec = None
    if spec is not None and spec.origin:
        listed += _listing(os.path.dirname(spec.origin), packages_only=False)
    hasher.update("\n".join(sorted(listed)).encode())
    return hasher.hexdigest()


def _listing(root: str, *, packages_only: bool) -> list[str]:
    """One line per file under ``root``: its path, size and modification time. With
    ``packages_only``, module files of the folders pkgutil walks (``root`` and the
    packages under it); otherwise every file."""
    lines, folders, seen = [], [root], set()
    while folders:
        folder = folders.pop()
        real = os.path.realpath(folder)
        if real in seen:
            continue
        seen.add(real)
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        if packages_only and folder != root and _INITS.isdisjoint(e.name for e in entries):
            continue
        for e in entries:
            if e.name == "__pycache__":
                continue
            if e.is_dir():
                folders.append(e.path)
            elif not packages_only or e.name.endswith(_SUFFIXES):
                lines += file_stats([e.path])
    return lines


def _read(path: Path) -> dict | None:
    keys = read_json(path)
    if not isinstance(keys, dict) or not isinstance(keys.get("torch"), str):
        return None
    try:
        bytes.fromhex(keys["torch"])
    except ValueError:
        return None
    return keys if keys.get("triton") is None or isinstance(keys["triton"], str) else None
