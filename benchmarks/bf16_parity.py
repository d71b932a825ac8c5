"""Learning parity of bf16 and fp32 on the real SmolLM2 example (README: "A real pretrained model"),
one run after the other, and both curves in one plot.

    python models.py smollm2 --out models/smollm2 && python data_prep.py multiply --out data/multiply
    python benchmarks/bf16_parity.py [--out-dir runs/bf16_parity] [--plot docs/smollm2_bf16_parity.png]

Both runs are README's SmolLM2 command (8 prompts x 8 samples, 18 steps, held-out validation every
3 steps), with --dtype fp32 and --dtype bf16. Printed for each: held-out greedy accuracy at every
validation against the training time so far (the sum of timing_s/step), the median step and its
phases, and the engine-vs-trainer gap. Then the time each run took to gain +30 points over step 0.
The plot has held-out accuracy against training time and the train reward against the step.
Run it on an otherwise idle machine; a run already finished in --out-dir is read, not rerun.
"""

import argparse
import os
import statistics

from common import (  # README's SmolLM2 command, as lora_smollm2.py runs it
    held_out_curve,
    read_metrics,
    run_smollm2,
    save_plot,
)

DTYPES = ("fp32", "bf16")


def time_to_gain(points, gain):
    """Training seconds at the first validation at least `gain` above step 0's accuracy, or None."""
    return next((t for _, t, a in points if a >= points[0][2] + gain - 1e-9), None)


def plot(curves, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for dtype, points in curves.items():
        left.plot([t / 60 for _, t, _ in points], [a for *_, a in points], marker="o", label=dtype)
        train = [r for r in rows[dtype] if "critic/score/mean" in r]
        right.plot([r["step"] for r in train], [r["critic/score/mean"] for r in train], label=dtype)
    left.set(xlabel="training time (min)", ylabel="held-out greedy accuracy", title="held-out (46 questions)")
    right.set(xlabel="step", ylabel="mean reward", title="train reward (64 samples a step)")
    for ax in (left, right):
        ax.legend()
    save_plot(fig, (left, right), "SmolLM2-135M-Instruct on multiply, README's command: fp32 against bf16", path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="runs/bf16_parity")
    parser.add_argument("--plot", default="docs/smollm2_bf16_parity.png")
    parser.add_argument("--gain", type=float, default=0.30, help="the held-out gain whose time is compared")
    args = parser.parse_args()
    rows, curves = {}, {}
    for dtype in DTYPES:
        run_dir = os.path.join(args.out_dir, dtype)
        run_smollm2(run_dir, ["--lr", "1e-5", "--dtype", dtype])
        rows[dtype] = read_metrics(run_dir)
        curves[dtype] = held_out_curve(run_dir)
    for dtype in DTYPES:
        points, steps = curves[dtype], [r for r in rows[dtype] if r.get("step", 0) >= 2 and "timing_s/step" in r]
        print(f"\n{dtype}: held-out accuracy: " + ", ".join(f"step {s} {t:.0f} s {a:.3f}" for s, t, a in points))
        med = {k: statistics.median(r[f"timing_s/{k}"] for r in steps) for k in ("step", "gen", "update_actor")}
        print(
            f"  median step (steps 2..): {med['step']:.1f} s, generation {med['gen']:.1f} s, update {med['update_actor']:.1f} s"
        )
        gap = {k: max(r[f"training/rollout_{k}"] for r in steps) for k in ("probs_diff_mean", "logprob_diff_max")}
        print(f"  engine-vs-trainer gap, max over steps: probs_diff_mean {gap['probs_diff_mean']:.2e}, "
              f"logprob_diff_max {gap['logprob_diff_max']:.2e}")  # fmt: skip
        reached = time_to_gain(points, args.gain)
        print(
            f"  +{args.gain:.2f} over step 0: " + (f"after {reached:.0f} s of training" if reached else "not reached")
        )
    fp32, bf16 = curves["fp32"][-1], curves["bf16"][-1]
    print(f"\nfinal held-out accuracy: fp32 {fp32[2]:.3f} in {fp32[1]:.0f} s, bf16 {bf16[2]:.3f} in {bf16[1]:.0f} s "
          f"(bf16 / fp32 training time {bf16[1] / fp32[1]:.2f})")  # fmt: skip
    plot(curves, rows, args.plot)


if __name__ == "__main__":
    main()
