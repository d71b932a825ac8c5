"""Synchronous against asynchronous GRPO on 2 CPU ranks, side by side: samples/s and tokens/s, where
each step's time goes, and the response lengths that benchmarks/async_model.py calibrates on.

    python benchmarks/async_throughput.py           # both shapes, 3 systems: about 45 min on 2 cores
    python benchmarks/async_throughput.py --shapes multiply --systems sync,stream

Shapes (SmolLM2-135M-Instruct, --dtype auto, vLLM; models/smollm2, data/ as README prepares them):
  multiply  the README's SmolLM2 command: 8 prompts x 8 samples, answers up to 32 tokens (the update dominates)
  gsm8k     GSM8K prompts, 4 x 4 samples, answers up to 512 tokens (lengths vary most)
Systems, each a fresh `torchrun --nproc_per_node=2 train_grpo.py`, the same prompts and seeds:
  sync    both ranks generate, then both train (--max-staleness 0): today's loop
  async   rank 1 only generates, rank 0 only trains, one step off-policy (--rollout-ranks 1 --max-staleness 1)
  stream  async, group by group, new weights loaded mid-answer (async + --stream-rollouts)
A step: trainer rank 0's wall time, the first --warmup left out. Phases (async, stream): gen is the
rollout rank's, rollout_idle its wait for weights, wait_rollout the trainer's. --out: every step, JSON.
"""

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import fresh_dir, print_table, print_versions, read_metrics, run_process, write_json  # noqa: E402

SHAPES = {
    "multiply": (
        "--train-data data/multiply/train.parquet --val-data data/multiply/test.parquet --prompt-batch-size 8 "
        "--mini-batch-size 8 --group-size 8 --max-prompt-length 128 --max-response-length 32 --lr 1e-5"
    ),
    "gsm8k": (
        "--train-data data/gsm8k/train.parquet --val-data data/gsm8k/test.parquet --prompt-batch-size 4 "
        "--mini-batch-size 4 --group-size 4 --max-prompt-length 512 --max-response-length 512 --lr 1e-6"
    ),
}
SYSTEMS = {
    "sync": "--max-staleness 0",
    "async": "--rollout-ranks 1 --max-staleness 1",
    "stream": "--rollout-ranks 1 --max-staleness 1 --stream-rollouts",
}
COMMON = "--model models/smollm2 --kl-coef 0 --dtype auto --rollout vllm --test-freq -1 --save-freq -1 --no-save-model"
PHASES = ["gen", "reward", "rollout_idle", "wait_rollout", "old_log_prob", "update_actor", "update_weights"]


def run(shape, system, steps, root):
    out = fresh_dir(os.path.join(root, f"{shape}_{system}"))
    flags = f"{COMMON} {SHAPES[shape]} {SYSTEMS[system]} --max-steps {steps} --out-dir {out}".split()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_grpo.py", *flags]
    ok, error, load = run_process(cmd, out, threads=1)
    if not ok:
        raise SystemExit(f"{shape} {system} failed: {error} (see {out}/log.txt)")
    return [r for r in read_metrics(out) if r["step"] > 0], load


def summary(records, warmup, samples_per_step):
    kept = [r for r in records if r["step"] > warmup]
    step = statistics.median(r["timing_s/step"] for r in kept)
    tokens = statistics.median(r["perf/total_num_tokens"] for r in kept)
    phases = {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in kept) for p in PHASES}
    lengths = dict(mean=statistics.mean(r["response_length/mean"] for r in kept))
    lengths["max"] = statistics.mean(r["response_length/max"] for r in kept)
    return dict(
        step_s=step, samples_per_s=samples_per_step / step, tokens_per_s=tokens / step, phases=phases, lengths=lengths
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="multiply,gsm8k")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="sync comes first: the ratios are against it")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the medians")
    p.add_argument("--work-dir", default="runs/bench_async")
    p.add_argument("--out", default="runs/bench_async/results.json")
    a = p.parse_args()
    results = dict(machine=print_versions(), shapes={})
    for shape in a.shapes.split(","):
        prompts, n = (8, 8) if shape == "multiply" else (4, 4)
        runs = {}
        for system in a.systems.split(","):
            records, load = run(shape, system, a.steps, a.work_dir)
            runs[system] = dict(records=records, other_load=load, summary=summary(records, a.warmup, prompts * n))
        results["shapes"][shape] = runs
        base, names = next(iter(runs.values()))["summary"], list(runs)
        rows = []
        for name in names:
            r = runs[name]["summary"]
            ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x"
            rows.append([name, f"{r['step_s']:.2f}", f"{r['samples_per_s']:.3f}", f"{r['tokens_per_s']:.1f}", ratio])
            rows[-1].append(f"{runs[name]['other_load']:.0%}")
        header = ["system", "step s", "samples/s", "tokens/s", f"vs {names[0]}", "other load"]
        print_table(f"{shape}: 2 CPU ranks, medians of steps {a.warmup + 1}-{a.steps}", header, rows)
        phase_rows = [[ph, *(f"{runs[name]['summary']['phases'][ph]:.2f}" for name in names)] for ph in PHASES]
        print_table(f"{shape}: where a step's time goes (median s)", ["phase", *names], phase_rows)
    write_json(a.out, results)


if __name__ == "__main__":
    main()
