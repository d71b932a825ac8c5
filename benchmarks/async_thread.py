"""Why one rank stays synchronous with --max-staleness: generation and the update in one process, one
after the other, against both at once in two threads (as a background-thread rollout would run them).

    python benchmarks/async_thread.py                 # about 3 min on the 2-core EPYC

SmolLM2-135M-Instruct (models/smollm2) in --dtype, on every core of this machine. Generation: vLLM's
--samples answers of --tokens tokens to multiply prompts (what a step's rollout asks of the engine).
Update: forward and backward of the policy on the same number of sequences of prompt + answer length
(update_actor's work). Each arrangement runs --reps times; the table shows medians.
"""

import argparse
import os
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import print_table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from rollout import make_engine

    engine = make_engine("vllm", a.model, max_model_len=256, dtype=a.dtype, seed=0, sequences=a.samples)
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype))
    prompts = [[1, 4093, 314, 1792 + i % 50, 1584, 28, 30] for i in range(a.samples // 8)]
    batch = torch.randint(100, 40000, (a.samples, len(prompts[0]) + a.tokens))

    def generate():
        engine.generate(prompts, n=8, max_new_tokens=a.tokens, seeds=list(range(len(prompts))), logprobs=True)

    def update():
        for rows in batch.split(16):  # micro-batches of 16, as update_actor does
            policy(rows, labels=rows).loss.backward()

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def both():
        worker = threading.Thread(target=generate)
        worker.start()
        update()
        worker.join()

    generate(), update()  # warm-up
    runs = {name: [timed(fn) for _ in range(a.reps)] for name, fn in (("generate", generate), ("update", update))}
    runs["one after the other"] = [g + u for g, u in zip(runs["generate"], runs["update"])]
    runs["two threads at once"] = [timed(both) for _ in range(a.reps)]
    seq = statistics.median(runs["one after the other"])
    rows = [[name, f"{statistics.median(v):.2f}", ""] for name, v in runs.items()]
    rows[-1][2] = f"{seq / statistics.median(runs['two threads at once']):.2f}x"
    note = f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores; speedup: against one after the other"
    print_table(
        f"{a.samples} samples of {a.tokens} tokens, {a.dtype}, medians of {a.reps}",
        ["work", "s", "speedup"],
        rows,
        note,
    )
    engine.close()


if __name__ == "__main__":
    main()
