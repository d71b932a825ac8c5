"""What --reward-model adds to a step: the demo with and without a reward model of the policy's size.

    python benchmarks/reward_model_cost.py [--out-dir runs/rm_cost] [--rounds 3] [--steps 40]

The reward model is the tiny demo model's config with a one-output classification head, random
weights (models.build_random_model(..., reward_model=True)): the same size as the policy. Each
round runs the demo (`torchrun --nproc_per_node=1 train_grpo.py`, no validation, no checkpoints)
without it, then with `--reward-model` at weight 0 (it runs, but the runs stay identical); the order
alternates between rounds. Printed: the median
over steps 2.. of timing_s/step and timing_s/reward per run, and the ratio of the medians of the
two settings. Run it on an otherwise idle machine.
"""

import argparse
import os
import statistics
import sys

from common import REPO, read_metrics, run_train_grpo

sys.path.insert(0, REPO)
from models import build_random_model, build_tiny_model  # noqa: E402
from tasks.digits import TASK_WORDS  # noqa: E402


def run(run_dir, steps, flags):
    run_train_grpo(
        ["--out-dir", run_dir, "--max-steps", str(steps), "--test-freq", "-1", "--save-freq", "-1", *flags], run_dir
    )
    rows = read_metrics(run_dir)[1:]  # step 1 warms up
    return statistics.median(r["timing_s/step"] for r in rows), statistics.median(r["timing_s/reward"] for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="runs/rm_cost")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    tiny = build_tiny_model(os.path.join(args.out_dir, "tiny"), TASK_WORDS)
    rm = build_random_model(os.path.join(args.out_dir, "rm"), tiny, seed=1, reward_model=True)
    # weight 0: the model scores every sample (and is logged) but leaves the reward as it is, so both
    # settings train the same policy on the same samples and differ by the model's cost alone
    settings = {"without": [], "with": ["--reward-model", rm, "--reward-model-weight", "0"]}
    results = {name: [] for name in settings}
    for r in range(args.rounds):
        for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
            step, reward = run(os.path.join(args.out_dir, f"{name}_{r}"), args.steps, settings[name])
            results[name].append(step)
            print(
                f"round {r} {name:>7} the reward model: median step {step * 1000:.0f} ms, reward {reward * 1000:.1f} ms"
            )
    without, with_rm = statistics.median(results["without"]), statistics.median(results["with"])
    print(f"median step: without {without * 1000:.0f} ms, with {with_rm * 1000:.0f} ms: +{with_rm / without - 1:.1%}")
    print("per round: " + ", ".join(f"+{b / a - 1:.1%}" for a, b in zip(results["without"], results["with"])))


if __name__ == "__main__":
    main()
