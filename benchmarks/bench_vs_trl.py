"""Our GRPO step against TRL's GRPOTrainer, on the same machine, on the same work.

    python benchmarks/bench_vs_trl.py              # everything: about 15 min on a 2-core machine
    python benchmarks/bench_vs_trl.py --install    # first pip-install the pinned peer (requirements-bench.txt)
    python benchmarks/bench_vs_trl.py --rounds 1 --steps 8 --warmup 4 --trl-engines generate   # a few minutes
    python benchmarks/bench_vs_trl.py --setup smollm2 ...   # or qwen-vocab, or --hidden 256 --layers 4 (BENCHMARKS.md)

Two comparisons: ours with `--rollout hf` against TRL's transformers `model.generate` (apples to
apples), and ours with `--rollout vllm` against TRL's fastest generation mode here (each at its best);
then the update's MFU against this machine's matmul rate, and where each step's time goes. It is fair:
every run is a fresh process doing the same work (runners.py and trl_worker.py say how), each side
splits its update its own fastest way for the same gradient (TRL's passes are timed first), the runs
alternate A B C A B C ... with the order rotated every round so that the machine's drift hits all
alike, the first --warmup steps are dropped, and a run that other processes disturbed is flagged.
How our step grows with n and the response length: sweep_ours.py.
"""

import argparse
import os
import shutil
import statistics
import sys
import time

from common import (
    REPO,
    fmt_spread,
    kept,
    load_note,
    matmul_params,
    matmul_rate,
    median_of,
    parse_ints,
    phase_rows,
    print_table,
    print_versions,
    stats,
    summarize,
    update_mfu,
    warn_disturbed,
    write_json,
)
from runners import SETUPS, add_work_args, check_environment, check_work_args, prepare_inputs, run_ours, run_trl
from trl_worker import TRL_ENGINES

sys.path.insert(0, REPO)  # data_prep, reward, models


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--install", action="store_true", help="pip-install benchmarks/requirements-bench.txt first if TRL is missing"
    )
    add_work_args(p, work_dir=os.path.join(REPO, "runs", "bench_vs_trl"))
    p.add_argument(
        "--ours-hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run ours with --rollout hf against TRL's model.generate (the apples-to-apples comparison)",
    )
    p.add_argument("--steps", type=int, default=15, help="steps per run, warm-up included")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the comparison; each round runs every system once")
    p.add_argument(
        "--probe-steps", type=int, default=4, help="steps of each TRL engine's trial run; the first half is dropped"
    )
    p.add_argument(
        "--trl-engines",
        default=",".join(TRL_ENGINES),
        help=f"TRL generation modes to try, comma-separated ({', '.join(TRL_ENGINES)}); generate is always tried",
    )
    p.add_argument(
        "--trl-passes",
        default="1,4,8",
        help="TRL's update: split each step's completions into this many "
        "forward/backward passes (gradient_accumulation_steps = steps_per_generation), comma-separated; "
        "the fastest one is used",
    )
    a = p.parse_args(argv)
    check_work_args(p, a)
    a.trl_passes = parse_ints(p, "--trl-passes", a.trl_passes)
    a.trl_engines = ["generate"] + [
        e.strip() for e in a.trl_engines.split(",") if e.strip() and e.strip() != "generate"
    ]
    unknown = [e for e in a.trl_engines if e not in TRL_ENGINES]
    if unknown:
        p.error(f"--trl-engines: unknown {unknown}; known: {', '.join(TRL_ENGINES)}")
    problems = [
        (a.rounds < 1, "--rounds must be at least 1"),
        (a.probe_steps < 2, "--probe-steps must be at least 2"),
        (
            not a.trl_passes or any(k < 1 or (a.prompts * a.group_size) % k for k in a.trl_passes),
            f"every --trl-passes value must divide the completions per step, {a.prompts * a.group_size}",
        ),
    ]
    for bad, message in problems:
        if bad:
            p.error(message)
    return a


# ----------------------------------------------------------------------------------------------
# The runs: TRL's fastest settings first, then every system once per round


def model_summary(model_dir):
    """'llama, hidden 128, 2 layers, vocab 20, 0.53M parameters', read from the saved model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    params = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    return f"{config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}, {params / 1e6:.2f}M parameters"


def print_work(args, inputs):
    P, n = args.prompts, args.group_size
    shared = "ours: once per group; TRL: once per completion" if args.share_prompts else "once per completion (both)"
    ours = f"ours: {P * n}, padded"
    if args.micro_batch_tokens:
        ours = f"ours: packed by length, up to {args.micro_batch_tokens} tokens"
    trl = f"; TRL: the fastest of {', '.join(str(P * n // k) for k in args.trl_passes)}, each padded (probed below)"
    precision = "bf16 (ours: FSDP2 mixed precision; TRL: bf16=True)" if args.dtype == "bf16" else "fp32"
    print_table(
        "the work of one step (both systems)",
        ["setting", "value"],
        [
            ["setup", args.setup],
            ["model", model_summary(inputs[0])],
            ["prompts", "digits task" if args.setup == "tiny" else f"GSM8K training set ({inputs[1]})"],
            ["prompts per step", P],
            ["samples per prompt (n)", n],
            ["completions per step", P * n],
            ["max new tokens", args.response_length],
            ["optimizer steps per rollout", 1],
            ["prompts in the update", shared],
            ["sequences per forward/backward", ours + trl],
            ["learning rate", args.lr],
            ["KL / reference model", "off / none"],
            ["precision", precision],
            ["threads", args.threads],
            ["steps per run (warm-up dropped)", f"{args.steps} ({args.warmup})"],
        ],
    )


def probe_trl(args, inputs, results):
    """TRL's fastest settings here: into how many passes its update splits a step (ours packs sequences
    by length so that padding is not computed on; TRL pads each pass to its longest sequence, so fewer,
    larger passes are not always faster), then which generation mode. Returns (passes, engine)."""
    P, n, L = args.prompts, args.group_size, args.response_length
    warmup = args.probe_steps // 2
    print(
        f"\nTRL's update: splitting each step's {P * n} completions into {args.trl_passes} forward/backward passes ...",
        flush=True,
    )
    splits = {
        k: run_trl(args, inputs, f"probe-trl-passes{k}", "generate", n, L, args.probe_steps, args.seed, passes=k)
        for k in args.trl_passes
    }
    results["runs"] += splits.values()
    rows = []
    for k, run in splits.items():
        update, step = (f"{median_of(run, key, warmup):.3f}" for key in ("update_s", "step_s"))
        rows.append([k, P * n // k, update, step, load_note(run)])
    print_table(
        f"TRL's update split into passes ({args.probe_steps} steps, first {warmup} dropped)",
        ["passes", "completions per pass", "median update s", "median step s", "load"],
        rows,
    )
    passes = min(splits, key=lambda k: median_of(splits[k], "step_s", warmup))
    print(
        f"TRL's fastest split here: {passes} pass(es) of {P * n // passes} completions; every TRL run below uses it",
        flush=True,
    )
    results["trl_passes"] = passes

    print("\nTRL engines: trying each of TRL's generation modes for a few steps ...", flush=True)
    probes = {
        e: splits[passes]
        if e == "generate"
        else run_trl(
            args, inputs, f"probe-trl-{e}", e, n, L, args.probe_steps, args.seed, passes=passes, must_work=False
        )
        for e in args.trl_engines
    }
    results["runs"] += [run for e, run in probes.items() if e != "generate"]
    rows = []
    for engine, run in probes.items():
        works = bool(kept(run, warmup))
        step = f"{median_of(run, 'step_s', warmup):.3f}" if works else "-"
        peak = f"{max((r['rss_gb'] for r in run['records']), default=0):.2f}" if works else "-"
        error = "" if works else run.get("error", "no steps were recorded")
        rows.append([engine, "yes" if works else "no", step, peak, load_note(run), error])
    print_table(
        f"TRL engines on this machine ({args.probe_steps} steps, first {warmup} dropped)",
        ["engine", "works", "median step s", "peak RSS GiB", "load", "error"],
        rows,
    )
    working = {e: median_of(r, "step_s", warmup) for e, r in probes.items() if kept(r, warmup)}
    if "generate" not in working:
        raise SystemExit(
            f"TRL's plain transformers generation failed: {probes['generate'].get('error')}; "
            f"log: {os.path.join(args.work_dir, 'runs', 'probe-trl-generate', 'log.txt')}"
        )
    trl_best = min(working, key=working.get)
    print(f"TRL's best here: {trl_best}", flush=True)
    return passes, trl_best


def run_rounds(args, inputs, passes, trl_best, results):
    """Every system once per round, the order rotated each round. Round i samples with seed + i - 1 on
    both sides (and takes the prompts in that seed's order): one seed would make every round draw the
    same samples, and a single draw of 16 x 8 answers per step has a mean length that is off by a few
    percent either way, so the tokens per step would differ between the systems by chance."""
    n, L = args.group_size, args.response_length
    systems = (["ours-hf"] if args.ours_hf else []) + ["trl-generate", "ours-vllm"]
    systems += [f"trl-{trl_best}"] if trl_best != "generate" else []
    by_system = {s: [] for s in systems}
    for i in range(args.rounds):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for system in order:
            who, engine = system.split("-", 1)
            name = f"round{i + 1}-{system}"
            print(f"round {i + 1}/{args.rounds}: {system} ...", end=" ", flush=True)
            if who == "ours":
                run = run_ours(args, inputs, name, engine, n, L, args.steps, args.seed + i)
            else:
                run = run_trl(args, inputs, name, engine, n, L, args.steps, args.seed + i, passes=passes)
            run["round"] = i + 1
            by_system[system].append(run)
            results["runs"].append(run)
            print(
                f"median step {median_of(run, 'step_s', args.warmup):.3f} s, whole run {run['wall_s']:.0f} s, {load_note(run)}",
                flush=True,
            )
    return by_system


# ----------------------------------------------------------------------------------------------
# The tables


def print_speed(args, by_system, trl_best, results):
    """Step time and throughput of every system, then each comparison's speedup per round."""
    w = args.warmup
    summary = {s: summarize(runs, w) for s, runs in by_system.items()}
    results["summary"] = summary
    rows = []
    for s, v in summary.items():
        spreads = [fmt_spread(v["step_s"]), fmt_spread(v["tok_per_s"], 0), fmt_spread(v["gen_tok_per_s"], 0)]
        rows.append([s, *spreads, f"{v['gen_tokens']['median']:.0f}", f"{v['rss_gb']:.2f}"])
    print_table(
        f"step time and throughput, {args.rounds} runs each, {args.steps - w} steps per run kept: median [IQR] (min-max)",
        ["system", "step s", "generated tok/s (whole step)", "tok/s in generation", "tokens/step", "peak RSS GiB"],
        rows,
        note="tokens/step: generated tokens per step, EOS included (equal work means these agree).",
    )
    comparisons = [("1. apples to apples (transformers generation)", "ours-hf", "trl-generate")] if args.ours_hf else []
    comparisons += [("2. each at its best", "ours-vllm", f"trl-{trl_best}")]
    results["speedups"] = {}
    for title, ours, peer in comparisons:
        pairs = list(zip(by_system[ours], by_system[peer]))
        ratios = [median_of(b, "step_s", w) / median_of(a, "step_s", w) for a, b in pairs]
        results["speedups"][ours + "/" + peer] = ratios
        rows = [
            [a["round"], f"{median_of(a, 'step_s', w):.3f}", f"{median_of(b, 'step_s', w):.3f}", f"{r:.2f}x"]
            for (a, b), r in zip(pairs, ratios)
        ]
        s = stats(ratios)
        rows.append(["all", "", "", f"median {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"])
        print_table(
            f"{title}: {ours} vs {peer}, per round (speedup = {peer} step / {ours} step)",
            ["round", f"{ours} s", f"{peer} s", "speedup"],
            rows,
        )


def print_update_mfu(args, model_dir, by_system, rates, results):
    """How well the update uses the machine: model FLOPs over time against the best matmul rate measured."""
    rate, n_matmul = max(rates), matmul_params(model_dir)
    mfu = {
        system: update_mfu(by_system[system], args.warmup, n_matmul, rate)
        for system in ("ours-vllm", "ours-hf", "trl-generate")
        if system in by_system
    }
    results["update_mfu"] = dict(
        matmul_rate_gflops=[r / 1e9 for r in rates], matmul_params=dict(body=n_matmul[0], head=n_matmul[1]), systems=mfu
    )
    rows = []
    for k, v in mfu.items():
        numbers = [f"{v['tokens']:.0f}", f"{v['gflop']:.1f}", f"{v['update_s']:.3f}", f"{v['gflops']:.1f}"]
        rows.append([k, *numbers, f"{100 * v['mfu']:.0f}%"])
    print_table(
        f"the update's model-FLOPs utilisation (MFU) against the measured {args.dtype} matmul rate, {rate / 1e9:.0f} GFLOP/s "
        f"(2048^3 products on {args.threads} threads; {', '.join(f'{r / 1e9:.0f}' for r in rates)} before and after the rounds)",
        ["system", "tokens the update computes", "model GFLOP", "update s", "GFLOP/s", "MFU"],
        rows,
        note=f"model FLOPs = 6 x ({n_matmul[0] / 1e6:.2f}M block weights x real tokens (prompt + answer) + {n_matmul[1] / 1e6:.2f}M "
        "head weights x answer tokens). TRL computes on padding "
        "too, to the longest sequence of the batch; that work is not counted.",
    )


OURS_PHASES = [
    ("gen_s", "generation"),
    ("reward_s", "reward"),
    ("logprob_s", "log-probs (old + ref)"),
    ("update_s", "update (fwd+bwd+AdamW)"),
    ("sync_s", "weight sync"),
]
TRL_PHASES = [
    ("gen_s", "generation"),
    ("reward_s", "decode, reward, advantages"),
    ("update_s", "update (fwd+bwd+AdamW)"),
]


def print_phases(args, by_system):
    """Where each step's time goes: train_grpo.py's timing_s/*, and stopwatches in trl_worker.py."""
    for system in [s for s in ("ours-vllm", "ours-hf") if s in by_system]:
        print_table(
            f"where {system}'s step goes (median over kept steps of all rounds)",
            ["phase", "median s", "median share", "max share"],
            phase_rows(by_system[system], args.warmup, OURS_PHASES),
        )
    print_table(
        "where trl-generate's step goes (stopwatches around GRPOTrainer's generation and rollout methods)",
        ["phase", "median s", "median share", "max share"],
        phase_rows(by_system["trl-generate"], args.warmup, TRL_PHASES),
    )


def verdict(worst, median, goal):
    return "met" if worst >= goal else ("met in the median" if median >= goal else "missed")


def print_targets(args, by_system, trl_best, results):
    """The speedups and the weight sync's share of the step against what we aim for (SETUPS' target)."""
    best = stats(results["speedups"][f"ours-vllm/trl-{trl_best}"])
    goal = SETUPS[args.setup]["target"]
    sync = [r["sync_s"] / r["step_s"] for run in by_system["ours-vllm"] for r in kept(run, args.warmup)]
    targets = [
        [
            f"ours-vllm >= {goal:g}x faster than TRL at its best",
            f"median {best['median']:.2f}x, worst round {best['min']:.2f}x",
            verdict(best["min"], best["median"], goal),
        ]
    ]
    if args.ours_hf:
        hf = stats(results["speedups"]["ours-hf/trl-generate"])
        targets.append(
            [
                "ours-hf never slower than TRL (transformers)",
                f"median {hf['median']:.2f}x, worst round {hf['min']:.2f}x",
                verdict(hf["min"], hf["median"], 1),
            ]
        )
    sync_max, sync_median = max(sync), statistics.median(sync)
    targets.append(
        [
            "weight sync < 5% of ours-vllm's step",
            f"median {100 * sync_median:.1f}%, max {100 * sync_max:.1f}%",
            "met" if sync_max < 0.05 else ("met in the median" if sync_median < 0.05 else "missed"),
        ]
    )
    results["targets"] = targets
    print_table(f"targets, setup {args.setup}", ["target", "measured", "verdict"], targets)


def check_trust(results):
    """Can these figures be trusted: equal optimizer steps, a quiet machine."""
    trl_updates = {
        r["optimizer_steps"] for run in results["runs"] if run["system"].startswith("trl") for r in run["records"]
    }
    if trl_updates != {1}:
        print(f"warning: TRL made {sorted(trl_updates)} optimizer steps per step, not 1: the work was not equal")
    results["disturbed_runs"] = warn_disturbed(results["runs"])


# ----------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    check_environment(args.install)
    shutil.rmtree(os.path.join(args.work_dir, "runs"), ignore_errors=True)  # this benchmark's runs, none older
    os.makedirs(args.work_dir, exist_ok=True)
    t_start = time.perf_counter()
    info = print_versions()
    inputs = prepare_inputs(args)
    print_work(args, inputs)
    results = dict(config=vars(args), versions=info, runs=[])
    rates = [matmul_rate(args.threads, args.dtype)]  # again after the comparison: the machine's clock drifts

    passes, trl_best = probe_trl(args, inputs, results)
    by_system = run_rounds(args, inputs, passes, trl_best, results)
    print_speed(args, by_system, trl_best, results)
    rates.append(matmul_rate(args.threads, args.dtype))
    print_update_mfu(args, inputs[0], by_system, rates, results)
    print_phases(args, by_system)
    print_targets(args, by_system, trl_best, results)
    check_trust(results)
    print(
        f"\nwhole benchmark: {time.perf_counter() - t_start:.0f} s; every run's files are under {os.path.join(args.work_dir, 'runs')}"
    )
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
