"""A step's first call in fresh processes: with cold caches, then again with warm ones.

    python examples/first_call.py                                   # gpt-med: sg.fuse and torch.compile
    python examples/first_call.py --bytecode --json first-call.json
    python examples/first_call.py --workloads gpt-mini --variants sg-fuse sg-fuse-inline

For each variant and workload, one process runs benchmark.py's measurement with empty
Inductor and Triton caches ("cold"), then a second process runs it again sharing the
caches the first one left ("warm"). Each process runs that one workload only, so its
first call also pays for what torch imports and starts during the call (Dynamo,
Inductor, its compile workers); building the model is not counted. sgraph variants
also give their trace, Inductor and capture seconds (``Compiled.stats``).

Python's own bytecode cache matters here. A pip-installed torch comes with compiled
bytecode for its modules. Where there is none and none may be written
(``PYTHONDONTWRITEBYTECODE``, a read-only install), every fresh process compiles each
torch module it imports from source first: about 7 s per process on the H200 machine
of docs/performance.md. The script says which case it found. With ``--bytecode`` it
compiles torch's site-packages once into a cache of its own (``PYTHONPYCACHEPREFIX``),
before any timed process and untimed, as an install would; the standard library too,
whose own bytecode Python no longer reads once a prefix is set (until 2026-12-02 it
was left out: each process then compiled the 100 to 200 standard modules it imported).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.util import cache_from_source
from pathlib import Path

import torch
from benchmark import VARIANTS, WORKLOADS

HERE = Path(__file__).resolve().parent
SPLITS = ("trace_s", "compile_s", "capture_s")


def has_bytecode() -> bool:
    """Whether torch's modules have compiled bytecode this interpreter will find."""
    module = Path(torch.__file__).parent / "_inductor" / "compile_fx.py"
    return Path(cache_from_source(str(module))).exists()


def build_bytecode(prefix: str) -> float:
    """Compile the standard library, torch's site-packages, the ``PYTHONPATH`` entries and
    sgraph into the bytecode cache ``prefix`` (a prefix hides each folder's own
    ``__pycache__``, the standard library's included); the seconds it took."""
    start = time.perf_counter()
    dirs = [sysconfig.get_path("stdlib"), str(Path(torch.__file__).parent.parent), str(HERE.parent / "sgraph")]
    dirs += [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and Path(d).is_dir()]
    env = dict(os.environ, PYTHONPYCACHEPREFIX=prefix)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], env=env, capture_output=True)
    return time.perf_counter() - start


def one_process(variant: str, workload: str, caches: Path, env: dict[str, str]) -> dict | None:
    """benchmark.py's measurement of ``variant`` on ``workload`` in a new process."""
    out = caches / f"{variant}-{workload}-{time.monotonic_ns()}.json"
    child = dict(env, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    command = [sys.executable, str(HERE / "benchmark.py"), "--workloads", workload, "--variants", variant]
    done = subprocess.run([*command, "--json", str(out)], env=child, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"{variant} on {workload} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(out.read_text())["results"][variant][workload]


def cell(result: dict | None) -> str:
    if not result:
        return "-"
    splits = [result.get(key) for key in SPLITS]
    inner = f" ({', '.join(f'{s:.1f}' for s in splits)})" if all(s is not None for s in splits) else ""
    return f"{result['first_s']:.1f}{inner}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["gpt-med"], choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=["sg-fuse", "compile-ro"], choices=list(VARIANTS))
    parser.add_argument("--bytecode", action="store_true", help="compile torch's bytecode first (untimed)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("first_call.py runs benchmark.py's GPU workloads and needs a GPU.")
    env = dict(os.environ)
    scratch = Path(tempfile.mkdtemp(prefix="sgraph-first-call-"))
    found = has_bytecode()
    if found:
        bytecode = "found for torch's modules"
    elif args.bytecode:
        prefix = env.setdefault("PYTHONPYCACHEPREFIX", str(scratch / "bytecode"))
        bytecode = f"built for torch's modules in {build_bytecode(prefix):.0f} s (untimed), in {prefix}"
    else:
        bytecode = "none for torch's modules: each process compiles them from source (pass --bytecode)"
    print(f"Python bytecode: {bytecode}", flush=True)
    results: dict = {v: {} for v in args.variants}
    for workload in args.workloads:
        for variant in args.variants:
            caches = scratch / f"{variant}-{workload}"
            caches.mkdir()
            cold = one_process(variant, workload, caches, env)
            warm = one_process(variant, workload, caches, env)
            results[variant][workload] = {"cold": cold, "warm": warm}
            print(variant, workload, cell(cold), cell(warm), flush=True)
    device = torch.cuda.get_device_name()
    print(f"\ntorch {torch.__version__}, {device}, {time.strftime('%Y-%m-%d')}; Python bytecode {bytecode}")
    print("\n## first call in a fresh process, s: cold caches | warm caches (trace, Inductor, capture)\n")
    print("| variant | " + " | ".join(f"{w} cold | {w} warm" for w in args.workloads) + " |")
    print("|---|" + "---|---|" * len(args.workloads))
    for variant, cells in results.items():
        row = [f"{cell(c['cold'])} | {cell(c['warm'])}" for c in cells.values()]
        print(f"| {VARIANTS[variant][0]} | " + " | ".join(row) + " |")
    if args.json:
        meta = {"torch": torch.__version__, "gpu": device, "date": time.strftime("%Y-%m-%d"), "bytecode": bytecode}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
