"""forward_kl_topk's cost in the fused head at Qwen2.5's 151,936-row vocabulary: time and peak memory of the
head's passes with the teacher's top-k against the passes every run with a teacher already makes.

    python benchmarks/distill_topk_head.py [--tokens 1024] [--hidden 896] [--k 32] [--repeats 3]

Random hidden states [tokens, hidden] and an LM head [151936, hidden] (Qwen2.5-0.5B's shape), fp32, the CPU's
blocks (logprobs.head_blocks). Four passes, each in a fresh process (its peak resident memory is its own):
the teacher's pass as the default k1 runs it (the sampled tokens' log-probs, no gradient), the teacher's pass of
forward_kl_topk (also its top-k log-probs and ids: logprobs.head_topk_logprobs), the student's update pass as
every run makes it (log-probs and entropy, forward + backward into the hidden states and the head), and the
student's update pass of forward_kl_topk (also the log-probs at the teacher's k ids, with their gradient; the
student's passes hold the head's fp32 weight gradient, 4 x V x hidden bytes). Printed:
each pass's best time of --repeats (the least disturbed by other work), and its peak resident memory above the inputs, beside what the [tokens, V] fp32 logits
alone would hold: the top-k never makes one.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from common import REPO

sys.path.insert(0, REPO)
from logprobs import head_logprobs_entropy, head_topk_logprobs  # noqa: E402

VOCAB = 151_936  # Qwen2.5's head rows
PASSES = ("teacher k1", "teacher forward_kl_topk", "student update", "student update forward_kl_topk")


def rss_bytes():
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_pass(name, tokens, hidden, k, repeats):
    """Run one pass `repeats` times after the inputs exist; returns (best seconds, peak bytes above the inputs)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g)
    weight = torch.randn(VOCAB, hidden, generator=g).mul_(0.02)  # in place: no temporary in the peak
    labels = torch.randint(0, VOCAB, (1, tokens), generator=g)
    ids = torch.randint(0, VOCAB, (1, tokens, k), generator=g)
    grad = "student" in name
    h.requires_grad_(grad), weight.requires_grad_(grad)
    base, times = rss_bytes(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if name == "teacher k1":
            with torch.no_grad():
                head_logprobs_entropy(h, weight, labels, entropy=False)
        elif name == "teacher forward_kl_topk":
            head_topk_logprobs(h, weight, labels, k)
        else:
            extra = ids if name.endswith("topk") else None
            logp, ent = head_logprobs_entropy(h, weight, labels, extra_ids=extra)
            (logp.sum() + 0.01 * ent.sum()).backward()
            h.grad = weight.grad = None
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return min(times), peak - base


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one pass
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_pass(a.one, a.tokens, a.hidden, a.k, a.repeats)))
        return
    print(
        f"{a.tokens} tokens, hidden {a.hidden}, vocabulary {VOCAB:,}, k {a.k}, fp32, {torch.get_num_threads()} threads"
    )
    print(f"the [tokens, V] fp32 logits alone would hold {a.tokens * VOCAB * 4 / 2**20:,.0f} MiB")
    for name in PASSES:
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        seconds, peak = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        print(f"{name:34s} {seconds:7.2f} s   peak {peak / 2**20:8.1f} MiB above the inputs")


if __name__ == "__main__":
    main()
