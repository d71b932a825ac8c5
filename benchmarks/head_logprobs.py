"""The update's vocabulary-sized work on a real vocabulary: log-probs and entropy through the full
logits (the plain path) against the fused head (loss.head_logprobs_entropy), forward + backward.

    python benchmarks/head_logprobs.py [--like ../shared/models/qwen2.5-0.5b-instruct] [--repeats 7]

The model is the config of --like (Qwen2.5: 151,936 vocabulary rows, tied head) at hidden size 128
and 2 layers with random weights, as in issue 14's measurement: 16 sequences of 114 prompt + 48
response tokens. Each path computes the same loss, sum(logp) + 0.01 x sum(entropy) over the response
tokens, and its backward. Printed: the median seconds of each path (interleaved, after one warm-up),
the ratio, and the largest difference between the two paths' gradients.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import policy  # noqa: E402
from loss import entropy_from_logits, logprobs_from_logits  # noqa: E402
from models import build_random_model  # noqa: E402

CPU = torch.device("cpu")


def plain(model, view, temperature=1.0):
    logits = policy.response_logits(model, view, CPU)
    logp = logprobs_from_logits(logits, view["responses"], temperature)
    return logp, entropy_from_logits(logits / temperature)


def fused(model, view, temperature=1.0):
    return policy.response_logprobs(model, view, CPU, temperature, entropy_grad=True)


def step(path, model, view):
    model.zero_grad()
    start = time.perf_counter()
    logp, entropy = path(model, view)
    ((logp + 0.01 * entropy) * view["response_mask"]).sum().backward()
    return time.perf_counter() - start, {n: p.grad.clone() for n, p in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", default="../shared/models/qwen2.5-0.5b-instruct")
    parser.add_argument("--repeats", type=int, default=7)
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
    view = policy.window(policy.make_batch(prompts, responses, pad_id=0), list(range(16)))
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
    print(f"largest gradient difference between the paths: {gap:.1e}")


if __name__ == "__main__":
    main()
