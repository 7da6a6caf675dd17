"""The C++ backend's instruction-set checks, remembered per installation
(sgraph/_src/runtime/vec_isa.py). Each check runs in a fresh process: Inductor keeps
its answers for the life of a process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux only")

CHILD = """
import json, subprocess, sys
spawned = []
if sys.argv[1] == "forbid":  # a remembered answer must not spawn Inductor's probes (Pythons loading a library)
    def guarded(run):
        def call(command, *args, **kwargs):
            if isinstance(command, (list, tuple)) and command and command[0] == sys.executable:
                spawned.append(command)
                raise AssertionError("a probe process was spawned")
            return run(command, *args, **kwargs)
        return call
    subprocess.run, subprocess.check_call = guarded(subprocess.run), guarded(subprocess.check_call)
from torch._inductor import config, cpu_vec_isa
if sys.argv[2] == "decided":
    config.cpp.vec_isa_ok = True
from sgraph._src.runtime.vec_isa import remember_vec_isa
remember_vec_isa()
print(json.dumps({"valid": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()], "spawned": len(spawned)}))
"""


def _child(cache: Path, mode: str, decided: str = "undecided") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), mode, decided], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _remembered(cache: Path) -> list[Path]:
    return sorted((cache / "sgraph-vec-isa").glob("*"))


def test_a_second_process_gets_the_checks_answers_without_running_them(tmp_path):
    first = _child(tmp_path, "allow")
    (path,) = _remembered(tmp_path)
    answers = json.loads(path.read_text())
    assert [name for name, ok in answers.items() if ok] == first["valid"]
    second = _child(tmp_path, "forbid")
    assert second == {"valid": first["valid"], "spawned": 0}


def test_a_corrupt_file_is_checked_again_and_replaced(tmp_path):
    first = _child(tmp_path, "allow")
    (path,) = _remembered(tmp_path)
    path.write_text("{not json")
    assert _child(tmp_path, "allow") == first
    assert json.loads(path.read_text())  # rewritten
    path.write_text(json.dumps({"avx9000": True}))  # answers for other instruction sets
    assert _child(tmp_path, "allow") == first


def test_nothing_is_remembered_where_the_user_decides(tmp_path):
    assert _child(tmp_path, "allow", "decided")["spawned"] == 0
    assert not _remembered(tmp_path)


def test_the_fingerprint_follows_the_compiler_and_the_flags(tmp_path, monkeypatch):
    from sgraph._src.runtime import vec_isa

    compiler = tmp_path / "g++"
    compiler.write_text("1")
    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", lambda: str(compiler))
    before = vec_isa._fingerprint(["avx2"])
    assert vec_isa._fingerprint(["avx2"]) == before
    assert vec_isa._fingerprint(["avx2", "avx512"]) != before
    compiler.write_text("22")  # another compiler at the same path
    assert vec_isa._fingerprint(["avx2"]) != before
