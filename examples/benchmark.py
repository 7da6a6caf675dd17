"""Time sgraph against the usual ways to run a train step, in one run, on one GPU.

    python examples/benchmark.py --json bench.json                # all workloads, all variants
    python examples/benchmark.py --workloads mlp-small --variants eager sg-static
    python examples/benchmark.py --variants --host-overhead        # only the per-call host time

Workloads and method follow PERFORMANCE-ANCHORS: forward + loss + backward + AdamW,
bf16 autocast with fp32 master params, TF32 matmuls allowed; median of 50 steps
timed with CUDA events after 5 warm-up steps; "first" is the wall time of the first
call (compile and capture included, and a hand-made graph's warm-up and capture;
building the model and its batch, the same for every variant, is not counted); peak
is torch.cuda.max_memory_allocated less what was allocated before the variant was
built. For sgraph variants the memory table also gives the predicted peak against the
peak of the call that warmed up and captured the step (after compiling), from
``Compiled.stats``.

The host-overhead table times one call of an already-compiled sg.static step over a
params + momentum pytree of N small leaves on the host, without synchronizing, and
splits it into the runtime (graph replay with its input and output copies) and
sgraph's call path (flattening, signature and alias checks, output pytree).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from models import GPT, GPTConfig, Llama, LlamaConfig, gpt_loss, mlp, resnet

import sgraph as sg

WORKLOADS = {
    "mlp-small": ("mlp", None, 64),
    "gpt-mini": ("gpt", GPTConfig(vocab=8192, d=512, layers=6, heads=8, seq=256), 32),
    "gpt-med": ("gpt", GPTConfig(vocab=32768, d=1024, layers=12, heads=16, seq=1024), 16),
    # Two models of other shapes, outside PERFORMANCE-ANCHORS: RMSNorm, rotary embeddings and
    # SwiGLU (no own kernel matches the MLP); convolutions with BatchNorm's running statistics.
    "llama-mini": ("llama", LlamaConfig(vocab=8192, d=512, layers=6, heads=8, seq=256, hidden=1408), 32),
    "resnet-small": ("resnet", None, 128),
}
ANCHORED = ["mlp-small", "gpt-mini", "gpt-med"]
"""The workloads of PERFORMANCE-ANCHORS and of sg.fuse's targets: the scripts' default."""
LR, WEIGHT_DECAY = 3e-4, 0.01


BUILD_SECONDS = [0.0]  # time spent building models: not part of any variant's first call


def mlp_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def build(workload: str):
    """The model (on the GPU), one fixed batch, and the loss on fp32 logits."""
    start = time.perf_counter()
    kind, cfg, batch = WORKLOADS[workload]
    torch.manual_seed(0)
    if kind == "mlp":
        model = mlp(1024, 4, 10).cuda()
        x = torch.randn(batch, 1024, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        loss = mlp_loss
    elif kind == "resnet":
        model = resnet().cuda()
        x = torch.randn(batch, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        loss = mlp_loss
    else:
        model = (Llama if kind == "llama" else GPT)(cfg).cuda()
        x = torch.randint(0, cfg.vocab, (batch, cfg.seq), device="cuda")
        y = torch.randint(0, cfg.vocab, (batch, cfg.seq), device="cuda")
        loss = gpt_loss
    torch.cuda.synchronize()
    BUILD_SECONDS[0] += time.perf_counter() - start
    return model, (x, y), loss


def autocast():
    return torch.autocast("cuda", dtype=torch.bfloat16)


def eager_step(model, batch, loss, opt) -> Callable[[], None]:
    x, y = batch

    def run() -> None:
        with autocast():
            value = loss(model(x), y)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def variant_eager(workload: str) -> Callable[[], None]:
    model, batch, loss = build(workload)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return eager_step(model, batch, loss, opt)


def variant_compile(workload: str, mode: str | None = None) -> Callable[[], None]:
    model, batch, loss = build(workload)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return eager_step(torch.compile(model, mode=mode), batch, loss, opt)


def variant_handmade_graph(workload: str, compiled: bool, fused: bool) -> Callable[[], None]:
    """The whole step captured by hand in one CUDA graph, AdamW capturable."""
    model, batch, loss = build(workload)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        capturable=True,
        fused=fused,
        foreach=not fused,
    )
    net = torch.compile(model) if compiled else model
    body = eager_step(net, batch, loss, opt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x, y = batch
    with torch.cuda.graph(graph):
        with autocast():
            value = loss(net(x), y)
        value.backward()
        opt.step()
    return graph.replay


def variant_sg_static(
    workload: str,
    fuse: bool = False,
    plan: dict | None = None,
    fuse_options: dict | None = None,
    inductor: dict | None = None,
    donate: tuple[str, ...] = ("params", "opt_state"),
    attention: list | None = None,
) -> Callable[[], None]:
    """``sg.static`` of the step (with ``sg.fuse`` and ``sg.plan_memory`` as asked); ``inductor``:
    Inductor settings patched on top of sgraph's for the first call, which compiles;
    ``donate``: the arguments donated (none: the step leaves its inputs alone; a
    model's running statistics are donated with its params); ``attention``: the SDPA
    backends allowed around every call (the trace picks one of them)."""
    model, batch, loss = build(workload)
    step, state, names = functional_step(model, loss, autocast)
    body = sg.fuse(**(fuse_options or {}))(step) if fuse else step
    body = sg.plan_memory(**plan)(body) if plan is not None else body
    train_step = sg.static(body, donate=tuple(n for n in names if n in donate or (donate and n == "buffers")))

    settings = [inductor_settings(inductor or {})]

    def run() -> None:
        # The backends for every call: sg.static checks SDPA's switches on each call and
        # traces again (with the backend then allowed) where they differ from the trace's.
        backends = torch.nn.attention.sdpa_kernel(attention) if attention else contextlib.nullcontext()
        with settings.pop() if settings else contextlib.nullcontext(), backends:
            state[:] = train_step(*state, batch)[:-1]

    run.step = train_step  # type: ignore[attr-defined]
    return run


def functional_step(model, loss, cast) -> tuple[Callable, list, tuple[str, ...]]:
    """The train step as sgraph runs it: ``(step, state, names)``, where ``step(*state,
    batch)`` returns ``(*new_state, {"loss": value})`` and ``names`` are its state
    arguments' names. The state is ``[params, opt_state]``, or ``[params, buffers,
    opt_state]`` for a model with BatchNorm, whose running statistics the step returns."""
    apply, params, buffers = sg.functional(model)
    opt = sg.optim.adamw(LR, weight_decay=WEIGHT_DECAY)

    if apply.return_buffers:

        def loss_with_buffers(params, buffers, batch):
            x, y = batch
            with cast():
                logits, buffers = apply(params, buffers, x)
            return loss(logits, y), buffers

        def step_with_buffers(params, buffers, opt_state, batch):
            (value, buffers), grads = sg.value_and_grad(loss_with_buffers, has_aux=True)(params, buffers, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return sg.optim.apply_updates(params, updates), buffers, opt_state, {"loss": value}

        return step_with_buffers, [params, buffers, opt.init(params)], ("params", "buffers", "opt_state")

    def loss_fn(params, batch):
        x, y = batch
        with cast():
            logits = apply(params, buffers, x)
        return loss(logits, y)

    def step(params, opt_state, batch):
        value, grads = sg.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sg.optim.apply_updates(params, updates), opt_state, {"loss": value}

    return step, [params, opt.init(params)], ("params", "opt_state")


def inductor_settings(patches: dict) -> contextlib.AbstractContextManager:
    """``torch._inductor.config.patch`` of the settings this torch has (sgraph's own
    scoped settings go on top of them; the others reach Inductor as patched here)."""
    from torch._inductor import config

    from sgraph._src.runtime.inductor import _has_option

    missing = [name for name in patches if not _has_option(config, name)]
    if missing:
        print(f"(this torch has no Inductor setting {', '.join(missing)}: left out)", flush=True)
    return config.patch({k: v for k, v in patches.items() if k not in missing})


VARIANTS: dict[str, tuple[str, Callable[[str], Callable[[], None]]]] = {
    "eager": ("eager, AdamW fused", variant_eager),
    "compile": ("torch.compile(model), AdamW fused", variant_compile),
    "compile-ro": (
        'torch.compile(model, mode="reduce-overhead"), AdamW fused',
        lambda w: variant_compile(w, "reduce-overhead"),
    ),
    "graph-eager": (
        "whole step in one hand-captured CUDA graph, eager kernels, AdamW foreach capturable",
        lambda w: variant_handmade_graph(w, compiled=False, fused=False),
    ),
    "graph-best": (
        "same, model torch.compile'd, AdamW fused+capturable (best hand-made)",
        lambda w: variant_handmade_graph(w, compiled=True, fused=True),
    ),
    "sg-static": ("sg.static (eager kernels, one CUDA graph)", variant_sg_static),
    "sg-fuse": (
        "sg.static + sg.fuse (generated kernels, one CUDA graph, a repeated block compiled once)",
        lambda w: variant_sg_static(w, fuse=True),
    ),
    "sg-fuse-no-donate": (
        "sg.static + sg.fuse, nothing donated (params and state left as they were, new ones returned)",
        lambda w: variant_sg_static(w, fuse=True, donate=()),
    ),
    "sg-fuse-inline": (
        "sg.static + sg.fuse(reuse_blocks=False) (every block compiled inline)",
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"reuse_blocks": False}),
    ),
    "sg-fuse-aten-adamw": (
        'sg.static + sg.fuse(kernels=("linear_cross_entropy", "gelu_mlp")) (AdamW on ATen\'s kernel, fp32 grads)',
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"kernels": ("linear_cross_entropy", "gelu_mlp")}),
    ),
    "sg-fuse-no-gelu-mlp": (
        'sg.static + sg.fuse(kernels=("linear_cross_entropy", "adamw")) (the MLP\'s GELU as generated code)',
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"kernels": ("linear_cross_entropy", "adamw")}),
    ),
    "sg-fuse-nchw": (
        "sg.static + sg.fuse(channels_last=False) (convolutions on the traced NCHW layouts)",
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"channels_last": False}),
    ),
    "sg-fuse-autotune": (
        "sg.static + sg.fuse(autotune=True) (Triton matmul templates with fused epilogues, tuned block sizes)",
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"autotune": True}),
    ),
    "sg-fuse-flash-attention": (
        "sg.static + sg.fuse, traced with SDPA's FlashAttention-2 backend instead of cuDNN's",
        lambda w: variant_sg_static(w, fuse=True, attention=[torch.nn.attention.SDPBackend.FLASH_ATTENTION]),
    ),
    "sg-fuse-pdl": (
        "sg.static + sg.fuse, Inductor's programmatic dependent launch on (triton.enable_pdl)",
        lambda w: variant_sg_static(w, fuse=True, inductor={"triton.enable_pdl": True}),
    ),
    "sg-fuse-no-ce": (
        'sg.static + sg.fuse(kernels=("adamw", "gelu_mlp")) (the loss generated: full logits)',
        lambda w: variant_sg_static(w, fuse=True, fuse_options={"kernels": ("adamw", "gelu_mlp")}),
    ),
    "sg-fuse-pointwise-once": (
        "sg.static + sg.fuse, one configuration per pointwise kernel (triton.autotune_pointwise off)",
        lambda w: variant_sg_static(w, fuse=True, inductor={"triton.autotune_pointwise": False}),
    ),
    "sg-fuse-autotune-tma": (
        "sg.static + sg.fuse(autotune=True), Inductor's persistent TMA matmul templates on (Hopper)",
        lambda w: variant_sg_static(
            w, fuse=True, fuse_options={"autotune": True}, inductor={"triton.enable_persistent_tma_matmul": True}
        ),
    ),
    "sg-plan": ("sg.static + sg.plan_memory() (eager kernels)", lambda w: variant_sg_static(w, plan={})),
    "sg-fuse-plan": (
        "sg.static + sg.fuse + sg.plan_memory()",
        lambda w: variant_sg_static(w, fuse=True, plan={}),
    ),
    "sg-fuse-6g": (
        'sg.static + sg.fuse + sg.plan_memory(budget="6GiB")',
        lambda w: variant_sg_static(w, fuse=True, plan={"budget": "6GiB"}),
    ),
}
SGRAPH = [k for k in VARIANTS if k.startswith("sg-")]


def event_times(run: Callable[[], None], steps: int) -> list[float]:
    """ms of each of ``steps`` calls, from CUDA events recorded around each."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for begin, end in events:
        begin.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [b.elapsed_time(e) for b, e in events]


def measure(make: Callable[[str], Callable[[], None]], workload: str, steps: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # What earlier variants left behind (library workspaces of their streams) is not this one's.
    base = torch.cuda.memory_allocated()
    BUILD_SECONDS[0] = 0.0
    start = time.perf_counter()
    run = make(workload)
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - start - BUILD_SECONDS[0]  # building the model is not the call's
    for _ in range(4):
        run()
    times = event_times(run, steps)
    result = {
        "ms": statistics.median(times),
        "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
        "first_s": first,
        "build_s": BUILD_SECONDS[0],
    }
    step = getattr(run, "step", None)
    if step is not None:
        stats = step.last_compiled.stats
        result.update(kernels=stats.kernel_launches, traces=stats.traces, capture_s=stats.capture_seconds)
        result.update(trace_s=stats.trace_seconds, lower_s=stats.lower_seconds, compile_s=stats.compile_seconds)
        result.update(unfused=stats.kernels_unfused)
        result.update(block_calls=stats.block_calls, block_subgraphs=stats.block_subgraphs, entry=stats.inductor_entry)
        result.update(predicted_mib=stats.memory_predicted / 2**20, step_peak_mib=_mib(stats.memory_measured))
        result.update(step_reserved_mib=_mib(stats.memory_reserved), base_mib=base / 2**20)
    del run
    torch._dynamo.reset()
    return result


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def host_overhead(leaves: int, device: str, calls: int = 200) -> dict:
    """Per-call host time (ms) of sg.static on ``leaves`` small leaves: total, runtime, call path."""
    params = {f"layer{i}.weight": torch.randn(64, device=device) for i in range(leaves // 2)}
    momentum = {k: torch.zeros_like(v) for k, v in params.items()}

    @sg.static(donate=("params", "momentum"))
    def step(params, momentum, lr):
        momentum = {k: 0.9 * momentum[k] + params[k] for k in params}
        return {k: params[k] - lr * momentum[k] for k in params}, momentum

    state = [params, momentum]
    for _ in range(3):
        state[:] = step(state[0], state[1], 0.1)
    compiled = step.last_compiled
    tensors = sg.tree.leaves((state[0], state[1]))

    def timed(call: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - start) / calls)
        _sync(device)
        return best * 1e3

    runtime = timed(lambda: compiled.executable(tensors))
    # The call path alone: the same calls with the runtime replaced by its last outputs.
    outputs, executable = list(compiled.executable(tensors)), compiled.executable
    compiled.executable = lambda inputs: list(outputs)
    try:
        call_path = timed(lambda: state.__setitem__(slice(None), step(state[0], state[1], 0.1)))
    finally:
        compiled.executable = executable
    return {"leaves": leaves, "total_ms": call_path + runtime, "runtime_ms": runtime, "call_path_ms": call_path}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def print_host_overhead(rows: list[dict], device: str) -> None:
    print(f"\n## host time per call of a compiled sg.static step ({device}; target: call path <= 0.3 ms at 500)\n")
    print("| leaves | per call ms | runtime ms (replay, copies) | sgraph call path ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['leaves']} | {r['total_ms']:.3f} | {r['runtime_ms']:.3f} | {r['call_path_ms']:.3f} |")


def print_table(results: dict, workloads: list[str]) -> None:
    print("\n## median ms per step (peak MiB, first-call s)\n")
    print("| variant | " + " | ".join(workloads) + " |")
    print("|---|" + "---|" * len(workloads))
    for key, cells in results.items():
        row = [f"{c['ms']:.3f} ({c['peak_mib']:.0f} MiB, {c['first_s']:.1f} s)" if c else "-" for c in cells.values()]
        print(f"| {VARIANTS[key][0]} | " + " | ".join(row) + " |")
    print("\n## memory of the sgraph variants: predicted peak vs the captured step's (MiB)\n")
    print("| variant | " + " | ".join(workloads) + " |")
    print("|---|" + "---|" * len(workloads))
    for key in [k for k in SGRAPH if k in results]:
        print(f"| {VARIANTS[key][0]} | " + " | ".join(_memory_cell(results[key].get(w)) for w in workloads) + " |")
    for sg_key in [k for k in SGRAPH if k in results]:
        print(f"\n## speed-up of {VARIANTS[sg_key][0]} (anchor ms / sgraph ms; > 1 means sgraph is faster)\n")
        print("| anchor | " + " | ".join(workloads) + " |")
        print("|---|" + "---|" * len(workloads))
        for key, cells in results.items():
            if key in SGRAPH:
                continue
            row = [
                f"{cells[w]['ms'] / results[sg_key][w]['ms']:.2f}x" if cells.get(w) and results[sg_key].get(w) else "-"
                for w in workloads
            ]
            print(f"| {VARIANTS[key][0]} | " + " | ".join(row) + " |")


def _memory_cell(c: dict | None) -> str:
    """predicted / measured (reserved), and measured against predicted."""
    if not c or c.get("predicted_mib") is None:
        return "-"
    if c.get("step_peak_mib") is None:
        return f"{c['predicted_mib']:.0f} / ?"
    error = c["step_peak_mib"] / c["predicted_mib"] - 1
    return f"{c['predicted_mib']:.0f} / {c['step_peak_mib']:.0f} ({c['step_reserved_mib']:.0f}) {error:+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=ANCHORED, choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--host-overhead", action="store_true", help="also time the per-call host overhead")
    parser.add_argument("--device", default="cuda", help="device of the host-overhead table (cuda or cpu)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.host_overhead and args.device == "cpu" and not args.variants:
        print_host_overhead([host_overhead(n, "cpu") for n in (10, 100, 200, 500, 2000)], "cpu")
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmark.py times CUDA graphs and needs a GPU; run examples/quickstart.py on CPU.")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    results: dict = {v: {} for v in args.variants}
    for workload in args.workloads:
        for key in args.variants:
            try:
                results[key][workload] = measure(VARIANTS[key][1], workload, args.steps)
            except Exception as error:  # one variant failing must not hide the others
                print(f"{key} on {workload} failed: {type(error).__name__}: {str(error)[:300]}")
                results[key][workload] = None
            print(key, workload, results[key][workload], flush=True)
    overhead = [host_overhead(n, args.device) for n in (10, 100, 200, 500, 2000)] if args.host_overhead else []
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    if args.variants:
        print_table(results, args.workloads)
    if overhead:
        print_host_overhead(overhead, args.device)
    if args.json:
        meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "host_overhead": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
