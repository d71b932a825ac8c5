"""On-policy distillation against GRPO on the real SmolLM2 example (docs/distill.md), one run after the other.

    python benchmarks/opd_smollm2.py --teacher runs/smollm2_multiply/final_model --student models/smollm2 \\
        --data data/multiply [--out-dir runs/opd_smollm2] [--opsd] [--dtype bf16]
    python benchmarks/opd_smollm2.py --dry-run     # the tiny demo model, 2 steps each: the script's own check

Runs README's SmolLM2 command on 1 rank (bf16 by default) three ways: pure OPD (--teacher, --no-reward), GRPO
with the reward alone, and both (--teacher beside the reward, the default k1 term); with --modes M1,M2 one more
run per --distill-loss beside the reward ("both_M", e.g. --modes k3,forward_kl_topk); with --opsd, OPSD: the
student's initial weights as the teacher, reading the question with its answer ("hint") as its prompt. Prints each run's
held-out greedy accuracy against the training time so far (the sum of timing_s/step), the time each first
reaches --target (0.8), and OPD's time over GRPO's; writes the curves to <out-dir>/opd_smollm2.png when
matplotlib is installed. A run already finished in --out-dir is read, not rerun.
"""

import argparse
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from common import REPO, read_metrics, run_train_grpo

# README's SmolLM2 flags (README: "A real pretrained model"); the data and models come from the command line
SMOLLM2 = (
    "--prompt-batch-size 8 --mini-batch-size 8 --group-size 8 --max-prompt-length 128 --max-response-length 32 "
    "--kl-coef 0 --lr 1e-5 --epochs 2 --test-freq 3"
).split()
# --dry-run: the tiny demo model on the digits task, 2 steps of everything
DRY = (
    "--max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 1 --val-max-prompts 16 "
    "--max-prompt-length 32 --max-response-length 4 --kl-coef 0 --lr 5e-4 --rollout hf"
).split()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", help="the trained SmolLM2 (README's GRPO run's final_model)")
    parser.add_argument("--student", help="the base SmolLM2-135M-Instruct (python models.py smollm2)")
    parser.add_argument("--data", help="a directory with multiply's train.parquet and test.parquet")
    parser.add_argument("--out-dir", default="runs/opd_smollm2")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "auto"])
    parser.add_argument("--opsd", action="store_true", help="also run OPSD (the student, shown the answer)")
    parser.add_argument("--modes", default="", help="comma-separated --distill-loss values, each beside the reward")
    parser.add_argument(
        "--only", default="", help="comma-separated runs to run (opd,grpo,both,both_M,opsd); empty: all"
    )
    parser.add_argument("--target", type=float, default=0.8, help="the held-out accuracy to time")
    parser.add_argument("--dry-run", action="store_true", help="the tiny demo model, 2 steps each")
    args = parser.parse_args(argv)
    if not args.dry_run and not (args.teacher and args.student and args.data):
        parser.error("--teacher, --student and --data are required (or --dry-run)")
    for flag in ("teacher", "student", "data"):
        if getattr(args, flag) and not os.path.isdir(getattr(args, flag)):
            parser.error(f"--{flag} {getattr(args, flag)}: no such directory")
    return args


def dry_inputs(out_dir):
    """--dry-run's inputs: two tiny demo models with one tokenizer (student seed 0, teacher seed 1) and the
    digits task's data. Returns (teacher, student, data directory)."""
    sys.path.insert(0, REPO)
    import data_prep
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    teacher, student = (os.path.join(out_dir, name) for name in ("tiny_teacher", "tiny_student"))
    build_tiny_model(teacher, TASK_WORDS, seed=1)
    build_tiny_model(student, TASK_WORDS, seed=0)
    data = os.path.join(out_dir, "data")
    data_prep.main(["digits", "--out", data, "--train-size", "64", "--test-size", "16"])
    return teacher, student, data


def write_hints(data, out):
    """OPSD's training data: each row of data/train.parquet with "hint", its question followed by its answer,
    which the teacher reads as its prompt (--teacher-prompt-key hint). Returns the new file's path."""
    rows = pq.read_table(os.path.join(data, "train.parquet")).to_pylist()
    for row in rows:
        row["hint"] = f"{row['prompt'][-1]['content']} The answer is {row['reward_model']['ground_truth']}."
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def runs(args, teacher, student, data):
    """{name: train_grpo.py's flags} of every run to make."""
    base = DRY if args.dry_run else SMOLLM2
    common = [*base, "--dtype", "fp32" if args.dry_run else args.dtype, "--model", student]
    common += ["--train-data", os.path.join(data, "train.parquet"), "--val-data", os.path.join(data, "test.parquet")]
    out = {
        "opd": [*common, "--teacher", teacher, "--no-reward"],
        "grpo": common,
        "both": [*common, "--teacher", teacher],
    }
    for mode in filter(None, args.modes.split(",")):
        out[f"both_{mode}"] = [*common, "--teacher", teacher, "--distill-loss", mode]
    if args.opsd:
        hints = write_hints(data, os.path.join(args.out_dir, "data_opsd"))
        out["opsd"] = [*common, "--teacher", student, "--teacher-prompt-key", "hint", "--train-data", hints]
    only = [n for n in args.only.split(",") if n]
    return {name: flags for name, flags in out.items() if not only or name in only}


def curve(run_dir):
    """[(step, training seconds so far, held-out greedy accuracy)] at every validation of a run."""
    out, elapsed = [], 0.0
    for row in read_metrics(run_dir):
        elapsed += row.get("timing_s/step", 0.0)
        keys = [k for k in row if k.startswith("val-core/") and k.endswith("/reward/mean@1")]
        if keys:
            out.append((row["step"], elapsed, row[keys[0]]))
    return out


def first_at(points, target):
    """The training seconds at which a curve first reaches `target`; None if it never does."""
    return next((t for _, t, acc in points if acc >= target), None)


def report(curves, target):
    """The printed comparison: each curve, the time to `target`, and OPD's time over GRPO's."""
    lines = []
    for name, points in curves.items():
        lines.append(f"{name}: " + ", ".join(f"step {s} {t:.0f} s {acc:.3f}" for s, t, acc in points))
    times = {name: first_at(points, target) for name, points in curves.items()}
    for name, t in times.items():
        lines.append(
            f"{name}: first at {target} after {t:.0f} s of training"
            if t is not None
            else f"{name}: never reached {target}"
        )
    if times.get("opd") is not None and times.get("grpo"):
        lines.append(f"OPD / GRPO time to {target}: {times['opd'] / times['grpo']:.2f} (the target: at most 0.5)")
    else:
        lines.append(f"OPD / GRPO time to {target}: not defined (a run did not reach it)")
    return "\n".join(lines)


def plot(curves, target, path):
    """The held-out accuracy curves against training time, to `path`; a message instead without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([t for _, t, _ in points], [acc for _, _, acc in points], marker="o", label=name)
    ax.axhline(target, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training time (s, sum of timing_s/step)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    args.out_dir = os.path.abspath(args.out_dir)
    if args.dry_run:
        teacher, student, data = dry_inputs(args.out_dir)
        args.opsd = True
    else:
        teacher, student, data = (os.path.abspath(p) for p in (args.teacher, args.student, args.data))
    curves = {}
    for name, flags in runs(args, teacher, student, data).items():
        run_dir = os.path.join(args.out_dir, name)
        if os.path.isfile(os.path.join(run_dir, "final_model", "model.safetensors")):
            print(f"{run_dir}: finished before, reading it")
        else:
            print(f"{name}: train_grpo.py {' '.join(flags)}", flush=True)
            run_train_grpo(["--out-dir", run_dir, *flags], run_dir, cwd=REPO)
        curves[name] = curve(run_dir)
    print(report(curves, args.target))
    plot(curves, args.target, os.path.join(args.out_dir, "opd_smollm2.png"))
    return curves


if __name__ == "__main__":
    main()
