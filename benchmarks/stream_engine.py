"""A rollout rank's engine alone, lock-step against streamed (--stream-rollouts): how fast each turns
out a run's rollouts when the trainers never hold it up, weight loads included.

    python benchmarks/stream_engine.py            # about 10 min on 2 cores

SmolLM2-135M-Instruct in vLLM (--dtype), GSM8K prompts, --steps steps of --prompts x --group-size
answers up to --max-tokens, the same prompts and seeds for both. --model tiny: the demo's untrained
model (a 20-word vocabulary: answers end at random, a long tail), where an engine step costs about the
same for 1 answer or 16, as a GPU's decoding does. lock-step: generate() a step at a
time, the weights reloaded after each (rollout_ranks.serve). stream: vllm_engine.Stream holding a
step's share of groups, a group started as soon as one ends, the weights reloaded mid-answer each time a
step's last group has started (stream_rollouts.serve). Each repeat runs both, in turns; medians.
One process, --threads threads (a rollout rank of 2 on this machine has 1).
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import print_table, print_versions  # noqa: E402


def lock_step(engine, steps, weights, n, kw):
    tokens = 0
    for prompts, seeds in steps:
        out = engine.generate([r["prompt_ids"] for r in prompts], n=n, seeds=seeds, **kw)
        tokens += sum(map(len, out.response_ids))
        engine.update_weights(weights())
    return tokens


def streamed(engine, steps, weights, n, kw):
    from vllm_engine import Stream

    stream, tokens, share = Stream(engine), 0, len(steps[0][0])
    todo = [
        (j, i, row, seed) for j, (rows, seeds) in enumerate(steps) for i, (row, seed) in enumerate(zip(rows, seeds))
    ]
    while todo or len(stream):
        while todo and len(stream) < share:
            j, i, row, seed = todo.pop(0)
            stream.submit((j, i), row["prompt_ids"], n, seed, **kw)
            if i == share - 1:  # the step's last group started: the next version comes (rollout ranks: it may)
                stream.update_weights(weights())
        tokens += sum(len(ids) for _, out in stream.step() for ids in out.response_ids)
    return tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--data", default="data/gsm8k/train.parquet")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="a rollout rank's prompts per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.chdir(REPO)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep import load_prompts
    from rollout import sampling_seeds
    from vllm_engine import VLLMEngine

    print_versions()
    if a.model == "tiny":
        from models import build_tiny_model
        from tasks.digits import TASK_WORDS

        a.model, a.dtype = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), TASK_WORDS), "float32"
        rng = random.Random(0)
        rows = [dict(prompt_ids=[1] + [rng.randrange(5, 18) for _ in range(8)]) for _ in range(a.steps * a.prompts)]
    else:
        rows, _ = load_prompts(a.data, AutoTokenizer.from_pretrained(a.model), None, 512)
    steps = [
        (rows[j * a.prompts : (j + 1) * a.prompts], sampling_seeds(0, j + 1, 0, a.prompts)) for j in range(a.steps)
    ]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype))
    weights = lambda: ((name, p.detach()) for name, p in model.named_parameters())  # noqa: E731
    sequences = a.prompts * a.group_size
    longest = max(len(r["prompt_ids"]) for r in rows) + a.max_tokens
    engine = VLLMEngine(a.model, max_model_len=longest, dtype=a.dtype, seed=0, sequences=sequences)
    kw = dict(max_new_tokens=a.max_tokens, temperature=1.0, top_p=1.0, top_k=-1, logprobs=True)
    times = {"lock-step": [], "stream": []}
    tokens = {name: [] for name in times}
    for r in range(a.repeats + 1):  # round 0 warms up on one step and is left out
        for name, run in (("lock-step", lock_step), ("stream", streamed)):
            t = time.perf_counter()
            made = run(engine, steps if r else steps[:1], weights, a.group_size, kw)
            if r:
                times[name].append(time.perf_counter() - t)
                tokens[name].append(made)
            print(f"round {r} {name}: {made} tokens in {time.perf_counter() - t:.1f} s", flush=True)
    rate = {name: statistics.median(t / s for t, s in zip(tokens[name], times[name])) for name in times}
    table = [
        [name, f"{statistics.median(times[name]):.1f}", f"{statistics.median(tokens[name]):.0f}", f"{rate[name]:.1f}"]
        for name in times
    ]
    title = f"{os.path.basename(a.model)}: {a.steps} steps of {a.prompts} x {a.group_size} answers up to {a.max_tokens} tokens, {a.dtype}, "
    title += f"{a.threads} thread(s), medians of {a.repeats}"
    note = f"stream / lock-step tokens/s: {rate['stream'] / rate['lock-step']:.2f}x"
    print_table(title, ["engine", "seconds", "tokens", "tokens/s"], table, note)


if __name__ == "__main__":
    main()
