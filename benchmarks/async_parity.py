"""Learning parity: does one-step-off-policy GRPO (--max-staleness 1) learn as fast per step as the
synchronous loop? README's SmolLM2 command on `multiply`, validated after every step, at S = 0 and 1.

    python benchmarks/async_parity.py            # about 18 min on the 2-core EPYC

The target: held-out accuracy reaches the synchronous run's 0.7 within 20% more steps at S = 1. Both runs
are 1 rank, bf16 where the CPU has it (--dtype auto), vLLM, the same prompts and seeds; S = 1 trains each
step on the samples of the policy one update older, with the decoupled loss (--tis-cap 2); a third run,
S = 0 with --tis-cap 2, has the same loss without the staleness.
"""

import argparse
import os
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
    p.add_argument("--work-dir", default="runs/bench_async_parity")
    a = p.parse_args()
    runs = {"S=0": "--max-staleness 0", "S=0, --tis-cap 2": "--max-staleness 0 --tis-cap 2", "S=1": "--max-staleness 1"}
    curves = {}
    for name, flags in runs.items():
        run_dir = os.path.join(a.work_dir, name.replace("=", "").replace(", --", "_").replace(" ", ""))
        run_smollm2(run_dir, f"--lr 1e-5 --dtype auto --test-freq 1 --max-steps {a.steps} {flags}".split())
        curves[name] = held_out_curve(run_dir)
    rows = [[step, *(f"{c[i][2]:.3f}" for c in curves.values())] for i, (step, _, _) in enumerate(curves["S=0"])]
    first = {name: first_reaching(c, a.target) for name, c in curves.items()}
    verdicts = {
        base: "met" if first["S=1"] and first[base] and first["S=1"] <= 1.2 * first[base] else "missed"
        for base in ("S=0", "S=0, --tis-cap 2")
    }
    note = f"first step at >= {a.target}: {first}; S=1 within 20% more steps than: {verdicts}"
    print_table("held-out accuracy (greedy, 46 questions) after each step", ["step", *curves], rows, note)
    write_json(os.path.join(a.work_dir, "results.json"), dict(curves=curves, first=first, verdicts=verdicts))


if __name__ == "__main__":
    main()
