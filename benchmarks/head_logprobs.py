"""The update's vocabulary-sized work on a real vocabulary: log-probs and entropy through the full
logits (the plain path) against the fused head (logprobs.head_logprobs_entropy), forward + backward.

    python benchmarks/head_logprobs.py [--like ../shared/models/qwen2.5-0.5b-instruct] [--repeats 7]

The model is the config of --like (Qwen2.5: 151,936 vocabulary rows, tied head) at hidden size 128
and 2 layers with random weights: 16 sequences of 114 prompt + 48 response tokens. Each path
computes the same loss, sum(logp) + 0.01 x sum(entropy) over the response tokens, and its backward.
Printed: the median seconds of each path (interleaved, after one warm-up), the ratio, the update's
MFU (the model's FLOPs against the measured fp32 matmul rate; the fused head's recomputation is not
counted as useful), and the largest difference between the two paths' gradients. Then the entropy's
cost in the fused head: the loss sum(logp) with no entropy computed (as the old and reference
log-probs run), with the entropy computed and logged (the default update), and with its gradient
(an entropy bonus). Then, over response lengths, the bytes each path holds for its backward (the
parameters excluded).
"""

import argparse
import statistics
import sys
import tempfile
import time

import torch
from common import REPO, matmul_rate  # the same measurement as the TRL benchmark's

sys.path.insert(0, REPO)
import policy  # noqa: E402
from logprobs import entropy_from_logits, logprobs_from_logits  # noqa: E402
from models import build_random_model  # noqa: E402

CPU = torch.device("cpu")


def plain(model, view, temperature=1.0):
    logits = policy.response_logits(model, view, CPU)
    logp = logprobs_from_logits(logits, view["responses"], temperature)
    return logp, entropy_from_logits(logits / temperature)


def fused(model, view, temperature=1.0):
    return policy.response_logprobs(model, view, CPU, temperature, entropy_grad=True)


def fused_no_entropy(model, view, temperature=1.0):
    return policy.response_logprobs(model, view, CPU, temperature, entropy=False)


def fused_entropy_logged(model, view, temperature=1.0):
    return policy.response_logprobs(model, view, CPU, temperature)


def step(path, model, view, bonus=0.01):
    model.zero_grad()
    start = time.perf_counter()
    logp, entropy = path(model, view)
    loss = logp if entropy is None or not bonus else logp + bonus * entropy
    (loss * view["response_mask"]).sum().backward()
    return time.perf_counter() - start, {n: p.grad.clone() for n, p in model.named_parameters()}


def entropy_cost(model, view, repeats):
    """The fused head's forward + backward of sum(logp): without the entropy, with it logged, and
    with its gradient (loss sum(logp) + 0.01 sum(entropy)); medians, interleaved after a warm-up."""
    runs = {"none": (fused_no_entropy, 0), "logged": (fused_entropy_logged, 0), "bonus": (fused, 0.01)}
    times = {name: [] for name in runs}
    for i in range(repeats + 1):
        for name, (path, bonus) in runs.items():
            seconds, _ = step(path, model, view, bonus)
            if i:
                times[name].append(seconds)
    none, logged, bonus = (statistics.median(times[k]) for k in runs)
    print(
        f"the entropy in the fused head, median of {repeats}: none {none:.3f} s, logged {logged:.3f} s "
        f"({(logged - none) / logged:+.1%}), with its gradient {bonus:.3f} s ({(bonus - none) / bonus:+.1%})"
    )


def saved_bytes(path, model, view):
    """Bytes autograd holds between the forward and the backward of `path` (distinct storages,
    the parameters excluded): the activations, and with the plain path the [b, r, V] logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = path(model, view)
        ((logp + 0.01 * entropy) * view["response_mask"]).sum()
    return sum(seen.values())


def memory_table(model, lengths, sequences=2):
    vocab = model.config.vocab_size
    print(f"held for the backward, {sequences} sequences of 114 prompt tokens + r response tokens:")
    print("| r | logits path | fused head | [b, r, V] fp32 logits |")
    print("| ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(1)
    for r in lengths:
        prompts = [torch.randint(0, vocab, (114,), generator=g).tolist() for _ in range(sequences)]
        responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for _ in range(sequences)]
        view = policy.micro_batch(policy.make_batch(prompts, responses, pad_id=0), list(range(sequences)))
        a, b = saved_bytes(plain, model, view), saved_bytes(fused, model, view)
        print(f"| {r} | {a / 2**20:.0f} MiB | {b / 2**20:.1f} MiB | {sequences * r * vocab * 4 / 2**20:.0f} MiB |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", default="../shared/models/qwen2.5-0.5b-instruct")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory", default="48,192,768", help="response lengths for the memory table (empty: none)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(
            tmp, args.like, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (114,), generator=g).tolist() for _ in range(16)]
    responses = [torch.randint(0, vocab, (48,), generator=g).tolist() for _ in range(16)]
    view = policy.micro_batch(policy.make_batch(prompts, responses, pad_id=0), list(range(16)))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters, vocabulary {vocab}; 16 x (114 + 48) tokens; threads {torch.get_num_threads()}"
    )
    times, last = {"plain": [], "fused": []}, {}
    step(plain, model, view), step(fused, model, view)  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("fused", fused)):
            seconds, grads = step(fn, model, view)
            times[name].append(seconds)
            last[name] = grads
    gap = max((last["plain"][n] - last["fused"][n]).abs().max().item() for n in last["plain"])
    p, f = statistics.median(times["plain"]), statistics.median(times["fused"])
    print(f"forward + backward, median of {args.repeats}: logits path {p:.2f} s, fused head {f:.2f} s: {p / f:.2f}x")
    # the model's FLOPs: 3 x the forward's 2 x parameters x tokens, the head on the response tokens only
    head = model.get_output_embeddings().weight.numel()
    body, tokens, answers = params - head, 16 * (114 + 48), 16 * 48
    flops = 3 * 2 * (body * tokens + head * answers)
    rate = matmul_rate(torch.get_num_threads())
    print(
        f"model FLOPs {flops / 1e9:.0f} G; fp32 matmul rate {rate / 1e9:.0f} GFLOP/s (2048^3, median of 15); "
        f"MFU: logits path {flops / p / rate:.0%}, fused head {flops / f / rate:.0%}"
    )
    print(f"largest gradient difference between the paths: {gap:.1e}")
    entropy_cost(model, view, args.repeats)
    if args.memory:
        memory_table(model, [int(r) for r in args.memory.split(",")])


if __name__ == "__main__":
    main()
