"""Torch's and Triton's source keys remembered per installation (runtime/source_keys.py):
the fingerprint sees each change a hash would, remembered keys are the computed ones,
and Inductor is handed exactly what the file holds."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from torch._inductor import codecache
from torch._inductor.runtime import triton_compat

from sgraph._src.runtime import source_keys


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """As in a new process: nothing handed yet, neither key computed; afterwards the
    real keys are computed again when next needed."""
    monkeypatch.setattr(source_keys, "_looked", False)
    monkeypatch.setattr(source_keys, "_missing", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    codecache.torch_key.clear()
    codecache.CacheBase.get_system.cache_clear()
    if hasattr(codecache, "triton_key"):  # torch >= 2.13 caches Triton's key here too
        codecache.triton_key.clear()
    yield
    codecache.torch_key.clear()
    codecache.CacheBase.get_system.cache_clear()
    if hasattr(codecache, "triton_key"):
        codecache.triton_key.clear()


def _package(root, *names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")
    return root


def _bump(path, size_change=False):
    if size_change:
        path.write_text(path.read_text() + "x = 1\n")
    else:  # same size, same content length: only the modification time says so
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _listing(root):
    return sorted(source_keys._listing(str(root), packages_only=True))


def test_the_listing_changes_with_each_module_file_the_hash_reads(tmp_path):
    root = _package(tmp_path / "pkg", "__init__.py", "a.py", "sub/__init__.py", "sub/b.py")
    before = _listing(root)
    _bump(root / "sub" / "b.py")
    assert _listing(root) != before
    changed = _listing(root)
    _bump(root / "a.py", size_change=True)
    assert _listing(root) != changed
    changed = _listing(root)
    _package(root, "sub/c.py")
    assert _listing(root) != changed
    changed = _listing(root)
    (root / "sub" / "c.py").unlink()
    assert _listing(root) != changed


def test_the_listing_ignores_what_no_hash_reads(tmp_path):
    root = _package(tmp_path / "pkg", "__init__.py", "a.py", "include/x.h", "data/notes.txt")
    before = _listing(root)
    _package(root, "__pycache__/a.cpython-311.pyc", "include/y.py", "data/z.py", "README.md")
    assert _listing(root) == before  # bytecode caches, folders that are no packages, non-modules
    _package(root, "data/__init__.py")  # now a package: its modules count
    assert _listing(root) != before


def test_a_miss_remembers_the_computed_keys(tmp_path, fresh_process):
    assert source_keys.remember_source_keys() is False
    (path,) = (tmp_path / "sgraph-source-keys").iterdir()
    keys = json.loads(path.read_text())
    assert bytes.fromhex(keys["torch"]) == codecache.torch_key()
    if triton_compat.HAS_TRITON:
        assert keys["triton"] == triton_compat.triton_key()
    assert source_keys.remember_source_keys() is False  # once per process


def test_a_hit_hands_inductor_the_remembered_keys(tmp_path, fresh_process, monkeypatch):
    folder = tmp_path / "sgraph-source-keys"
    folder.mkdir()
    (folder / source_keys._fingerprint()).write_text(json.dumps({"torch": "ab" * 32, "triton": "remembered"}))
    hashed = []
    monkeypatch.setattr(triton_compat, "triton_key", lambda: hashed.append(1) or "hashed")
    assert source_keys.remember_source_keys() is True
    assert codecache.torch_key() == bytes.fromhex("ab" * 32)
    system = codecache.CacheBase.get_system()
    if triton_compat.HAS_TRITON and torch.cuda.is_available():  # without a GPU the key is not kept
        assert system["version"]["triton"] == "remembered"
    if triton_compat.HAS_TRITON and hasattr(codecache, "triton_key"):
        assert codecache.triton_key() == "remembered"
    assert hashed == []
    assert triton_compat.triton_key() == "hashed"  # the function Inductor calls is as it was


class _Backend:
    def hash(self) -> str:
        return "backend"


@pytest.fixture
def backend_hash(monkeypatch):
    """torch's cached hash of Triton's key with the GPU backend's, fresh, over a stand-in
    backend (no GPU needed); cleared again afterwards."""
    if not triton_compat.HAS_TRITON:
        pytest.skip("needs Triton")
    from torch.utils import _triton

    monkeypatch.setattr(_triton, "triton_backend", _Backend)
    _triton.triton_hash_with_backend.cache_clear()
    yield _triton.triton_hash_with_backend
    _triton.triton_hash_with_backend.cache_clear()


def _remember(tmp_path, triton):
    folder = tmp_path / "sgraph-source-keys"
    folder.mkdir()
    (folder / source_keys._fingerprint()).write_text(json.dumps({"torch": "ab" * 32, "triton": triton}))


def test_on_a_gpu_the_backends_hash_is_made_from_the_remembered_key(tmp_path, fresh_process, backend_hash, monkeypatch):
    _remember(tmp_path, "remembered")
    hashed = []
    monkeypatch.setattr(triton_compat, "triton_key", lambda: hashed.append(1) or "hashed")
    monkeypatch.setattr(source_keys, "_gpu_in_use", lambda: True)
    assert source_keys.remember_source_keys() is True
    assert backend_hash.cache_info().currsize == 1  # computed, and kept for the process
    assert backend_hash() == hashlib.sha256(b"remembered-backend").hexdigest().upper()
    assert hashed == []
    assert triton_compat.triton_key() == "hashed"  # the function torch calls is as it was


def test_without_the_gpu_in_use_the_backends_hash_is_left_for_later(tmp_path, fresh_process, backend_hash, monkeypatch):
    _remember(tmp_path, "remembered")
    monkeypatch.setattr(source_keys, "_gpu_in_use", lambda: False)
    assert source_keys.remember_source_keys() is True
    assert backend_hash.cache_info().currsize == 0  # nothing asked Triton's driver for a device


UNREADABLE = ["not json", "[1]", '{"torch": "zz", "triton": null}', '{"torch": "ab", "triton": 3}']


@pytest.mark.parametrize("content", UNREADABLE)
def test_an_unreadable_file_is_computed_again_and_replaced(tmp_path, fresh_process, content):
    folder = tmp_path / "sgraph-source-keys"
    folder.mkdir()
    path = folder / source_keys._fingerprint()
    path.write_text(content)
    assert source_keys.remember_source_keys() is False
    assert bytes.fromhex(json.loads(path.read_text())["torch"]) == codecache.torch_key()


def test_a_key_already_computed_in_the_process_is_kept(tmp_path, fresh_process):
    computed = codecache.torch_key()
    folder = tmp_path / "sgraph-source-keys"
    folder.mkdir()
    (folder / source_keys._fingerprint()).write_text(json.dumps({"torch": "cd" * 32, "triton": None}))
    source_keys.remember_source_keys()
    assert codecache.torch_key() == computed


def test_the_fingerprint_names_torchs_version(monkeypatch):
    before = source_keys._fingerprint()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert source_keys._fingerprint() != before


def test_the_keys_are_handed_before_the_compile_workers_start(tmp_path, fresh_process, monkeypatch):
    from torch._inductor import async_compile

    from sgraph._src.runtime.workers import start_compile_workers

    folder = tmp_path / "sgraph-source-keys"
    folder.mkdir()
    (folder / source_keys._fingerprint()).write_text(json.dumps({"torch": "ab" * 32, "triton": None}))
    seen = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: seen.append(codecache.torch_key()))
    assert start_compile_workers([torch.device("cuda", 0)])
    assert seen == [bytes.fromhex("ab" * 32)]


def test_before_the_workers_start_a_miss_hashes_nothing_and_the_compile_writes_the_keys_down(
    tmp_path, fresh_process, monkeypatch
):
    hashed = []
    real = triton_compat.triton_key
    monkeypatch.setattr(triton_compat, "triton_key", lambda: hashed.append(1) or real())
    assert source_keys.remember_source_keys(compute=False) is False
    assert hashed == [] and not (tmp_path / "sgraph-source-keys").exists()
    assert source_keys.remember_source_keys() is False  # what Inductor's cache key calls first
    (path,) = (tmp_path / "sgraph-source-keys").iterdir()
    assert bytes.fromhex(json.loads(path.read_text())["torch"]) == codecache.torch_key()
    assert hashed == ([1] if triton_compat.HAS_TRITON else [])


def test_tritons_own_key_is_computed_by_triton_in_a_thread():
    cache = pytest.importorskip("triton.runtime.cache")
    expected = cache.triton_key()
    cache.triton_key.cache_clear()
    thread = source_keys.start_triton_key()
    assert thread is not None
    thread.join(timeout=120)
    assert cache.triton_key.cache_info().currsize == 1  # kept by Triton's own cache
    hits = cache.triton_key.cache_info().hits
    assert cache.triton_key() == expected
    assert cache.triton_key.cache_info().hits == hits + 1  # not hashed again
    assert source_keys.start_triton_key() is None  # already kept: nothing started


def test_the_compile_workers_start_tritons_key_for_a_gpu_step_only(fresh_process, monkeypatch):
    from torch._inductor import async_compile

    from sgraph._src.runtime import workers

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: None)
    monkeypatch.setattr(workers, "start_triton_key", lambda: started.append(True))
    workers.start_compile_workers([torch.device("cpu")])
    assert started == []
    workers.start_compile_workers([torch.device("cuda", 0)])
    assert started == [True]
