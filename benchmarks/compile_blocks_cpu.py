"""--compile-blocks on a CPU: the update with each decoder layer's MLP and RMSNorms (and the final norm)
compiled by torch.compile (policy.compile_blocks) against uncompiled, in one process, the two interleaved
update by update on one model (the compiled forwards put in and taken out).

    python benchmarks/compile_blocks_cpu.py [--dtype fp32] [--prompts 4] [--group-size 8] [--reps 4]

The model and batch are benchmarks/one_rank_reshard.py's: SmolLM2-135M's shape with random weights (30
layers), FSDP2 on one rank, 60-token prompts shared by each group and 32-token answers, run by
train_grpo.update_policy. Prints the first compiled update (it compiles), each update's seconds, the
medians and their ratio. benchmarks/gpu_compile.py measures the same on a GPU, in-process and in the trainer.
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    p.add_argument("--reps", type=int, default=4, help="timed updates of each kind, after one warm-up pair")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    init_distributed()
    cpu = torch.device("cpu")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = policy.shard(AutoModelForCausalLM.from_config(config), init_device_mesh("cpu", (1,)), dtype)
    plain = [m for m in model.modules() if "forward" not in vars(m)]
    policy.compile_blocks(model)
    compiled = {m: vars(m)["forward"] for m in plain if "forward" in vars(m)}  # what compile_blocks put in
    P, n, L = args.prompts, args.group_size, 32
    flags = f"--model x --prompt-batch-size {P} --mini-batch-size {P} --group-size {n} --micro-batch-size {P * n}"
    targs = trainer_args(f"{flags} --max-response-length {L} --kl-coef 0 --lr 1e-6".split())
    g = torch.Generator().manual_seed(0)
    groups = [torch.randint(0, config.vocab_size, (60,), generator=g).tolist() for _ in range(P)]
    answers = [torch.randint(0, config.vocab_size, (L,), generator=g).tolist() for _ in range(P * n)]
    batch = policy.make_batch([q for q in groups for _ in range(n)], answers, pad_id=0, group=n)
    batch["advantages"] = torch.randn(P * n, generator=g)[:, None] * batch["response_mask"]
    batch["engine_logp"], batch["old_logp"] = torch.zeros_like(batch["response_mask"]), None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = {"plain": [], "compiled": []}
    for i in range(args.reps + 1):
        for name in ("compiled", "plain"):
            for module, forward in compiled.items():  # the instance's forward shadows the class's
                if name == "compiled":
                    module.forward = forward
                else:
                    vars(module).pop("forward", None)
            t = time.perf_counter()
            train_grpo.update_policy(model, optimizer, batch, step=1, args=targs, world=1, device=cpu)
            s = time.perf_counter() - t
            print(f"  update {i} {name}: {s:.2f} s" + (" (it compiles)" if i == 0 and name == "compiled" else ""))
            if i:
                times[name].append(s)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{args.dtype}, {k}: median {v:.2f} s over {len(times[k])} updates")
    print(f"compiled / plain: {med['compiled'] / med['plain']:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
