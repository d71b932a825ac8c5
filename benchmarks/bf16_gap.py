"""Is the engine-vs-trainer gap in bf16 a difference between vLLM and transformers, or bf16's own
rounding? Three log-probs of the same sampled tokens, compared in pairs.

    python models.py smollm2 --out models/smollm2 && python data_prep.py multiply --out data/multiply
    python benchmarks/bf16_gap.py [--model models/smollm2] [--data data/multiply/train.parquet]

vLLM in bf16 samples --samples answers to each of the first --prompts prompts (temperature 1,
the per-token log-probs of what it sampled kept). transformers then scores the same tokens with
the model in bf16 and in fp32. Printed for each pair: the largest per-token log-prob difference
(what training/rollout_logprob_diff_max reports), the mean absolute one, and the mean and largest
probability difference (training/rollout_probs_diff_*). If transformers bf16 against transformers
fp32, the same code in two dtypes, differs as much as vLLM against transformers in bf16, the gap
is bf16's rounding and no difference between the two implementations is left to remove.
"""

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

import pandas as pd
import torch


def sample_with_vllm(model_dir, prompt_ids, samples, max_tokens):
    """[(prompt ids, answer ids, vLLM's log-probs [r])] for `samples` answers per prompt, in bf16."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, max_model_len=512, enforce_eager=True)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=0)
    out = []
    for p, result in zip(prompt_ids, llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)):
        for c in result.outputs:
            out.append((p, list(c.token_ids), torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])))
    return out


@torch.no_grad()
def score_with_transformers(model_dir, seqs, dtype):
    """transformers' log-probs of each answer's tokens, the model loaded in `dtype`; fp32 softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    for prompt, answer, _ in seqs:
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None])[:, 0])
    return out


def compare(a, b):
    d = torch.cat([x - y for x, y in zip(a, b)]).abs()
    p = torch.cat([(x.exp() - y.exp()) for x, y in zip(a, b)]).abs()
    return f"logprob_diff_max {d.max():.3g}, mean |logprob diff| {d.mean():.3g}, probs_diff_mean {p.mean():.3g}, probs_diff_max {p.max():.3g}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--data", default="data/multiply/train.parquet", help="a parquet in verl's schema (its prompts)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = pd.read_parquet(args.data).head(args.prompts)
    texts = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=False) for m in rows["prompt"]]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    seqs = sample_with_vllm(args.model, prompt_ids, args.samples, args.max_tokens)
    logp = {
        "vLLM bf16": [s[2] for s in seqs],
        "transformers bf16": score_with_transformers(args.model, seqs, torch.bfloat16),
        "transformers fp32": score_with_transformers(args.model, seqs, torch.float32),
    }
    print(f"{len(seqs)} answers, {sum(len(s[1]) for s in seqs)} tokens, sampled by vLLM in bf16 at temperature 1")
    for a, b in (
        ("vLLM bf16", "transformers bf16"),
        ("transformers bf16", "transformers fp32"),
        ("vLLM bf16", "transformers fp32"),
    ):
        print(f"{a} against {b}: {compare(logp[a], logp[b])}")


if __name__ == "__main__":
    main()
