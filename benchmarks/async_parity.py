"""Learning parity: does one-step-off-policy GRPO (--max-staleness 1) learn as fast per step as the
synchronous loop? README's SmolLM2 command on `multiply`, validated after every step, at S = 0 and 1.

    python benchmarks/async_parity.py            # 3 seeds: about 40 min on the 2-core EPYC

The target: held-out accuracy reaches the synchronous run's 0.7 within 20% more steps at S = 1, per seed
and on the mean over seeds. All runs are 1 rank, bf16 where the CPU has it (--dtype auto), vLLM; S = 1
trains each step on the samples of the policy one update older, with the decoupled loss (--tis-cap 2); a
control, S = 0 with --tis-cap 2 (the same loss without the staleness), runs on the first seed only.
"""

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import held_out_curve, print_table, run_smollm2, write_json  # noqa: E402


def first_reaching(curve, target):
    return next((step for step, _, acc in curve if acc >= target), None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work-dir", default="runs/bench_async_parity")
    a = p.parse_args()
    runs = {"S=0": "--max-staleness 0", "S=1": "--max-staleness 1", "S=0, --tis-cap 2": "--max-staleness 0 --tis-cap 2"}
    curves, first = {}, {}
    for seed in a.seeds:
        for name, flags in runs.items():
            if "tis-cap" in name and seed != a.seeds[0]:
                continue
            key = f"{name}, seed {seed}"
            run_dir = os.path.join(a.work_dir, name.replace("=", "").replace(", --", "_").replace(" ", ""))
            run_dir += f"_seed{seed}" if seed else ""  # seed 0's directories predate --seeds: reused
            flags = f"--lr 1e-5 --dtype auto --test-freq 1 --max-steps {a.steps} --seed {seed} {flags}"
            run_smollm2(run_dir, flags.split())
            curves[key] = held_out_curve(run_dir)
            first[key] = first_reaching(curves[key], a.target)
    steps = [step for step, _, _ in curves[f"S=0, seed {a.seeds[0]}"]]
    mean = {
        name: [
            statistics.mean(c[i][2] for k, c in curves.items() if k.startswith(name + ", seed"))
            for i in range(len(steps))
        ]
        for name in ("S=0", "S=1")
    }
    rows = [
        [step, *(f"{c[i][2]:.3f}" for c in curves.values()), *(f"{m[i]:.3f}" for m in mean.values())]
        for i, step in enumerate(steps)
    ]
    first_mean = {name: next((s for s, v in zip(steps, m) if v >= a.target), None) for name, m in mean.items()}

    def verdict(s1, s0):
        return "met" if s1 and s0 and s1 <= 1.2 * s0 else "missed"

    verdicts = {f"seed {seed}": verdict(first[f"S=1, seed {seed}"], first[f"S=0, seed {seed}"]) for seed in a.seeds}
    verdicts["mean curve"] = verdict(first_mean["S=1"], first_mean["S=0"])
    verdicts["control"] = verdict(first[f"S=1, seed {a.seeds[0]}"], first[f"S=0, --tis-cap 2, seed {a.seeds[0]}"])
    note = f"first step at >= {a.target}: {first}; mean curves: {first_mean}; S=1 within 20% more steps: {verdicts}"
    columns = ["step", *curves, "mean S=0", "mean S=1"]
    print_table("held-out accuracy (greedy, 46 questions) after each step", columns, rows, note)
    out = dict(curves=curves, first=first, mean=mean, first_mean=first_mean, verdicts=verdicts)
    write_json(os.path.join(a.work_dir, "results.json"), out)


if __name__ == "__main__":
    main()
