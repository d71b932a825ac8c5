"""Real tokenizers, chat templates, vocabularies and weights, on real GSM8K prompts.

The tiny demo model proves little about real models: its prompts are 12 tokens, its vocabulary 20
words, its end-of-turn token its own. Here:
- a random-init Qwen2 with the real Qwen2.5 tokenizer, chat template, generation config and
  151,936-row vocabulary (tests/conftest.py), through both engines and the whole trainer, on 1
  and 2 ranks;
- the real pretrained SmolLM2-135M-Instruct: tests/test_real_smollm2.py.
"""

import json

import pytest
import torch
from conftest import gsm8k_flags, metrics, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

import data_prep
from engine import stop_token_ids
from hf_engine import HFEngine
from logprobs import logprobs_from_logits
from vllm_engine import VLLMEngine

IM_END, ENDOFTEXT = 151645, 151643  # Qwen2.5's end of turn, and its end of text (both EOS in its generation config)
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def gsm8k_prompts(gsm8k_data, qwen_model):
    """Real GSM8K training prompts rendered with Qwen's chat template: token id lists."""
    tok = AutoTokenizer.from_pretrained(qwen_model)
    rows = data_prep.load_dataset(str(gsm8k_data / "train.parquet"))[:64]
    return [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows
    ]


@pytest.fixture(scope="module")
def qwen_vllm(qwen_model):
    pytest.importorskip("vllm")
    engine = VLLMEngine(qwen_model, max_model_len=512, seed=0)
    yield engine
    engine.close()


@pytest.fixture(params=["vllm", "hf"])
def qwen_engine(request, qwen_model):
    if request.param == "vllm":
        return request.getfixturevalue("qwen_vllm")
    return HFEngine(qwen_model, max_model_len=512, seed=0, max_batch_size=32)


def test_prompts_are_rendered_with_the_real_chat_template(gsm8k_data, gsm8k_prompts, qwen_model):
    tok = AutoTokenizer.from_pretrained(qwen_model)
    text = tok.decode(gsm8k_prompts[0])
    question = data_prep.load_dataset(str(gsm8k_data / "train.parquet"))[0]["prompt"][0]["content"]
    assert text == f"{QWEN_SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    lengths = [len(p) for p in gsm8k_prompts]
    assert 80 < sum(lengths) / len(lengths) < 200  # GSM8K-sized, not the demo's 12 tokens


def test_responses_end_at_im_end_with_the_trainers_log_probs(qwen_engine, qwen_model, gsm8k_prompts):
    """Both engines stop at Qwen's end-of-turn token, and sample from exactly the distribution the
    trainer computes: the generation config's top_k 20, top_p 0.8 and repetition_penalty 1.1 do not
    leak into rollouts (any of them would move the log-probs by nats, not 1e-4)."""
    prompts, n = gsm8k_prompts[:6], 4
    out = qwen_engine.generate(prompts, n=n, temperature=1.0, max_new_tokens=24, seeds=list(range(6)))
    ended = [ids for ids, cut in zip(out.response_ids, out.truncated) if not cut]
    assert 0 < len(ended) < len(out.response_ids)  # some end within 24 tokens, some are cut
    for ids in ended:  # the EOS is kept, and nothing follows it
        assert ids[-1] == IM_END and not {IM_END, ENDOFTEXT} & set(ids[:-1])
    for ids, cut in zip(out.response_ids, out.truncated):
        assert not cut or (len(ids) == 24 and IM_END not in ids)

    model = AutoModelForCausalLM.from_pretrained(qwen_model, dtype=torch.float32).eval()
    worst, beyond_top_20 = 0.0, 0
    for k, (ids, engine_logp) in enumerate(zip(out.response_ids, out.logprobs)):
        prompt = prompts[k // n]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[:, len(prompt) - 1 : -1]  # [1, T, V]
        trainer_logp = logprobs_from_logits(logits, torch.tensor([ids]), 1.0)[0]
        worst = max(worst, (trainer_logp - torch.tensor(engine_logp)).abs().max().item())
        ranks = (logits[0] > logits[0].gather(-1, torch.tensor(ids)[:, None])).sum(
            -1
        )  # tokens more likely than the sampled one
        beyond_top_20 += int((ranks >= 20).sum())
    assert worst <= 1e-4
    assert beyond_top_20 > 0  # with top_k 20 in force, no sampled token could rank below 20th


def test_stop_tokens_are_every_eos_of_the_generation_config_and_tokenizer(qwen_model):
    assert stop_token_ids(qwen_model) == [ENDOFTEXT, IM_END]  # what both engines stop at, and the reward strips


def test_a_gsm8k_rollout_over_the_step_budget(qwen_vllm, gsm8k_prompts):
    """The issue's crash: 64 GSM8K prompts x 8 samples, about 7,000 prompt tokens against vLLM's
    4,096 per step, seeded: "CPU Generator does not use offset" before vllm_engine.cpu_scheduling."""
    assert sum(map(len, gsm8k_prompts)) > 4096
    out = qwen_vllm.generate(
        gsm8k_prompts, n=8, temperature=1.0, max_new_tokens=4, seeds=list(range(64)), logprobs=False
    )
    assert len(out.response_ids) == 64 * 8
    alone = qwen_vllm.generate(gsm8k_prompts[40:41], n=8, temperature=1.0, max_new_tokens=4, seeds=[40], logprobs=False)
    assert out.response_ids[40 * 8 : 41 * 8] == alone.response_ids  # seeded per prompt, whatever the batch


# ----------------------------------------------------------------------------------------------
# The whole trainer on real GSM8K prompts


@pytest.fixture(scope="module")
def qwen_runs(tmp_path_factory, qwen_model, gsm8k_head):
    """2 GRPO steps of the random Qwen on GSM8K prompts (KL loss to the reference on, as by
    default): with vLLM on 1 and 2 ranks, and with the transformers engine on 2 ranks. (Its samples
    depend only on each prompt's seed too: tests/test_rollout.py.)"""
    root = tmp_path_factory.mktemp("qwen_runs")
    # a random model never answers a GSM8K question, so every advantage would be 0 and the policy
    # would not move: a reward of the response's length gives the update something to do
    (root / "length_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) / 100\n"
    )
    flags = [
        "--model",
        qwen_model,
        *gsm8k_flags(gsm8k_head),
        "--reward-fn",
        str(root / "length_reward.py"),
        *"--max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --max-response-length 16 --test-freq 2 --val-max-prompts 8 --lr 1e-3 --save-freq -1".split(),
    ]
    for engine, ranks in (("vllm", 1), ("vllm", 2), ("hf", 2)):
        run_script(*flags, "--rollout", engine, "--out-dir", str(root / f"{engine}{ranks}"), ranks=ranks)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["vllm1", "hf2"])
def test_qwen_grpo_on_gsm8k(qwen_runs, run_name):
    run = qwen_runs / run_name
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # the generation config's sampling defaults did not leak
        assert row["training/rollout_logprob_diff_max"] <= 1e-4
        assert row["prompt_length/mean"] > 60 and row["actor/kl_loss"] >= 0
    # the model as built: responses end at <|im_end|>, or at 16 tokens. After one update the length
    # reward has taught it to stop later (at lr 1e-3, all 32 samples can run to 16 tokens)
    assert 0 < rows[1]["response_length/clip_ratio"] < 1
    assert rows[2]["response_length/clip_ratio"] > rows[1]["response_length/clip_ratio"]
    # the reference is a separate, frozen copy (lr 1e-3 moves the policy measurably)
    assert rows[2]["actor/kl_loss"] > 0
    # the prompts the policy saw: the real chat template, with Qwen's default system prompt
    samples = [json.loads(line) for line in open(run / "samples" / "train.jsonl")]
    assert samples and all(s["prompt"].startswith(QWEN_SYSTEM + "<|im_start|>user\n") for s in samples)
    assert all(s["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") for s in samples)
    assert all("<|im_end|>" not in s["response"] for s in samples)  # the reward never sees the end-of-turn token


@pytest.mark.slow
def test_qwen_one_and_two_ranks_draw_the_same_samples_and_make_the_same_update(qwen_runs):
    one, two = metrics(qwen_runs / "vllm1"), metrics(qwen_runs / "vllm2")
    assert len(one) == len(two) == 3
    for a, b in zip(one[1:], two[1:]):
        assert a["response_length/mean"] == b["response_length/mean"] and a["critic/score/mean"] == pytest.approx(
            b["critic/score/mean"], rel=1e-6
        )
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_qwen_final_model_loads_in_transformers_and_vllm(qwen_runs, gsm8k_data):
    from conftest import check_saved_model

    questions = [r["prompt"][0]["content"] for r in data_prep.load_dataset(str(gsm8k_data / "test.parquet"))[:3]]
    assert check_saved_model(qwen_runs / "vllm2" / "final_model", questions) <= 1e-4
    model = AutoModelForCausalLM.from_pretrained(qwen_runs / "hf2" / "final_model")
    assert model.config.vocab_size == 151936 and model.lm_head.weight is model.model.embed_tokens.weight
