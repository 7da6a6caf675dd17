"""Where a cold first call's compile goes: one fresh process, empty caches, Inductor's stages timed.

    python examples/compile_split.py                                  # gpt-med, sg.fuse's defaults
    python examples/compile_split.py gpt-med '{"combo_kernels": false}' '{"reuse_blocks": false}'
    python examples/compile_split.py cpu                              # first_call_cpu.py's GPT, on the CPU

Arguments: the workload (see benchmark.py; ``cpu``: the 12-layer GPT of tiny widths of
first_call_cpu.py, on the CPU, its first call only), Inductor settings to patch on top of
sgraph's while it compiles (JSON), and ``sg.fuse`` options (JSON). The process starts
with its own empty Inductor and Triton caches, wraps the stages of torch's compile
(sgraph's own retrace below AOTAutograd, or AOTAutograd's where the step goes
through ``compile_fx``; Inductor's lowering, scheduling, code generation, the wait for
the kernel compiles, the first run's timing of kernel configurations) in timers, runs
benchmark.py's measurement of ``sg.static(sg.fuse(step))`` and prints one JSON line:
the first call and its splits (``Compiled.stats``), ms per step, and seconds per stage
(nested stages are inside their parents; a stage this torch does not have is named
on stderr and left out). No profiler runs, so the seconds are the real ones.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

SPENT: dict[str, float] = collections.defaultdict(float)
DEPTH: collections.Counter[str] = collections.Counter()

# (module, function or Class.method, label): the stages timed, outermost first.
STAGES = [
    ("torch._inductor.compile_fx", "compile_fx", "compile_fx, all of it"),
    ("sgraph._src.runtime.inductor_direct", "compile_direct", "below AOTAutograd, all of it"),
    ("sgraph._src.runtime.inductor_direct", "_index_key", "below AOTAutograd: index key"),
    ("sgraph._src.runtime.inductor_direct", "_load", "below AOTAutograd: load through the index"),
    ("sgraph._src.runtime.inductor_direct", "_decomposed", "below AOTAutograd: retrace with decompositions"),
    ("torch._inductor.compile_fx", "compile_fx_inner", "below AOTAutograd: compile_fx_inner"),
    ("torch._functorch._aot_autograd.autograd_cache", "autograd_cache_key", "AOTAutograd: cache key"),
    ("torch._functorch.aot_autograd", "create_aot_state", "AOTAutograd: metadata trace"),
    ("torch._functorch._aot_autograd.graph_compile", "aot_stage1_graph_capture", "AOTAutograd: retrace"),
    ("torch._functorch._aot_autograd.graph_compile", "aot_stage2_compile", "AOTAutograd: inner compile"),
    ("torch._inductor.fx_passes.joint_graph", "joint_graph_passes", "Inductor: joint-graph passes"),
    ("torch._inductor.compile_fx", "fx_codegen_and_compile", "Inductor: passes, lowering, code (cache miss)"),
    ("torch._inductor.fx_passes.post_grad", "post_grad_passes", "Inductor: post-grad passes"),
    ("torch._inductor.graph", "GraphLowering.run", "Inductor: lowering"),
    ("torch._inductor.graph", "GraphLowering.compile_to_module", "Inductor: code generation and load"),
    ("torch._inductor.scheduler", "Scheduler.__init__", "Inductor: scheduling (fusion)"),
    ("torch._inductor.async_compile", "AsyncCompile.wait", "Inductor: wait for kernel compiles"),
    ("torch._inductor.runtime.triton_heuristics", "CachingAutotuner.benchmark_all_configs", "first run: timing"),
]


def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        DEPTH[label] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            DEPTH[label] -= 1
            if DEPTH[label] == 0:  # a stage that calls itself counts once
                SPENT[label] += time.perf_counter() - start

    return inner


def wrap(module_name: str, name: str, label: str) -> None:
    """Time ``module_name.name``; a module-level function is replaced wherever a loaded
    module holds it by name."""
    module = importlib.import_module(module_name)
    if "." in name:
        owner_name, attr = name.split(".")
        owner = getattr(module, owner_name, None)
        raw = None if owner is None else owner.__dict__.get(attr)
        if raw is None:
            print(f"not in this torch: {module_name}.{name}", file=sys.stderr)
            return
        kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
        function = raw.__func__ if kind is not None else raw
        setattr(owner, attr, kind(timed(label, function)) if kind is not None else timed(label, function))
        return
    original = getattr(module, name, None)
    if original is None:
        print(f"not in this torch: {module_name}.{name}", file=sys.stderr)
        return
    replacement = timed(label, original)
    for loaded in list(sys.modules.values()):
        with contextlib.suppress(Exception):
            if getattr(loaded, name, None) is original:
                setattr(loaded, name, replacement)


def main() -> None:
    workload = sys.argv[1] if len(sys.argv) > 1 else "gpt-med"
    patches = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    fuse_options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    scratch = tempfile.mkdtemp(prefix="sgraph-compile-split-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{scratch}/inductor"
    os.environ["TRITON_CACHE_DIR"] = f"{scratch}/triton"

    import torch
    from torch._inductor import config

    import sgraph._src.runtime.inductor as inductor

    for stage in STAGES:
        wrap(*stage)
    sgraph_settings = inductor.inductor_config

    @contextlib.contextmanager
    def with_patches(options: Any) -> Any:
        with sgraph_settings(options), config.patch(patches):
            yield

    inductor.inductor_config = with_patches  # type: ignore[assignment]
    if workload == "cpu":
        import first_call_cpu

        result = first_call_cpu.first_call(fuse_options)
        device = "CPU"
    else:
        import benchmark as bm

        if not torch.cuda.is_available():
            raise SystemExit("compile_split.py runs benchmark.py's GPU workloads and needs a GPU (or: cpu).")
        result = bm.measure(lambda w: bm.variant_sg_static(w, fuse=True, fuse_options=fuse_options), workload, 10)
        device = torch.cuda.get_device_name()
    keys = ("first_s", "trace_s", "compile_s", "capture_s", "ms", "peak_mib", "kernels", "entry")
    line = {"workload": workload, "patches": patches, "fuse": fuse_options, **{k: result.get(k) for k in keys}}
    line["stages_s"] = {label: round(SPENT[label], 2) for _, _, label in STAGES if label in SPENT}
    line.update(torch=torch.__version__, device=device, date=time.strftime("%Y-%m-%d"))
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
