"""FSDP2 on one rank: the update with the blocks' gathered weights kept from forward to backward (what
policy.shard does with one rank on the CPU) against resharded after each forward (FSDP2's default, and
policy.shard's on GPUs), in one process, the two interleaved update by update.

    python benchmarks/one_rank_reshard.py [--dtype fp32] [--prompts 4] [--group-size 8] [--layers 30] [--reps 4]

The model is SmolLM2-135M's shape with random weights (hidden 576, 30 layers, the tied 49,152-row head),
the batch 60-token prompts shared by each group and 32-token answers; train_grpo.update_policy runs it.
Prints each update's seconds and the medians (the first pair is a warm-up). bf16 only means something
on a CPU with native bf16 (policy.native_bf16); on a GPU benchmarks/gpu_update.py measures the same.
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import policy  # noqa: E402
import train_grpo  # noqa: E402
from cli import parse_args as trainer_args  # noqa: E402
from distributed import init_distributed  # noqa: E402


def parser(doc):
    """The command line both CPU update A/Bs share (this one and compile_blocks_cpu.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    p.add_argument("--reps", type=int, default=4, help="timed updates of each kind, after one warm-up pair")
    return p


def update_setup(args):
    """A process group of one, SmolLM2-135M's shape with random weights (args.layers layers) sharded by FSDP2,
    a batch of 60-token prompts shared by each group with 32-token answers, the trainer's args and an AdamW.
    Returns (model, optimizer, batch, trainer args)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    init_distributed()
    print(f"native bf16 on this CPU: {policy.native_bf16(torch.device('cpu'))}; {torch.get_num_threads()} threads")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = policy.shard(AutoModelForCausalLM.from_config(config), init_device_mesh("cpu", (1,)), dtype)
    P, n, L = args.prompts, args.group_size, 32
    flags = f"--model x --prompt-batch-size {P} --mini-batch-size {P} --group-size {n} --micro-batch-size {P * n}"
    targs = trainer_args(f"{flags} --max-response-length {L} --kl-coef 0 --lr 1e-6".split())
    g = torch.Generator().manual_seed(0)
    groups = [torch.randint(0, config.vocab_size, (60,), generator=g).tolist() for _ in range(P)]
    answers = [torch.randint(0, config.vocab_size, (L,), generator=g).tolist() for _ in range(P * n)]
    batch = policy.make_batch([q for q in groups for _ in range(n)], answers, pad_id=0, group=n)
    batch["advantages"] = torch.randn(P * n, generator=g)[:, None] * batch["response_mask"]
    batch["engine_logp"], batch["old_logp"] = torch.zeros_like(batch["response_mask"]), None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6), batch, targs


def interleaved(args, model, optimizer, batch, targs, settings):
    """settings: name -> a function that puts that setting in place. Each rep runs one update of each, in
    turn (the first rep a warm-up); prints each update's seconds, then the medians. Returns the medians."""
    times = {name: [] for name in settings}
    for i in range(args.reps + 1):
        for name, put in settings.items():
            put()
            t = time.perf_counter()
            train_grpo.update_policy(model, optimizer, batch, step=1, args=targs, world=1, device=torch.device("cpu"))
            s = time.perf_counter() - t
            print(f"  update {i} {name}: {s:.2f} s" + (" (warm-up)" if i == 0 else ""), flush=True)
            if i:
                times[name].append(s)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{args.dtype}, {k}: median {v:.2f} s over {len(times[k])} updates")
    return med


def reshard_after_forward(model, reshard):
    for module in model.modules():
        if module is not model and hasattr(module, "set_reshard_after_forward"):
            module.set_reshard_after_forward(reshard, recurse=False)


def main():
    args = parser(__doc__).parse_args()
    model, optimizer, batch, targs = update_setup(args)
    settings = {
        "resharded": lambda: reshard_after_forward(model, True),
        "kept": lambda: reshard_after_forward(model, False),
    }
    med = interleaved(args, model, optimizer, batch, targs, settings)
    print(f"resharded / kept: {med['resharded'] / med['kept']:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
