"""Our GRPO step on one GPU against TRL's GRPOTrainer doing the same work, on a Qwen2.5-0.5B-shaped model:
the phases, a profile of one step, the update's MFU against this GPU's measured bf16 matmul rate and the
peak memory; beside it the step as it ran before the transformers engine shared the policy's weights and
decoded with CUDA graphs (the baseline), and with --compile-blocks. (gpu_update.py runs the other paths:
--offload, --grad-checkpointing, LoRA, a kill and a resume.)

    python benchmarks/gpu.py --like ../shared/models/qwen2.5-0.5b-instruct --gsm8k data/gsm8k --json gpu.json
    python benchmarks/gpu.py --like ... --gsm8k ... --hidden 128 --layers 2 --steps 3 ...   # a CPU dry run

The model: Qwen2.5-0.5B's config, random weights, the real tokenizer and chat template (494M parameters,
the 151,936-row tied head). Random weights write no EOS, so every answer runs to --response-length and both
sides do the same work. Each run is a fresh process (runners.py): ours under torchrun, `--rollout hf` (no vLLM
on this image), bf16; TRL with bf16=True and model.generate; the same prompts in the same order, no KL term,
one optimizer step per rollout. A run that fails is reported and the rest go on; the JSON is written after each.
"""

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import fresh_dir, matmul_params, print_table, run_process, update_mfu  # noqa: E402
from runners import prompts_for, run_trl, step_records  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a Qwen2.5 config and tokenizer directory (no weights needed)")
    p.add_argument("--gsm8k", required=True, help="train.parquet and test.parquet (python data_prep.py gsm8k)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "gpu"))
    p.add_argument("--hidden", type=int, default=None, help="shrink the model (a CPU dry run); default: as --like")
    p.add_argument("--layers", type=int, default=None, help="shrink the model (a CPU dry run); default: as --like")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--response-length", type=int, default=128, help="new tokens per sample (all of them: no EOS)")
    p.add_argument("--micro-batch-tokens", type=int, default=32768, help="ours: tokens per forward/backward")
    p.add_argument("--trl-passes", type=int, default=2, help="TRL: forward/backward passes per step")
    p.add_argument("--steps", type=int, default=10, help="steps of our timed run")
    p.add_argument("--profile-step", type=int, default=None, help="ours: the step profiled (default: the last but one)")
    p.add_argument("--trl-steps", type=int, default=6, help="steps of TRL's run")
    p.add_argument("--other-steps", type=int, default=6, help="steps of the baseline and --compile-blocks runs")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each timed run left out")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--skip", default="", help="comma-separated parts to skip: ours, eval, trl, baseline, compile")
    p.add_argument("--json", default="", help="also write every measurement to this file")
    return p.parse_args(argv)


def matmul_rates(dtype, shapes):
    """FLOP/s of [m, k] x [k, n] products on this machine's GPU (CPU for a dry run), median of 20,
    timed with CUDA events after 3 warm-ups, on random data."""
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    if not torch.cuda.is_available():
        from common import matmul_rate

        return {shape: matmul_rate(os.cpu_count(), dtype, shape) for shape in shapes}
    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dt, device="cuda"), torch.randn(k, n, dtype=dt, device="cuda")
        times = []
        for i in range(23):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) / 1e3)
        rates[(m, k, n)] = 2 * m * k * n / statistics.median(times)
        del a, b
    return rates


def build_model(args):
    """Qwen2.5's config (shrunk for a dry run) with random weights; the generation config keeps its
    token ids only, so TRL's generate applies no sampling defaults that ours does not."""
    from models import build_random_model

    name = "model-qwen" + (f"-h{args.hidden}-l{args.layers}" if args.hidden or args.layers else "")
    model_dir = os.path.join(args.work_dir, name)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        heads = {} if not args.hidden else dict(num_attention_heads=args.hidden // 64, num_key_value_heads=1)
        build_random_model(
            model_dir,
            args.like,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=None,
            **heads,
        )
        path = os.path.join(model_dir, "generation_config.json")
        fields = json.load(open(path))
        with open(path, "w") as f:
            json.dump({k: v for k, v in fields.items() if k.endswith("token_id")}, f, indent=2)
    return model_dir


def run_ours(args, model_dir, name, steps, flags=(), out_dir=None, crash_at=None, threads=None):
    """train_grpo.py under torchrun on one GPU (crash_at: GRPO_CRASH_AT, where it kills itself; threads: its
    OpenMP threads, every core by default). Returns
    dict(ok, error, log, records, metrics): the per-step records in runners.run_ours' shape, and the raw
    metrics lines."""
    run_dir = os.path.join(args.work_dir, "runs", name)
    if out_dir is None:
        fresh_dir(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "out")
    os.makedirs(run_dir, exist_ok=True)
    P, n = args.prompts, args.group_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    cmd += [
        f"--model={model_dir}",
        f"--train-data={os.path.join(args.gsm8k, 'train.parquet')}",
        f"--val-data={os.path.join(args.gsm8k, 'test.parquet')}",
        f"--out-dir={out_dir}",
        "--rollout=hf",
        f"--dtype={args.dtype}",
        f"--prompt-batch-size={P}",
        f"--mini-batch-size={P}",
        f"--group-size={n}",
        f"--micro-batch-size={P * n}",
        "--max-prompt-length=512",
        f"--max-response-length={args.response_length}",
        f"--max-steps={steps}",
        "--lr=1e-6",
        "--kl-coef=0",
        "--entropy-coef=0",
        "--temperature=1.0",
        "--no-val-before-train",
        "--val-max-prompts=32",
        *flags,
    ]
    if not any(f.startswith("--micro-batch-tokens") for f in flags):
        cmd.append(f"--micro-batch-tokens={args.micro_batch_tokens}")
    t = time.perf_counter()
    env = {"GRPO_CRASH_AT": crash_at} if crash_at else None
    ok, error, _ = run_process(cmd, run_dir, threads or os.cpu_count(), timeout=900, env=env)
    log = os.path.join(run_dir, "log.txt")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    lines = [json.loads(x) for x in open(metrics_path)] if os.path.isfile(metrics_path) else []
    shared = not {"--no-share-prompts", "--grad-checkpointing"} & set(flags)  # train_grpo's own rule
    records = step_records(lines, P, n, shared)
    print(f"  {name}: {'ok' if ok else 'FAILED: ' + error} ({time.perf_counter() - t:.0f} s)", flush=True)
    text = open(log, errors="replace").read() if os.path.isfile(log) else ""
    if not ok:
        print("    " + "\n    ".join(text.splitlines()[-8:]), flush=True)
    run = dict(name=name, ok=ok, error=error, log=log, records=records, metrics=lines, wall_s=time.perf_counter() - t)
    # how the engine decoded: hf_engine says once if it fell back from CUDA graphs, and why
    run["cuda_graphs_off"] = [line for line in text.splitlines() if "CUDA graphs off" in line][:1]
    run["weights_shared"] = any(m.get("rollout/weights_shared") for m in lines)
    gap = [m["training/rollout_logprob_diff_max"] for m in lines if "training/rollout_logprob_diff_max" in m]
    run["engine_gap_max"] = max(gap, default=None)  # the engine's log-probs against the trainer's, every token
    profiled = [f for f in os.listdir(out_dir) if f.startswith("profile_step_")] if os.path.isdir(out_dir) else []
    for f in profiled:  # that step ran under the profiler: its times are not the others'
        step = int(f.removeprefix("profile_step_").removesuffix(".txt"))
        run["profile"] = dict(step=step, table=open(os.path.join(out_dir, f)).read().splitlines())
        run["records"] = [r for r in records if r["step"] != step]
    return run


def peak(run):
    return max((r["rss_gb"] for r in run["records"]), default=float("nan"))


def phase_table(run, warmup):
    kept = [r for r in run["records"] if r["step"] > warmup]
    if not kept:
        return []
    med = {k: statistics.median(r[k] for r in kept) for k in kept[0] if k != "step"}
    rows = [
        [k.removesuffix("_s"), f"{med[k]:.3f}", f"{100 * med[k] / med['step_s']:.0f}%"]
        for k in ("gen_s", "reward_s", "logprob_s", "update_s", "sync_s")
        if k in med
    ]
    rows.append(["whole step", f"{med['step_s']:.3f}", "100%"])
    return rows


# What runs, in order (on an H200 about 1.5 min each; --skip chooses):
#   1. the bf16 matmul rate, at 8192^3 and at the model's MLP shape (CUDA events, median);
#   2. ours, --steps steps (the engine on the policy's own weights, CUDA graphs), one validation at the end, the
#      final model saved, --profile-step profiled (left out of the medians); then eval.py on that final model
#      (the transformers engine on CUDA, standalone);
#   3. TRL, --trl-steps steps of the same work;
#   4. the baseline: ours as before commit c023533, --other-steps steps (the engine's own copy of the weights, synced
#      every step, and the eager decode loop: --no-engine-shares-policy --no-cuda-graphs);
#   5. ours with --compile-blocks, --other-steps steps.
def main():
    args = parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    import torch
    import transformers

    os.makedirs(args.work_dir, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (a CPU dry run)"
    info = dict(gpu=gpu, torch=torch.__version__, transformers=transformers.__version__, cpus=os.cpu_count())
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError as e:
        info["trl"] = f"missing ({e})"
    print_table("machine", ["what", "value"], [[k, v] for k, v in info.items()])
    results = dict(config=vars(args), info=info)

    model_dir = build_model(args)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    n_matmul = matmul_params(model_dir)
    tokens = args.micro_batch_tokens
    big = 8192 if torch.cuda.is_available() else 1024  # a CPU dry run: seconds, not minutes
    shapes = [(big, big, big), (min(tokens, 8 * big), config.hidden_size, config.intermediate_size)]
    rates = matmul_rates(args.dtype, shapes)
    rate = rates[shapes[1]]
    print_table(
        f"{args.dtype} matmul rate (TFLOP/s)",
        ["shape m x k x n", "TFLOP/s"],
        [["x".join(map(str, s)), f"{r / 1e12:.1f}"] for s, r in rates.items()],
        note="MFU below is against the MLP shape's rate",
    )
    results["matmul_tflops"] = {"x".join(map(str, s)): r / 1e12 for s, r in rates.items()}
    P, n, L = args.prompts, args.group_size, args.response_length
    print(
        f"\nmodel: {config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"vocab {config.vocab_size}; work per step: {P} prompts x {n} samples x {L} new tokens",
        flush=True,
    )
    runs = {}

    def save():  # after every run: a run cut off by a time limit keeps what finished
        results["runs"] = {k: {x: v[x] for x in v if x != "metrics"} for k, v in runs.items()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)

    # ---- 2. ours: the timed run, with a profiled step, a validation and the final model
    if "ours" not in skip:
        profile_step = args.profile_step if args.profile_step is not None else max(1, args.steps - 1)
        flags = [f"--test-freq={args.steps}", "--save-freq=-1", f"--profile-step={profile_step}"]
        runs["ours"] = run_ours(args, model_dir, "ours", args.steps, flags)
        save()
        final = os.path.join(args.work_dir, "runs", "ours", "out", "final_model")
        if "eval" not in skip and os.path.isfile(os.path.join(final, "config.json")):
            run_dir = fresh_dir(os.path.join(args.work_dir, "runs", "eval"))
            cmd = [
                sys.executable,
                "eval.py",
                "--model",
                final,
                "--data",
                os.path.join(args.gsm8k, "test.parquet"),
                "--max-prompts",
                "32",
                "--max-new-tokens",
                "64",
                "--rollout",
                "hf",
                "--dtype",
                "auto",
                "--out",
                os.path.join(run_dir, "eval.json"),
            ]
            ok, error, _ = run_process(cmd, run_dir, os.cpu_count(), timeout=300)
            print(f"  eval.py on final_model: {'ok' if ok else 'FAILED: ' + error}", flush=True)
            results["eval"] = dict(ok=ok, error=error)
        save()

    # ---- 3. TRL, the same work
    if "trl" not in skip:
        trl_args = argparse.Namespace(
            work_dir=args.work_dir,
            prompts=P,
            lr=1e-6,
            setup="smollm2",
            dtype=args.dtype,
            threads=os.cpu_count(),
            steps=max(args.steps, args.trl_steps),
            sweep_steps=0,
            probe_steps=0,
        )
        train = os.path.join(args.gsm8k, "train.parquet")
        prompts_for(trl_args, train, 0, trl_args.steps)
        t = time.perf_counter()
        run = run_trl(
            trl_args,
            (model_dir, train, None),
            "trl",
            "generate",
            n,
            L,
            args.trl_steps,
            0,
            passes=args.trl_passes,
            must_work=False,
        )
        run["ok"] = not run.get("error")
        print(
            f"  trl: {'ok' if run['ok'] else 'FAILED: ' + run['error']} ({time.perf_counter() - t:.0f} s)", flush=True
        )
        if not run["ok"]:
            log = os.path.join(args.work_dir, "runs", "trl", "log.txt")
            print("    " + "\n    ".join(open(log, errors="replace").read().splitlines()[-8:]), flush=True)
        runs["trl"] = run
        save()

    # ---- 4. the baseline; 5. --compile-blocks
    others = [("baseline", ["--no-engine-shares-policy", "--no-cuda-graphs"]), ("compile", ["--compile-blocks"])]
    for name, flags in others:
        if name not in skip:
            runs[name] = run_ours(args, model_dir, name, args.other_steps, flags + ["--test-freq=-1", "--save-freq=-1"])
            save()

    # ---- the tables
    w = args.warmup
    compared = ("ours", "trl", "baseline", "compile")
    for name in compared:
        if runs.get(name, {}).get("records"):
            print_table(
                f"{name}: where a step's time goes (median of steps > {w}, s)",
                ["phase", "s", "share"],
                phase_table(runs[name], w),
            )
    rows, summary = [], {}
    for name in compared:
        run = runs.get(name)
        kept = [r for r in (run or {}).get("records", []) if r["step"] > w]
        if not kept:
            continue
        mfu = update_mfu([run], w, n_matmul, rate)
        step = statistics.median(r["step_s"] for r in kept)
        gen_tok = statistics.median(r["gen_tokens"] / r["step_s"] for r in kept)
        all_tok = statistics.median((r["gen_tokens"] + r["prompt_tokens"]) / r["step_s"] for r in kept)
        summary[name] = dict(
            step_s=step,
            gen_tok_s=gen_tok,
            tok_s=all_tok,
            update_s=mfu["update_s"],
            mfu=mfu["mfu"],
            update_tflops=mfu["gflops"] / 1e3,
            peak_gib=peak(run),
            steps=len(kept),
            phases_s={k: statistics.median(r[k] for r in kept) for k in kept[0] if k.endswith("_s")},
        )
        for key in ("cuda_graphs_off", "weights_shared", "engine_gap_max"):
            if key in run:
                summary[name][key] = run[key]
        rows.append(
            [
                name,
                len(kept),
                f"{step:.3f}",
                f"{gen_tok:.0f}",
                f"{all_tok:.0f}",
                f"{mfu['update_s']:.3f}",
                f"{mfu['gflops'] / 1e3:.1f}",
                f"{100 * mfu['mfu']:.0f}%",
                f"{peak(run):.1f}",
            ]
        )
    if rows:
        print_table(
            "step, throughput and update MFU (medians)",
            ["system", "steps", "step s", "gen tok/s", "tok/s", "update s", "update TFLOP/s", "MFU", "peak GiB"],
            rows,
        )
    for other, what in (("trl", "TRL"), ("baseline", "the baseline (before commit c023533)")):
        if "ours" in summary and other in summary:
            summary[f"speedup_vs_{other}"] = summary[other]["step_s"] / summary["ours"]["step_s"]
            print(f"ours is {summary[f'speedup_vs_{other}']:.2f}x faster per step than {what} on the same work")
    if runs.get("ours", {}).get("profile"):
        profile = runs["ours"]["profile"]
        print(f"\nours, step {profile['step']} under torch.profiler (the first 30 lines of its table):")
        print("\n".join(profile["table"][:30]), flush=True)
    results.update(summary=summary)
    results["ok"] = {k: bool(v.get("ok")) for k, v in runs.items()}
    if "eval" in results:
        results["ok"]["eval"] = results["eval"]["ok"]
    print("ran:", ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results["ok"].items()), flush=True)
    save()


if __name__ == "__main__":
    main()
