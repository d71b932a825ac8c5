"""--compile-blocks on a CPU: the update with each decoder layer's MLP and RMSNorms (and the final norm)
compiled by torch.compile (policy.compile_blocks) against uncompiled, in one process, the two interleaved
update by update on one model (the compiled forwards put in and taken out).

    torchrun --nproc_per_node=1 benchmarks/compile_blocks_cpu.py [--dtype fp32] [--layers 30] [--reps 4]

The model and batch are benchmarks/one_rank_reshard.py's: SmolLM2-135M's shape with random weights (30
layers), FSDP2 on one rank, 60-token prompts shared by each group and 32-token answers, run by
train_grpo.update_policy. Prints the first compiled update (it compiles), each update's seconds, the
medians and their ratio. benchmarks/gpu_compile.py measures the same on a GPU, in-process and in the trainer.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_rank_reshard import interleaved, parser, update_setup  # noqa: E402

import policy  # noqa: E402  (one_rank_reshard put the repository on the path)


def main():
    args = parser(__doc__).parse_args()
    model, optimizer, batch, targs = update_setup(args)
    plain = [m for m in model.modules() if "forward" not in vars(m)]
    policy.compile_blocks(model)
    compiled = {m: vars(m)["forward"] for m in plain if "forward" in vars(m)}  # what compile_blocks put in

    def put(on):  # the instance's forward shadows the class's
        for module, forward in compiled.items():
            if on:
                module.forward = forward
            else:
                vars(module).pop("forward", None)

    # the first compiled update compiles: the warm-up pair
    med = interleaved(
        args, model, optimizer, batch, targs, {"compiled": lambda: put(True), "plain": lambda: put(False)}
    )
    print(f"compiled / plain: {med['compiled'] / med['plain']:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
