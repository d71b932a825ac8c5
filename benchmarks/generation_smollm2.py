"""Generation on SmolLM2-135M-Instruct at GSM8K length: vLLM as our engine runs it (eager), vLLM with
torch.compile, and our transformers engine, on the same work (BENCHMARKS.md, issue 14 item 2).

    python models.py smollm2 --out models/smollm2
    python data_prep.py gsm8k --input ../shared/data/gsm8k --out data/gsm8k
    python benchmarks/generation_smollm2.py [--rounds 3] [--hf-rounds 1]

8 GSM8K training prompts x 8 samples, temperature 1, up to 256 new tokens, fp32, one process, each
engine in a fresh subprocess. Printed per engine: start-up seconds and tokens/s of each round (the
first vLLM round includes its warm-up). Run it on an otherwise idle machine: about 10 minutes.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# runs in a subprocess: argv = engine, rounds
ONE_ENGINE = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer
from rollout import make_engine
kind, rounds = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained("models/smollm2")
rows = pq.read_table("data/gsm8k/train.parquet").to_pylist()[:8]
prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for r in rows]
start = time.perf_counter()
if kind == "vllm-compiled":  # our engine's settings with CPU eager mode off: torch.compile at start-up
    import rollout
    from vllm import LLM, SamplingParams
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model="models/smollm2", dtype="float32", max_model_len=1024, seed=0, enforce_eager=False,
              logprobs_mode="processed_logprobs", **rollout.cpu_scheduling(False, 1024), log_level="WARNING")
    def generate(seed):
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=256, logprobs=0, seed=seed)  # as our engine asks
        return [list(c.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False) for c in o.outputs]
else:
    engine = make_engine(kind, "models/smollm2", max_model_len=1024, seed=0, device=torch.device("cpu"))
    def generate(seed):
        return engine.generate(prompts, n=8, max_new_tokens=256, seeds=list(range(seed * 8, seed * 8 + 8))).response_ids
startup = time.perf_counter() - start
rates = []
for r in range(rounds):
    t = time.perf_counter()
    tokens = sum(map(len, generate(r)))
    rates.append((tokens, time.perf_counter() - t))
print("RESULT " + json.dumps({"startup": startup, "rounds": rates}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-rounds", type=int, default=1, help="rounds for the transformers engine (slow)")
    args = parser.parse_args()
    for kind, rounds in (("vllm", args.rounds), ("vllm-compiled", args.rounds), ("hf", args.hf_rounds)):
        proc = subprocess.run(
            [sys.executable, "-c", ONE_ENGINE, kind, str(rounds)], cwd=REPO, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
        rates = ", ".join(f"{n / s:.0f} ({n} tokens in {s:.1f} s)" for n, s in result["rounds"])
        print(f"{kind:>14}: start-up {result['startup']:.1f} s; tokens/s per round: {rates}")


if __name__ == "__main__":
    main()
