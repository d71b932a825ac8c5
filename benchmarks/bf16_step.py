"""fp32 against bf16, side by side in one run: the GRPO step's time split and the engine-vs-trainer
gap, on SmolLM2 x multiply (README's command), the Qwen-vocabulary shape and the demo.

    python models.py smollm2 --out models/smollm2 && python data_prep.py multiply --out data/multiply
    python benchmarks/bf16_step.py [--setups smollm2,qwen-vocab,demo] [--steps 4] [--out-dir runs/bf16_step]

For each setup it runs train_grpo.py with --dtype fp32 and then --dtype bf16 (1 rank, vLLM, no
validation, no checkpoints) and prints, as medians over the steps after the first: the step, its
generation, update and weight sync with their shares, the update's MFU against its dtype's matmul
rate (SmolLM2's MLP shape, measured at the start of this run), and the gap metrics (training/rollout_*). Run it on
an otherwise idle machine. --prompts/--group-size shrink the batch where bf16 is emulated (a CPU
without avx512_bf16 or AMX runs bf16 matmuls tens of times slower than fp32).
"""

import argparse
import os
import statistics
import sys

import torch
from common import DEMO_MEASURED, REPO, matmul_params, matmul_rate, read_metrics, run_train_grpo

sys.path.insert(0, REPO)
from policy import native_bf16  # noqa: E402 (the repository's, not a package)

QWEN_DIR = os.path.join(REPO, "..", "shared", "models", "qwen2.5-0.5b-instruct")
SETUPS = {
    "smollm2": "--model models/smollm2 --train-data data/multiply/train.parquet --val-data data/multiply/test.parquet "
    "--max-prompt-length 128 --max-response-length 32 --kl-coef 0 --lr 1e-5",
    "qwen-vocab": "--model {qwen} --max-prompt-length 64 --max-response-length 48 --kl-coef 0 --lr 1e-5",
    "demo": " ".join(DEMO_MEASURED),
}
GAP = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_logprob_diff_max")


def qwen_vocab_model(out):
    """The Qwen-vocabulary shape of BENCHMARKS.md: the real Qwen2.5 tokenizer and config, hidden 128, 2 layers."""
    if not os.path.isdir(out):
        from models import build_random_model

        build_random_model(
            out, QWEN_DIR, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=512,
        )  # fmt: skip
    return out


def update_flops(model_dir, row, prompts, group_size):
    """FLOPs of one update, 6 x matmul weights x tokens computed, from the step's mean lengths: the
    blocks run each prompt once per group (shared prompts, the default) and every response; the head
    runs on the response tokens only (how our trainer runs it)."""
    blocks, head = matmul_params(model_dir)
    responses = row["response_length/mean"] * prompts * group_size
    return 6 * (blocks * (row["prompt_length/mean"] * prompts + responses) + head * responses)


def run(setup, dtype, args):
    out_dir = os.path.join(args.out_dir, f"{setup}_{dtype}")
    flags = SETUPS[setup].format(qwen=qwen_vocab_model(os.path.join(args.out_dir, "qwen_vocab_model"))).split()
    flags += (
        f"--prompt-batch-size {args.prompts} --mini-batch-size {args.prompts} --group-size {args.group_size}".split()
    )
    flags += f"--max-steps {args.steps} --test-freq -1 --no-val-before-train --save-freq -1 --rollout vllm".split()
    if not os.path.isfile(os.path.join(out_dir, "metrics.jsonl")):
        run_train_grpo(["--out-dir", out_dir, "--dtype", dtype, *flags], f"{setup} {dtype}", cwd=REPO)
    rows = [r for r in read_metrics(out_dir) if r["step"] >= 1]
    model = os.path.join(out_dir, "tiny_model") if setup == "demo" else flags[flags.index("--model") + 1]
    return rows[1:] or rows, model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="smollm2,qwen-vocab,demo")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the medians")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (README's SmolLM2 command: 8)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (README's SmolLM2 command: 8)")
    p.add_argument("--out-dir", default="runs/bf16_step")
    args = p.parse_args()
    mlp = (2048, 576, 1536)  # SmolLM2's MLP shape
    rate = {d: matmul_rate(os.cpu_count(), d, shape=mlp) / 1e9 for d in ("fp32", "bf16")}
    native = native_bf16(torch.device("cpu"))
    print(f"native bf16 matmuls on this CPU: {native}")
    if not native:
        print("(bf16 is emulated here: its speed depends on the shape, so the bf16 MFU below means little)")
    print(f"matmul 2048x576x1536 on {os.cpu_count()} threads: fp32 {rate['fp32']:.0f} GFLOP/s, bf16 {rate['bf16']:.1f}")
    for setup in args.setups.split(","):
        print(f"\n{setup}: {args.prompts} prompts x {args.group_size} samples, medians of steps 2..{args.steps}")
        times = {}
        for dtype in ("fp32", "bf16"):
            rows, model = run(setup, dtype, args)
            med = {
                k: statistics.median(r[f"timing_s/{k}"] for r in rows)
                for k in ("step", "gen", "update_actor", "update_weights")
            }
            times[dtype] = med["step"]
            flops = statistics.median(update_flops(model, r, args.prompts, args.group_size) for r in rows)
            shares = ", ".join(
                f"{k} {med[k]:.2f} s ({med[k] / med['step']:.0%})" for k in ("gen", "update_actor", "update_weights")
            )
            mfu = flops / med["update_actor"] / 1e9 / rate[dtype]
            print(f"  {dtype}: step {med['step']:.2f} s: {shares}; update MFU {mfu:.0%} of {dtype}'s matmul rate")
            gaps = {k: max(r[k] for r in rows) for k in GAP}
            print("        gap (max over steps): " + ", ".join(f"{k.split('/')[1]} {v:.2e}" for k, v in gaps.items()))
        print(f"  bf16 step / fp32 step: {times['bf16'] / times['fp32']:.2f}")


if __name__ == "__main__":
    main()
