"""Where one SmolLM2 update micro-batch spends its time in fp32 and in bf16, and what attention alone
costs in each (BENCHMARKS.md: "The step, on a CPU with native bf16").

    python models.py smollm2 --out models/smollm2
    python benchmarks/bf16_profile.py [--model models/smollm2] [--top 12]     # about 3 min

The micro-batch: 8 random prompts of 40 tokens, 8 answers of 8 to 32 random tokens each, shared
prompts, the fused head, FSDP2 on one rank (bf16: mixed precision, as train_grpo.py --dtype bf16).
For each dtype it prints the median of 3 timed forward+backward passes after 2 warm-ups, then
torch.profiler's top operators by self time, grouped by input shape. Then the attention of the
answers' forward alone (64 x 9 heads, 31 queries over 71 keys, forward and backward): SDPA in each
dtype, SDPA in fp32 on bf16 inputs, and an eager attention (two matmuls around an fp32 softmax).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import policy  # noqa: E402 (the repository's, not a package)

CPU = torch.device("cpu")


def median_time(fn, warmup=2, repeats=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def micro_batch():
    torch.manual_seed(0)
    prompts, answers = [], []
    for _ in range(8):
        prompt = torch.randint(100, 40000, (40,)).tolist()
        for _ in range(8):
            prompts.append(prompt)
            answers.append(torch.randint(100, 40000, (int(torch.randint(8, 33, ())),)).tolist())
    return policy.micro_batch(policy.make_batch(prompts, answers, 0, group=8), list(range(64)))


def profile_update(model_dir, dtype, mesh, top):
    from torch.profiler import ProfilerActivity, profile

    model = policy.shard(policy.load_model(model_dir, torch.float32, CPU), mesh, dtype)
    view = micro_batch()

    def step():
        logp, _ = policy.response_logprobs(model, view, CPU, 1.0)
        (logp * view["response_mask"]).sum().div(1000).backward()

    print(f"\n{dtype}: forward+backward, median of 3: {median_time(step):.2f} s")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40, max_shapes_column_width=70
    )
    print(table)


def attention(dtype, how):
    """Forward and backward of the answers' attention at SmolLM2's shapes, in ms."""
    q = torch.randn(64, 9, 31, 64, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(64, 9, 71, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.ones(64, 1, 31, 71, dtype=torch.bool).tril(40)

    def run():
        if how == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif how == "sdpa in fp32":
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(dtype)
        else:
            scores = (q @ k.transpose(-1, -2) / 8).masked_fill(~mask, float("-inf"))
            out = torch.softmax(scores.float(), -1).to(dtype) @ v
        out.sum().backward()

    return median_time(run, repeats=5) * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--top", type=int, default=12, help="operators (by shape) printed per dtype")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    for dtype in (torch.float32, torch.bfloat16):
        profile_update(args.model, dtype, mesh, args.top)
    print("\nattention alone (64 x 9 heads, 31 queries over 71 keys), forward+backward, median of 5:")
    for dtype in (torch.float32, torch.bfloat16):
        for how in ("sdpa", "sdpa in fp32", "eager") if dtype == torch.bfloat16 else ("sdpa", "eager"):
            print(f"  {str(dtype).split('.')[1]}, {how}: {attention(dtype, how):.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
