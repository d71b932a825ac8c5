"""Each --distill-loss on the demo, a student far from its teacher: held-out accuracy against GRPO alone.

    python benchmarks/distill_demo.py [--out-dir runs/distill_demo] [--steps 40] [--modes k1,forward_kl_topk]

The teacher is the demo itself trained for --teacher-steps (100) steps; each student is a fresh demo model (the
teacher's own initial weights) trained for --steps steps with the teacher beside the reward (--distill-coef 1;
forward_kl_topk with --topk 20, all of the demo's 20 words), one run per mode, one after the other on 1 rank, each with
--student-flags (default: --lr 2e-3 --mini-batch-size 32, two updates a step: a dense teacher takes a larger step
than a sparse reward). GRPO alone runs twice: the demo's command, and with the same --student-flags. Prints the
held-out greedy accuracy (val-core/synthetic/digits/reward/mean@1) every 10 steps, the step each first reaches 0.9,
and the training time (the sum of timing_s/step). A run already finished in --out-dir is read, not rerun.
"""

import argparse
import os
import sys

from common import DEMO_MEASURED, REPO, read_metrics, run_train_grpo

METRIC = "val-core/synthetic/digits/reward/mean@1"


def run(out_dir, flags, what):
    """One demo run into out_dir unless it has finished there; returns its metrics."""
    if not os.path.isdir(os.path.join(out_dir, "final_model")):
        print(f"running {what} ...", flush=True)
        run_train_grpo(["--out-dir", out_dir, *DEMO_MEASURED, *flags], what, cwd=REPO)
    return read_metrics(out_dir)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="runs/distill_demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--teacher-steps", type=int, default=100)
    p.add_argument("--modes", default="k1,forward_kl_topk", help="comma-separated --distill-loss values")
    p.add_argument("--topk", type=int, default=20, help="forward_kl_topk's --distill-topk (the demo has 20 words)")
    p.add_argument(
        "--student-flags", default="--lr 2e-3 --mini-batch-size 32", help="every student's, and GRPO's second run"
    )
    a = p.parse_args()
    out = os.path.abspath(a.out_dir)
    run(os.path.join(out, "teacher"), ["--max-steps", str(a.teacher_steps)], "the teacher (the demo)")
    teacher = os.path.join(out, "teacher", "final_model")
    student = a.student_flags.split()
    runs = {"GRPO alone": [], f"GRPO alone, {a.student_flags}": student}
    for m in a.modes.split(","):
        topk = ["--distill-topk", str(a.topk)] if m == "forward_kl_topk" else []
        runs[f"--distill-loss {m}"] = ["--teacher", teacher, "--distill-loss", m, *topk, *student]
    rows = []
    for name, flags in runs.items():
        slug = name.replace("--distill-loss ", "").replace(" ", "_").replace(",", "").replace("-", "")
        metrics = run(os.path.join(out, slug), ["--max-steps", str(a.steps), *flags], name)
        curve = {r["step"]: r[METRIC] for r in metrics if METRIC in r}
        first = next((s for s, v in sorted(curve.items()) if v >= 0.9), None)
        seconds = sum(r.get("timing_s/step", 0.0) for r in metrics)
        rows.append((name, [curve.get(s) for s in range(10, a.steps + 1, 10)], first, seconds))
    print(f"\n| run | {' | '.join(f'step {s}' for s in range(10, a.steps + 1, 10))} | first at 0.9 | training time |")
    print("| --- |" + " ---: |" * (a.steps // 10) + " --- | ---: |")
    for name, values, first, seconds in rows:
        cells = " | ".join("" if v is None else f"{v:.3f}" for v in values)
        print(f"| {name} | {cells} | {f'step {first}' if first else 'no'} | {seconds:.0f} s |")


if __name__ == "__main__":
    sys.exit(main())
