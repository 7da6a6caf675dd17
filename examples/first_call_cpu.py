"""A step's first call on the CPU, each in a fresh process with warm caches.

    python examples/first_call_cpu.py              # 1 process to fill the caches, then 3 timed
    python examples/first_call_cpu.py --runs 5

The step is ``sg.static(sg.fuse(step))`` over a GPT with gpt-med's depth (12 layers)
and tiny widths, so that tracing, the passes and the cache lookups weigh as they do
for gpt-med while the generated C++ stays cheap to build. The first process fills
Inductor's caches in a directory of its own (that one compiles: minutes on 2 cores);
each timed process then makes the first call with those caches warm. Per process:
the first call's seconds, its trace and compile splits (``Compiled.stats``), and the
full garbage collections that ran during it with their seconds (``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "--child"


def first_call(fuse_options: dict | None = None) -> dict:
    """One first call in this process: seconds, its splits, and the full collections in it."""
    import torch
    from models import GPT, GPTConfig, gpt_loss

    import sgraph as sg

    cfg = GPTConfig(vocab=512, d=64, layers=12, heads=4, seq=32)
    torch.manual_seed(0)
    apply, params, buffers = sg.functional(GPT(cfg))
    opt = sg.optim.adamw(3e-4, weight_decay=0.01)
    x, y = (torch.randint(0, cfg.vocab, (2, cfg.seq)) for _ in range(2))

    def loss_fn(params, batch):
        x, y = batch
        return gpt_loss(apply(params, buffers, x), y)

    def step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    train_step = sg.static(sg.fuse(**(fuse_options or {}))(step), donate=("params", "opt_state"))
    full: list[float] = []
    began = [0.0]

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - began[0])

    opt_state = opt.init(params)
    gc.callbacks.append(watch)
    start = time.perf_counter()
    train_step(params, opt_state, (x, y))
    seconds = time.perf_counter() - start
    gc.callbacks.remove(watch)
    stats = train_step.last_compiled.stats
    return {
        "first_s": seconds,
        "trace_s": stats.trace_seconds,
        "compile_s": stats.compile_seconds,
        "full_collections": len(full),
        "full_collection_s": sum(full),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="timed processes after the one filling the caches")
    args = parser.parse_args()
    caches = tempfile.mkdtemp(prefix="sgraph-first-call-cpu-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=caches, CUDA_VISIBLE_DEVICES="")
    here = Path(__file__).resolve()
    rows = []
    for run in range(args.runs + 1):
        done = subprocess.run([sys.executable, str(here), CHILD], env=env, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(("cold, fills the caches" if run == 0 else f"warm {run}") + f": {json.dumps(row)}", flush=True)
        rows.append(row)
    import torch

    warm = rows[1:]
    print(f"\ntorch {torch.__version__}, CPU, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print("\n| warm first call s | trace s | compile s | full collections | their s |")
    print("|---|---|---|---|---|")
    keys = ("first_s", "trace_s", "compile_s", "full_collections", "full_collection_s")
    medians = [statistics.median(r[k] for r in warm) for k in keys]
    print("| " + " | ".join(f"{m:g}" if k == "full_collections" else f"{m:.2f}" for k, m in zip(keys, medians)) + " |")
    print("(medians over the warm processes)")


if __name__ == "__main__":
    if CHILD in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(json.dumps(first_call()))
    else:
        main()
