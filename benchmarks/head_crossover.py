"""Where the fused LM head starts to pay: log-probs and entropy of every token, forward + backward, through the
full logits (logprobs_from_logits, entropy_from_logits) against the fused head (logprobs.head_logprobs_entropy),
over vocabulary sizes. policy.FUSED_HEAD_MIN_VOCAB is read off this table: below it, the plain path runs.

    python benchmarks/head_crossover.py [--repeats 7]

Two shapes: the demo's update micro-batch (128 sequences x 4 response tokens, hidden 128) and a longer one
(16 x 256 tokens, hidden 576, SmolLM2-135M's). Random fp32 weights; medians, the two paths interleaved after a
warm-up. Printed: each path's median milliseconds and plain / fused (above 1: the fused head is faster)."""

import argparse
import statistics
import sys
import time

import torch
from common import REPO

sys.path.insert(0, REPO)
from logprobs import entropy_from_logits, head_logprobs_entropy, logprobs_from_logits  # noqa: E402
from policy import FUSED_HEAD_MIN_VOCAB  # noqa: E402


def plain(h, w, labels):
    z = h @ w.T  # [B, T, V]: the logits, whole
    return logprobs_from_logits(z, labels, 1.0), entropy_from_logits(z)


def fused(h, w, labels):
    return head_logprobs_entropy(h, w, labels, 1.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"policy.FUSED_HEAD_MIN_VOCAB = {FUSED_HEAD_MIN_VOCAB}")
    for hidden, sequences, tokens in ((128, 128, 4), (576, 16, 256)):
        for vocab in (20, 256, 1024, 2048, 8192, 49152):
            h = torch.randn(sequences, tokens, hidden, requires_grad=True)
            w = (0.02 * torch.randn(vocab, hidden)).requires_grad_()
            labels = torch.randint(0, vocab, (sequences, tokens))
            times = {"plain": [], "fused": []}
            for i in range(args.repeats + 1):
                for name, path in (("plain", plain), ("fused", fused)):
                    start = time.perf_counter()
                    logp, entropy = path(h, w, labels)
                    (logp.sum() + 0.01 * entropy.sum()).backward()
                    if i:
                        times[name].append(time.perf_counter() - start)
            p, f = (statistics.median(times[k]) * 1e3 for k in ("plain", "fused"))
            print(f"hidden {hidden}, {sequences} x {tokens} tokens, vocabulary {vocab:6d}: "
                  f"plain {p:8.2f} ms, fused {f:8.2f} ms, plain / fused {p / f:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
