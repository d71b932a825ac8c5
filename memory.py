"""Will it fit: the memory a run has and needs. Before the first rollout the trainer measures the
model's activations per token and checks that the update's largest micro-batch, with the gradients
and optimizer states, fits in the memory this rank has free; if not, it says which flags fit (the
same gradient in smaller pieces), instead of dying in the first update after a whole rollout."""

import torch

from distributed import print0
from policy import make_batch, micro_batch, response_logprobs


def free_memory_gib(device, ranks_here):
    """Memory this process can still take (GiB): the GPU's free memory on CUDA; on CPU the machine's
    available memory (Linux's MemAvailable) split evenly between the `ranks_here` on this machine.
    None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**30
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20 / ranks_here


def activation_gib_per_token(model, device, length=1024):
    """GiB that autograd holds for the backward, per token of a micro-batch through
    response_logprobs: the activations, which grow with the tokens (the parameters do not). Measured
    as the difference between forwards of one sequence of `length` and of `length` // 2 tokens
    (half prompt, half response), with no backward. Every rank calls it: FSDP2 gathers weights."""

    def held(n):
        mb = micro_batch(make_batch([[0] * (n // 2)], [[0] * (n - n // 2)], pad_id=0), [0])
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            response_logprobs(model, mb, device, 1.0)
        return sum(storages.values())

    return (held(length) - held(length // 2)) / (length - length // 2) / 2**30


def check_update_memory(args, policy, trained, *, world, ranks_here, device, kv_cache_gib=None, frozen=()):
    """Before the first rollout: does the update's largest micro-batch fit? Its activations (measured
    per token on this model, activation_gib_per_token) plus the gradients and AdamW's two
    states, against the memory this rank has free now. Printed as a warning when it does not, with
    flags that fit: otherwise the run would die in its first update, after a whole rollout. `frozen`:
    the models that only score (the reference, distill.py's teacher; None or the policy itself count
    nothing), loaded before this check, so the free memory is what they left: the warning says their share."""
    free = free_memory_gib(device, ranks_here)
    if free is None:
        return
    p, r = args.max_prompt_length, args.max_response_length
    n = args.group_size if args.share_prompts else 1
    unit = p + n * r  # the smallest micro-batch (policy.micro_batches): a group with its prompt, or one sequence
    if args.micro_batch_tokens:
        tokens = max(args.micro_batch_tokens, unit)
    else:
        tokens = max(1, args.micro_batch_size // n) * unit
    per_token = activation_gib_per_token(policy, device, min(p + r, 1024))
    on_gpu = {"none": 3, "optimizer": 1, "params": 0, "both": 0}[args.offload]  # grads + 2 AdamW moments
    states = on_gpu * sum(x.numel() * x.element_size() for x in trained) / world / 2**30
    need = per_token * tokens + states
    if need <= free or per_token <= 0:
        return
    fits = int((free - states) * 0.8 / per_token) // 1024 * 1024  # tokens, with a fifth to spare
    if fits >= unit:
        fix = f"--micro-batch-tokens {fits}"
    elif fits >= p + r:  # shared prompts: a micro-batch holds a whole group
        fix = f"--micro-batch-tokens {fits} --no-share-prompts (with shared prompts a group is {unit} tokens)"
    else:
        fix = "--grad-checkpointing (it keeps one layer's activations at a time)"
    held = frozen_gib(policy, frozen)
    if held:  # the teacher can be larger than the policy
        fix += f". The frozen reference and teacher hold {held:.1f} GiB of this rank's memory (--offload params moves them to the CPU)"
    if kv_cache_gib:  # on CPU the engine keeps its KV cache while training
        fix += (
            f". The rollout engine's KV cache takes {kv_cache_gib:.1f} GiB of this rank's memory; "
            "VLLM_CPU_KVCACHE_SPACE=<GiB> in the environment sets it"
        )
    print0(
        f"memory: the update's largest micro-batch ({tokens} tokens) needs about {need:.1f} GiB "
        f"({per_token * 2**20:.0f} KiB of activations per token, {states:.1f} GiB of gradients and optimizer "
        f"states), and this rank has {free:.1f} GiB free: the first update would likely run out of memory. "
        f"Smaller micro-batches give the same gradient: {fix}."
    )


def frozen_gib(policy, frozen):
    """GiB of this rank's shards of the distinct frozen models in `frozen` (not None, not the policy)."""
    models = {id(m): m for m in frozen if m is not None and m is not policy}.values()
    local = [p.to_local() if hasattr(p, "to_local") else p for m in models for p in m.parameters()]
    return sum(p.numel() * p.element_size() for p in local) / 2**30
