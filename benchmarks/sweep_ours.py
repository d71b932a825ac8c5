"""How our step's time and peak memory grow with the group size n and with the response length:
ours with the vLLM engine, one run per point, on bench_vs_trl.py's work.

    python benchmarks/sweep_ours.py                                    # n 4,8,16 and lengths 16,32,64: 5 runs
    python benchmarks/sweep_ours.py --sweep-n 4,8 --sweep-len "" --steps 6
    python benchmarks/sweep_ours.py --hidden 256 --layers 4 --response-length 128 ...   # a larger model

The points are (n, --response-length) for every n of --sweep-n and (--group-size, length) for every
length of --sweep-len. Each run is train_grpo.py in a fresh process with the settings bench_vs_trl.py
gives it (runners.run_ours: one optimizer step per rollout, no KL, no validation or checkpoints); the
first --warmup steps are dropped and the table has medians of the rest. Peak memory is the process's
peak resident set on CPU, vLLM's KV cache included.
"""

import argparse
import os
import shutil
import sys
import time

from common import (
    REPO,
    load_note,
    median_of,
    parse_ints,
    print_table,
    print_versions,
    summarize,
    warn_disturbed,
    write_json,
)
from runners import add_work_args, check_work_args, prepare_inputs, run_ours

sys.path.insert(0, REPO)  # data_prep, models


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_work_args(p, work_dir=os.path.join(REPO, "runs", "sweep_ours"))
    p.add_argument("--sweep-n", default="4,8,16", help="group sizes to run (comma-separated; empty: none)")
    p.add_argument("--sweep-len", default="16,32,64", help="response lengths to run (comma-separated; empty: none)")
    p.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    a = p.parse_args(argv)
    check_work_args(p, a)
    a.sweep_n = parse_ints(p, "--sweep-n", a.sweep_n)
    a.sweep_len = parse_ints(p, "--sweep-len", a.sweep_len)
    if any(n < 2 for n in a.sweep_n):
        p.error("every --sweep-n value must be at least 2")
    if any(x < 1 for x in a.sweep_len):
        p.error("response lengths must be at least 1")
    return a


def main():
    args = parse_args()
    shutil.rmtree(os.path.join(args.work_dir, "runs"), ignore_errors=True)  # this benchmark's runs, none older
    os.makedirs(args.work_dir, exist_ok=True)
    t_start = time.perf_counter()
    info = print_versions()
    inputs = prepare_inputs(args)
    results = dict(config=vars(args), versions=info, runs=[])

    P, n, L, w = args.prompts, args.group_size, args.response_length, args.warmup
    points = sorted({(x, L) for x in args.sweep_n} | {(n, x) for x in args.sweep_len})
    rows = []
    for pn, pl in points:
        print(f"sweep: ours-vllm n={pn} response length={pl} ...", end=" ", flush=True)
        run = run_ours(args, inputs, f"sweep-n{pn}-len{pl}", "vllm", pn, pl, args.steps, args.seed)
        results["runs"].append(run)
        print(f"median step {median_of(run, 'step_s', w):.3f} s, {load_note(run)}", flush=True)
        s = summarize([run], w)
        step, tokens = s["step_s"], s["gen_tokens"]["median"]
        phases = [f"{median_of(run, k, w):.3f}" for k in ("gen_s", "update_s", "sync_s")]
        rows.append(
            [pn, pl, P * pn, f"{tokens:.0f}", f"{step['median']:.3f}", f"{step['min']:.3f}-{step['max']:.3f}", *phases]
            + [f"{s['gen_tok_per_s']['median']:.0f}", f"{s['rss_gb']:.2f}"]
        )
    if rows:
        print_table(
            f"ours-vllm as n and response length grow ({args.steps} steps per point, first {w} dropped; medians)",
            ["n", "max len", "completions", "tokens/step", "step s", "step min-max", "gen s", "update s", "sync s"]
            + ["tok/s in gen", "peak RSS GiB"],
            rows,
        )
    results["disturbed_runs"] = warn_disturbed(results["runs"])
    where = os.path.join(args.work_dir, "runs")
    print(f"\nwhole sweep: {time.perf_counter() - t_start:.0f} s; every run's files are under {where}")
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
