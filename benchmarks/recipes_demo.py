"""The demo under each recipe of the GRPO family (README: "Recipes"), one run after another.

    python benchmarks/recipes_demo.py [--out-dir runs/recipes] [--only grpo,dapo]

Each run is `torchrun --nproc_per_node=1 train_grpo.py` with the demo's defaults as they were measured
(common.DEMO_MEASURED: lr 5e-4, 8 samples, 200 steps) and the recipe's flags. Printed per recipe: held-out
greedy accuracy (val-core/synthetic/digits/reward/mean@1) at steps 20, 40 and 200, the first step that reaches 0.9, the training time to it (the sum of
timing_s/step, validation excluded), the prompts generated to it (dynamic sampling generates more
than it trains on), and the whole command's wall time. Run it on an otherwise idle machine.
"""

import argparse
import os
import subprocess
import time

from common import DEMO_MEASURED, TRAIN_GRPO, read_metrics

RECIPES = {
    "grpo": [],
    "dr_grpo": "--no-norm-adv-by-std --loss-agg seq-mean-token-sum-norm".split(),
    "dapo": "--filter-groups --clip-high 0.28 --overlong-buffer-len 2".split(),
    "filter_groups": ["--filter-groups"],
    "gspo": "--loss-mode gspo --clip-low 3e-4 --clip-high 4e-4".split(),
    "rloo": "--adv-estimator rloo".split(),
    "reinforce_pp": "--adv-estimator reinforce_plus_plus_baseline".split(),
    "mask_truncated": ["--mask-truncated"],
    "cispo": "--loss-mode cispo".split(),
    "sapo": "--loss-mode sapo".split(),
    "gmpo": "--loss-mode geo_mean --clip-low 0.4 --clip-high 0.4".split(),
    "clip_cov": "--loss-mode clip_cov".split(),
    "kl_cov": "--loss-mode kl_cov".split(),
    "grpo_passk": "--adv-estimator grpo_passk".split(),
}
METRIC = "val-core/synthetic/digits/reward/mean@1"


def summary(run_dir, wall):
    rows = read_metrics(run_dir)
    acc = {r["step"]: r[METRIC] for r in rows if METRIC in r}
    elapsed, prompts, reached = 0.0, 0, None
    for r in rows:
        if r["step"] == 0:
            continue
        elapsed += r["timing_s/step"]
        prompts += 64 * r.get("filter/gen_batches", 1)
        if reached is None and r.get(METRIC, 0) >= 0.9:
            reached = (r["step"], elapsed, prompts)
    at = " ".join(f"{s}:{acc.get(s, float('nan')):.3f}" for s in (20, 40, 200))
    to = f"step {reached[0]}, {reached[1]:.0f} s, {reached[2]} prompts" if reached else "not reached"
    return f"{at} | 0.9 at {to} | command {wall:.0f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="runs/recipes")
    parser.add_argument("--only", default="", help="comma-separated recipe names (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RECIPES)
    for name in names:
        run_dir = os.path.join(args.out_dir, name)
        start = time.perf_counter()
        proc = subprocess.run(
            [*TRAIN_GRPO, "--out-dir", run_dir, *DEMO_MEASURED, *RECIPES[name]], capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        print(
            f"{name:15s} {' '.join(RECIPES[name]) or '(defaults)'}\n  {summary(run_dir, time.perf_counter() - start)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
