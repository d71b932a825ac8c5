"""LoRA against full fine-tuning on the real SmolLM2 example (README: "LoRA"), one run after the other.

    python models.py smollm2 --out models/smollm2 && python data_prep.py multiply --out data/multiply
    python benchmarks/lora_smollm2.py [--out-dir runs/lora_vs_full] [--only full,lora] [--lora-rank 16]

Both runs are README's SmolLM2 command (8 prompts x 8 samples, 18 steps); LoRA adds --lora-rank and
10x the learning rate. Printed for each: held-out greedy accuracy after every validation against
the training time so far (the sum of timing_s/step), the gain over step 0, and LoRA's gain at the
full run's training time as a share of full fine-tuning's gain. Then the last checkpoints' sizes:
the optimizer state (the optim.* tensors of the shards' index) and the whole checkpoint directory.
Run it on an otherwise idle machine; a run already finished in --out-dir is read, not rerun.
"""

import argparse
import os
import statistics
import sys

from common import REPO, held_out_curve, read_metrics, run_smollm2

sys.path.insert(0, REPO)
import checkpoint  # noqa: E402 (the repository's, not a package)
import integrity  # noqa: E402


def phases(run_dir):
    """Median seconds per step of the phases that LoRA changes."""
    rows = read_metrics(run_dir)[1:]
    keys = ("step", "gen", "ref", "update_actor", "update_weights")
    return {k: statistics.median(r.get(f"timing_s/{k}", 0.0) for r in rows) for k in keys}


def sizes(run_dir):
    """(optimizer state bytes, checkpoint directory bytes) of the run's newest checkpoint."""
    step = max(checkpoint.saved_steps(run_dir))
    path = checkpoint.step_dir(run_dir, step)
    index = integrity.read_index(os.path.join(path, "shards", ".metadata"))
    optim = 0
    for key, meta in index.state_dict_metadata.items():
        if key.startswith("optim.") and hasattr(meta, "size"):
            n = 1
            for d in meta.size:
                n *= d
            optim += n * meta.properties.dtype.itemsize
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return optim, total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="runs/lora_vs_full")
    parser.add_argument("--only", default="full,lora")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--full-lr", default="1e-5")
    parser.add_argument("--lora-lr", default="1e-4")
    args = parser.parse_args()
    flags = {"full": ["--lr", args.full_lr], "lora": ["--lr", args.lora_lr, "--lora-rank", str(args.lora_rank)]}
    for name in args.only.split(","):
        run_smollm2(os.path.join(args.out_dir, name), flags[name])
    curves = {name: held_out_curve(os.path.join(args.out_dir, name)) for name in flags}
    for name, points in curves.items():
        print(f"{name} ({' '.join(flags[name])}): " + ", ".join(f"step {s} {t:.0f} s {a:.3f}" for s, t, a in points))
    full, lora = curves["full"], curves["lora"]
    budget = full[-1][1]  # the full run's whole training time
    at = [p for p in lora if p[1] <= budget * 1.001][-1]
    gain_full, gain_lora = full[-1][2] - full[0][2], at[2] - lora[0][2]
    print(
        f"gain over step 0: full {gain_full:+.3f} in {budget:.0f} s; LoRA {gain_lora:+.3f} by step {at[0]} "
        f"({at[1]:.0f} s): {gain_lora / gain_full:.2f} of full fine-tuning's gain"
    )
    for name in flags:
        median = phases(os.path.join(args.out_dir, name))
        print(f"median seconds per step, {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in median.items()))
    (opt_f, ck_f), (opt_l, ck_l) = sizes(os.path.join(args.out_dir, "full")), sizes(os.path.join(args.out_dir, "lora"))
    mb = 2**20
    print(f"optimizer state: full {opt_f / mb:.1f} MiB, LoRA {opt_l / mb:.1f} MiB ({opt_l / opt_f:.1%})")
    print(f"checkpoint:      full {ck_f / mb:.1f} MiB, LoRA {ck_l / mb:.1f} MiB ({ck_l / ck_f:.1%})")


if __name__ == "__main__":
    main()
