"""Generation on SmolLM2-135M-Instruct at GSM8K length: where vLLM's CPU time goes, and our
transformers engine on the same work (BENCHMARKS.md).

    python models.py smollm2 --out models/smollm2
    python data_prep.py gsm8k --input ../shared/data/gsm8k --out data/gsm8k
    python benchmarks/generation_smollm2.py                       # the profile below, about 20 min
    python benchmarks/generation_smollm2.py --variants vllm,hf    # any subset, by name

GSM8K training prompts x 8 samples, temperature 1, up to 256 new tokens, fp32, each variant (VARIANTS
says what each changes) in a fresh subprocess, one after the other. Printed per variant: start-up
seconds, the KV cache's capacity in tokens, and tokens/s of each round (the first vLLM round includes
its warm-up). Run it on an otherwise idle machine.
"""

import argparse
import json
import os
import subprocess
import sys

from common import REPO

# name: (engine, prompts, log-probs, environment)
VARIANTS = {
    # our engine as train_grpo.py builds it on CPU (eager, the KV cache sized for the rollout and the free
    # memory, the sampled token's log-prob returned), 8 prompts, 2 threads
    "vllm": ("vllm", 8, True, {}),
    "no-logprobs": ("vllm", 8, False, {}),  # the same without log-probs (train_grpo.py --no-engine-logprobs)
    # the same on 1 thread: what each rank gets under torchrun with 2 ranks on 2 cores
    "one-thread": ("vllm", 8, True, {"OMP_NUM_THREADS": "1"}),
    "big-batch": ("vllm", 32, True, {}),  # 32 prompts (256 sequences), the KV cache sized as train_grpo.py does
    "big-batch-kv1": ("vllm", 32, True, {"VLLM_CPU_KVCACHE_SPACE": "1"}),  # a fixed 1 GiB KV cache
    "big-batch-kv4": ("vllm", 32, True, {"VLLM_CPU_KVCACHE_SPACE": "4"}),  # a fixed 4 GiB KV cache
    "compiled": ("vllm-compiled", 8, True, {}),  # vLLM with torch.compile (enforce_eager=False), our other settings
    "hf": ("hf", 8, True, {}),  # our transformers engine
}
DEFAULT = "vllm,no-logprobs,one-thread,big-batch-kv1,big-batch,big-batch-kv4"

# runs in a subprocess: argv = engine, prompts, logprobs (0/1), rounds
ONE_ENGINE = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer
from rollout import make_engine
from memory import free_memory_gib
kind, n_prompts, logprobs, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
tok = AutoTokenizer.from_pretrained("models/smollm2")
rows = pq.read_table("data/gsm8k/train.parquet").to_pylist()[:n_prompts]
prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for r in rows]
start = time.perf_counter()
if kind == "vllm-compiled":  # our engine's settings with CPU eager mode off: torch.compile at start-up
    import vllm_engine
    from vllm import LLM, SamplingParams
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model="models/smollm2", dtype="float32", max_model_len=1024, seed=0, enforce_eager=False,
              logprobs_mode="processed_logprobs", **vllm_engine.cpu_scheduling(False, 1024), log_level="WARNING")
    def generate(seed):
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=256, logprobs=0 if logprobs else None, seed=seed)
        return [list(c.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False) for c in o.outputs]
else:
    engine = make_engine(kind, "models/smollm2", max_model_len=1024, seed=0, device=torch.device("cpu"),
                         sequences=n_prompts * 8, memory_gib=free_memory_gib(torch.device("cpu"), 1))  # as train_grpo
    llm = getattr(engine, "llm", None)
    def generate(seed):
        seeds = list(range(seed * n_prompts, (seed + 1) * n_prompts))
        return engine.generate(prompts, n=8, max_new_tokens=256, seeds=seeds, logprobs=logprobs).response_ids
startup = time.perf_counter() - start
kv_tokens = None
if llm is not None:
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
rates = []
for r in range(rounds):
    t = time.perf_counter()
    tokens = sum(map(len, generate(r)))
    rates.append((tokens, time.perf_counter() - t))
print("RESULT " + json.dumps({"startup": startup, "kv_tokens": kv_tokens, "threads": torch.get_num_threads(), "rounds": rates}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per vLLM variant (the first includes warm-up)")
    parser.add_argument("--hf-rounds", type=int, default=1, help="rounds for the transformers engine (slow)")
    args = parser.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    for name in names:
        kind, n_prompts, logprobs, env = VARIANTS[name]
        rounds = args.hf_rounds if kind == "hf" else args.rounds
        proc = subprocess.run(
            [sys.executable, "-c", ONE_ENGINE, kind, str(n_prompts), str(int(logprobs)), str(rounds)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), **env},
        )
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
        rates = ", ".join(f"{n / s:.0f} ({n} tokens in {s:.1f} s)" for n, s in result["rounds"])
        kv = f"{result['kv_tokens']:,} tokens" if result["kv_tokens"] else "-"
        print(
            f"{name:>14}: {n_prompts} x 8 sequences, {result['threads']} thread(s), start-up {result['startup']:.1f} s, "
            f"KV cache {kv}; tokens/s per round: {rates}",
            flush=True,
        )


if __name__ == "__main__":
    main()
