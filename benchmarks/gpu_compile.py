"""Fewer launches and fewer passes for the update on a GPU: torch.compile of the fused head's elementwise
passes (logprobs.block_passes, shipped) and of parts of the decoder blocks (not shipped), each against the
code before, on gpu_update.py's update (Qwen2.5-0.5B's shape, random weights, 16 prompts x 8 x 128 tokens,
FSDP2 on one rank, bf16), then --compile-blocks inside the trainer (stage 4). The JSON (--json) is rewritten
after every stage: a run cut off keeps what finished.

    python benchmarks/gpu_compile.py --like DIR --gsm8k DIR --json gpu_compile.json   # H200: about 2.5 min
    python benchmarks/gpu_compile.py --dry-run --like ../shared/models/qwen2.5-0.5b-instruct --gsm8k data/gsm8k

1 matmul: the card's bf16 rate at the MLP's shape. 2 head: the fused head alone, its passes in place (as
before, and on CPUs) against compiled (one kernel for a block's max and shifted sums; one for its gradient,
cast to bf16): ms, and their largest differences. 3 update, one SETTINGS entry after another on a fresh
model: the first update (compiling), the median update, its phases, MFU, peak memory, dynamo's graphs.
4 trainer: gpu.py's run for --trainer-steps without and with --compile-blocks: updates, first update, peak.
--dry-run: a tiny model on the CPU with dynamo's eager backend (it checks the tracing, not the speed).
"""

import argparse
import functools
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import common  # noqa: E402
import gpu_update  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import logprobs  # noqa: E402
from distributed import init_distributed  # noqa: E402

SHIPPED_PASSES = logprobs.block_passes
SETTINGS = {  # name: (the head's passes compiled, module classes compiled in place, the allocator's cache emptied first)
    "in-place head": (False, (), False),
    "shipped": (True, (), False),
    "shipped + mlp + norms": (True, ("Qwen2MLP", "Qwen2RMSNorm"), False),
    "shipped + blocks": (True, ("Qwen2DecoderLayer",), False),
    # a step that empties the allocator's cache (the transformers engine did as it slept): the update allocates afresh
    "shipped, emptied cache": (True, (), True),
}


def passes(compiled):
    """logprobs.block_passes as shipped (compiled on CUDA) or as before (None: the in-place loop, as on CPUs in fp32)."""
    if compiled and BACKEND == "eager":  # a dry run: the GPU's functions, traced
        return lambda device, dtype: [
            torch.compile(f, backend="eager") for f in (logprobs.block_stats, logprobs.block_grad)
        ]
    return SHIPPED_PASSES if compiled else (lambda device, dtype: None)


def head_stage(device, n_time, n_check, H, V):
    """The shipped head against the compiled one: forward + backward ms on n_time tokens, the first call's
    seconds (compiling), and the largest differences between the two on n_check tokens."""
    dt, out, results = torch.bfloat16, {}, {}
    for name, compiled in (("in place", False), ("compiled", True)):
        logprobs.block_passes = passes(compiled)
        try:
            case = gpu_update.head_case(n_time, H, V, dt, device)
            rows, cols = logprobs.head_blocks(n_time, V, torch.device("cuda"))  # the GPU geometry, as gpu_update
            t = time.perf_counter()
            results[name] = gpu_update.run_head(gpu_update.head_case(n_check, H, V, dt, device, seed=1), rows, cols,
                                                logprobs._add_product)  # fmt: skip
            gpu_update.sync(device)
            first = time.perf_counter() - t
            s, _ = gpu_update.timed(lambda r=rows, c=cols, x=case: gpu_update.run_head(x, r, c, logprobs._add_product),
                                    device, reps=5 if device.type == "cuda" else 1)  # fmt: skip
            out[name] = dict(ms=1e3 * s, tflops=8 * n_time * H * V / s / 1e12, first_call_s=first)
        except Exception as e:  # reported; the rest still runs
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
        print(f"  head {name}: {out[name]}", flush=True)
    logprobs.block_passes = SHIPPED_PASSES
    if len(results) == 2:
        keys = ("logp", "entropy", "grad_hidden", "grad_weight")
        out["max_diff"] = {
            k: (a.float() - b.float()).abs().max().item()
            for k, a, b in zip(keys, results["compiled"], results["in place"])
        }
        out["scale"] = {k: b.float().abs().max().item() for k, b in zip(keys, results["in place"])}
    return dict(tokens=n_time, check_tokens=n_check, **out)


def setting_stage(args, device, name, rate):
    """One setting of SETTINGS on a fresh model: the first update (compiling), then gpu_update's measure."""
    compiled_head, classes, empty = SETTINGS[name]
    torch._dynamo.reset()
    counters.clear()
    logprobs.block_passes = passes(compiled_head)
    model, targs, batch, work = gpu_update.update_setup(args, device)
    try:
        for module in model.modules():
            if type(module).__name__.removeprefix("FSDP") in classes:  # fully_shard renames the class
                module.compile(backend=BACKEND, dynamic=False)
        shipped = set(gpu_update.CHANGES) - ({"reshard"} if device.type == "cuda" else set())
        setting = gpu_update.Setting(model, device, shipped)
        opt = gpu_update.optimizer_for(model, setting, targs.lr)
        t = time.perf_counter()
        gpu_update.update(model, opt, batch, targs, device)
        gpu_update.sync(device)
        first = time.perf_counter() - t
        del opt
        if empty and device.type == "cuda":
            plain = gpu_update.update
            gpu_update.update = lambda *a: (torch.cuda.empty_cache(), plain(*a))[1]
        try:
            row = gpu_update.measure(
                model, targs, batch, device, shipped, 1 if args.dry_run else 5, with_phases=not empty
            )
        finally:
            gpu_update.update = plain if empty and device.type == "cuda" else gpu_update.update
        row.update(first_update_s=first, compiled=sorted(classes) + (["head"] if compiled_head else []))
        row.update(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))
        row["break_reasons"] = [k[:200] for k in list(counters["graph_break"])[:5]]
        if "update_s" in row:
            row["tflops"] = work["flops"] / row["update_s"] / 1e12
            row["mfu"] = row["tflops"] / rate
    except Exception as e:
        row = dict(error=f"{type(e).__name__}: {e}"[:800])
    finally:
        logprobs.block_passes = SHIPPED_PASSES
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  update {name}: {row}", flush=True)
    return row


def trainer_stage(args, steps):
    """--compile-blocks inside the trainer: gpu.py's short run (the transformers engine, bf16, no KL) without
    and with the flag. Each update's seconds (timing_s/update_actor: the first compiles), the median of the
    rest, the peak GPU memory the trainer logs, the run's seconds. A dry run: a 2-layer model on the CPU,
    where the trainer compiles with inductor (a C++ compiler; without one it says so and runs uncompiled)."""
    import gpu

    # a dry run in fp32 on one thread, as gpu_update.py's: bf16 is emulated on CPUs without it (14x slower)
    tiny = ["--hidden", "64", "--layers", "2", "--prompts", "2", "--group-size", "2", "--response-length", "8"]
    tiny += ["--dtype", "fp32"]
    work = os.path.join(os.path.dirname(os.path.abspath(args.json or "gpu_compile.json")), "gpu_compile_runs")
    gargs = gpu.parse_args(
        ["--like", args.like, "--gsm8k", args.gsm8k, "--work-dir", work] + (tiny if args.dry_run else [])
    )
    model_dir, out = gpu.build_model(gargs), {}
    for name, flags in (("plain", []), ("compile-blocks", ["--compile-blocks"])):
        flags += ["--test-freq=-1", "--save-freq=-1", "--no-save-model", "--no-engine-logprobs"]
        run = gpu.run_ours(gargs, model_dir, f"trainer-{name}", steps, flags, threads=1 if args.dry_run else None)
        updates = [m["timing_s/update_actor"] for m in run["metrics"] if "timing_s/update_actor" in m]
        peaks = [m["perf/max_memory_allocated_gb"] for m in run["metrics"] if "perf/max_memory_allocated_gb" in m]
        out[name] = dict(ok=run["ok"], error=run["error"], updates_s=updates, wall_s=run["wall_s"],
                         first_update_s=updates[0] if updates else None, peak_gib=max(peaks, default=None),
                         update_s=statistics.median(updates[1:]) if len(updates) > 1 else None)  # fmt: skip
        print(f"  trainer {name}: {out[name]}", flush=True)
    a, b = out["plain"], out["compile-blocks"]
    if a["update_s"] and b["update_s"]:
        out.update(update_ratio=b["update_s"] / a["update_s"], compile_s=b["first_update_s"] - a["first_update_s"])
    return out


def main():
    global BACKEND
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a Qwen2.5 config and tokenizer directory (no weights needed)")
    p.add_argument("--gsm8k", required=True, help="unused; gpu_update's setup takes it")
    p.add_argument("--json", default="", help="write every figure here, after each stage")
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, dynamo's eager backend")
    p.add_argument("--budget", type=float, default=300, help="seconds; a setting that starts later is skipped")
    p.add_argument("--settings", default=";".join(SETTINGS), help="semicolon-separated, from: " + ", ".join(SETTINGS))
    p.add_argument("--trainer-steps", type=int, default=6, help="steps of each trainer run (0: no trainer stage)")
    args = p.parse_args()
    start = time.perf_counter()
    _, _, gpu = init_distributed()  # a process group of one, for FSDP2
    device = torch.device("cpu") if args.dry_run else gpu
    BACKEND = "inductor" if device.type == "cuda" else "eager"
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):  # whole blocks: each layer's index is a constant, so 24 graphs
            setattr(torch._dynamo.config, key, 512)
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (a dry run)",
                torch=torch.__version__, backend=BACKEND)  # fmt: skip
    results = dict(info=info, stages={}, seconds={})

    save = functools.partial(common.save_stage, results, start=start, json_path=args.json)  # save(stage, value)

    tiny = args.dry_run
    mlp = (256, 64, 128) if tiny else (16384 + 2000, 896, 4864)
    save("matmul", gpu_update.matmul_stage(device, torch.bfloat16, [mlp]))
    rate = max(results["stages"]["matmul"].values())
    save("head", head_stage(device, 256 if tiny else 16384, 64 if tiny else 4096, 64 if tiny else 896,
                            4096 if tiny else 151936))  # fmt: skip
    rows = {}
    for name in args.settings.split(";"):
        if time.perf_counter() - start > args.budget:
            results.setdefault("skipped_for_time", []).append(name)
            continue
        rows[name] = setting_stage(args, device, name, rate)
        save("update", rows)
    if args.trainer_steps:  # after the in-process stages: its runs are processes of their own
        save("trainer", trainer_stage(args, 2 if args.dry_run else args.trainer_steps))
    torch.distributed.destroy_process_group()
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
