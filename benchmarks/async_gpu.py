"""On one GPU: synchronous GRPO against a trainer and a rollout rank sharing the GPU (one step off
policy), and the GPU's costs that benchmarks/async_model.py predicts K rollout against N trainer GPUs from.

    python benchmarks/async_gpu.py --like gpu_inputs/qwen2.5-0.5b-instruct --gsm8k gpu_inputs/gsm8k   # ~5 min
    python benchmarks/async_gpu.py --like ... --gsm8k ... --hidden 128 --layers 2 --prompts 8 --response-length 16  # CPU

The model is Qwen2.5-0.5B's config with random weights (it never writes EOS: every answer is
--response-length tokens), bf16, the transformers engine (`--rollout hf`; this image has no vLLM).
Runs, each a fresh torchrun of train_grpo.py, the same prompts and seeds:
  sync B     1 rank, --prompt-batch-size P x --group-size n = B samples a step
  sync B/4   the same with P/4 prompts: with sync B, the two generation times give c0 and c1
  async B    2 ranks on the one GPU: rank 1 generates, rank 0 trains (--rollout-ranks 1 --max-staleness 1)
It prints each run's median step and phases, and writes c0, c1, u, w to --out (async_model.py --gpu).
"""

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import fresh_dir, read_metrics, run_process, write_json  # noqa: E402


def run(a, model, name, prompts, ranks, extra=()):
    out = fresh_dir(os.path.join(a.work_dir, name))
    flags = [f"--model={model}", f"--train-data={a.gsm8k}/train.parquet", f"--val-data={a.gsm8k}/test.parquet"]
    flags += [f"--out-dir={out}", "--rollout=hf", "--dtype=bf16", f"--prompt-batch-size={prompts}"]
    flags += [f"--mini-batch-size={prompts}", f"--group-size={a.group_size}", "--max-prompt-length=512"]
    flags += [f"--max-response-length={a.response_length}", f"--max-steps={a.steps}", "--lr=1e-6", "--kl-coef=0"]
    flags += ["--test-freq=-1", "--save-freq=-1", "--no-save-model", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train_grpo.py"]
    ok, error, _ = run_process([*cmd, *flags], out, threads=4, timeout=a.timeout)
    if not ok:
        print(f"{name} failed: {error} (see {out}/log.txt)")
        return None
    kept = [r for r in read_metrics(out) if r["step"] > 1]
    med = {k: statistics.median(r.get(k, 0.0) for r in kept) for k in kept[0] if k.startswith(("timing_s/", "perf/"))}
    med["samples"] = prompts * a.group_size
    print(
        f"{name}: step {med['timing_s/step']:.2f} s; "
        + ", ".join(
            f"{k.removeprefix('timing_s/')} {v:.2f}"
            for k, v in med.items()
            if k.startswith("timing_s/") and k != "timing_s/step"
        )
    )
    return med


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True)
    p.add_argument("--gsm8k", required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--hidden", type=int, default=None, help="a smaller model for a CPU dry run, e.g. 128")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--work-dir", default="runs/bench_async_gpu")
    p.add_argument("--out", default="runs/bench_async_gpu/gpu.json")
    a = p.parse_args()
    import torch

    from models import build_random_model

    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
    model = os.path.join(a.work_dir, "model")
    if not os.path.isfile(os.path.join(model, "config.json")):
        heads = dict(num_attention_heads=a.hidden // 64, num_key_value_heads=1) if a.hidden else {}
        build_random_model(
            model, a.like, hidden_size=a.hidden, num_hidden_layers=a.layers, intermediate_size=None, **heads
        )
    sync = run(a, model, "sync", a.prompts, 1)
    small = run(a, model, "sync_quarter", a.prompts // 4, 1)
    async_ = run(a, model, "async_one_gpu", a.prompts, 2, ["--rollout-ranks=1", "--max-staleness=1"])
    result = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", runs={})
    result["runs"] = dict(sync=sync, sync_quarter=small, async_one_gpu=async_)
    if sync and small:
        b, L = sync["samples"], a.response_length
        c1 = (sync["timing_s/gen"] - small["timing_s/gen"]) / ((b - small["samples"]) * L)
        c0 = (sync["timing_s/gen"] - c1 * b * L) / L
        u = sync["timing_s/update_actor"] / sync["perf/total_num_tokens"]
        result.update(c0=c0, c1=c1, u=u, w=sync["timing_s/update_weights"], samples=b, lmax=L, prompt=0)
        print(
            f"c0 {c0 * 1e3:.3f} ms per decode iteration, c1 {c1 * 1e6:.3f} us per sample-token, u {u * 1e6:.3f} us/token"
        )
    if sync and async_:
        print(f"async on one GPU / sync: {sync['timing_s/step'] / async_['timing_s/step']:.2f}x samples/s")
    write_json(a.out, result)


if __name__ == "__main__":
    main()
