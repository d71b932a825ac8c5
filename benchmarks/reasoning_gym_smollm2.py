"""SmolLM2-135M-Instruct learns a reasoning-gym task (README: "reasoning-gym's tasks", docs/reasoning_gym.md):
the curve of a finished run of README's command, as a table and a plot.

    python benchmarks/reasoning_gym_smollm2.py runs/smollm2_rgym [--plot docs/reasoning_gym_smollm2.png]

Prints, for each task in the run's validation metrics, the held-out greedy accuracy at every validation against
the training time so far (the sum of timing_s/step), the curriculum level where --curriculum logged one, the
median step and the time the run first gained +0.30 over step 0. The plot has held-out accuracy against training
time, and the train reward against the step.
"""

import argparse
import statistics

from common import read_metrics, save_plot

PREFIX = "val-core/reasoning_gym/"


def curves(rows):
    """{task: [(step, training seconds so far, held-out accuracy, level or None)]}."""
    out, elapsed = {}, 0.0
    for r in rows:
        elapsed += r.get("timing_s/step", 0.0)
        for key, value in r.items():
            if key.startswith(PREFIX) and "/reward/mean@" in key:
                task = key[len(PREFIX) :].split("/")[0]
                out.setdefault(task, []).append((r["step"], elapsed, value, r.get(f"curriculum/{task}/level")))
    return out


def plot(points, rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for task, line in points.items():
        left.plot([t / 60 for _, t, _, _ in line], [a for _, _, a, _ in line], marker="o", label=task)
    train = [r for r in rows if "critic/score/mean" in r]
    right.plot([r["step"] for r in train], [r["critic/score/mean"] for r in train])
    left.set(xlabel="training time (min)", ylabel="held-out greedy accuracy", title="held-out accuracy")
    right.set(xlabel="step", ylabel="mean reward", title="train reward (64 samples a step)")
    left.legend()
    save_plot(fig, (left, right), title, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a finished (or stopped) run of README's reasoning-gym command")
    parser.add_argument("--plot", default="docs/reasoning_gym_smollm2.png")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct on a reasoning-gym task, README's command")
    args = parser.parse_args()
    rows = read_metrics(args.run_dir)
    points = curves(rows)
    for task, line in points.items():
        print(f"{task}: step, training time, held-out accuracy" + (", level" if line[0][3] is not None else ""))
        for step, t, accuracy, level in line:
            print(f"  {step:4d} {t:6.0f} s {accuracy:.3f}" + (f"  level {level}" if level is not None else ""))
        gained = next((t for _, t, a, _ in line if a >= line[0][2] + 0.30 - 1e-9), None)
        print("  +0.30 over step 0: " + (f"after {gained:.0f} s of training" if gained is not None else "not reached"))
    steps = [r["timing_s/step"] for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r]
    if steps:
        print(f"median step (steps 2..): {statistics.median(steps):.1f} s over {len(steps) + 1} steps")
    plot(points, rows, args.plot, args.title)


if __name__ == "__main__":
    main()
