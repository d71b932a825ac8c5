"""models.py: every model it builds loads back through the Auto classes as a normal Hugging Face
directory, with its real tokenizer, chat template and end-of-turn token."""

import subprocess
import sys

import torch
from conftest import QWEN_DIR, REPO, need
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from models import build_random_model, build_tiny_model


def test_tiny_model_round_trips_through_auto_classes(tmp_path):
    words = [str(d) for d in range(10)] + ["list", "pos"]
    path = build_tiny_model(str(tmp_path / "tiny"), words, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    # the word-level tokenizer survives loading (transformers swaps in Qwen's byte-level one for qwen2 configs)
    assert tok.encode("list 1 2 pos 1", add_special_tokens=False) == tok.convert_tokens_to_ids(
        ["list", "1", "2", "pos", "1"]
    )
    assert tok.decode(tok.convert_tokens_to_ids(["1", "2", "<eos>"]), skip_special_tokens=True) == "1 2"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "list 1 2"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos><|user|> list 1 2 <|assistant|>"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert config.vocab_size == len(tok) and config.hidden_size // config.num_attention_heads == 64  # vLLM CPU needs 64
    assert config.eos_token_id == tok.eos_token_id
    ids = torch.tensor(
        [tok.apply_chat_template([{"role": "user", "content": "1"}], add_generation_prompt=True, return_dict=False)]
    )
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    # the same seed gives the same weights
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(tmp_path / "again"), words, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_random_model_keeps_the_real_tokenizer_vocabulary_and_template(tmp_path):
    need(QWEN_DIR)
    path = build_random_model(
        str(tmp_path / "q"),
        QWEN_DIR,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert config.model_type == "qwen2" and config.vocab_size == 151936 and len(tok) == 151665
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.num_key_value_heads) == (
        128,
        2,
        64,
        1,
    )
    assert config.intermediate_size == 4864 and config.tie_word_embeddings  # what was not overridden stays
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    generation = GenerationConfig.from_pretrained(
        path
    )  # copied as it is: the trainer must ignore its sampling defaults
    assert (
        generation.eos_token_id == [151645, 151643] and generation.top_k == 20 and generation.repetition_penalty == 1.1
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.shape == (151936, 128)


def test_random_model_cli_names_a_missing_config(tmp_path):
    proc = subprocess.run(
        [sys.executable, "models.py", "random", "--like", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode != 0
        and f"models.py random: {tmp_path}: not a model directory (no config.json there)" in proc.stderr
    )


def test_tiny_cli_builds_the_demos_model_whose_vocabulary_covers_the_task(tmp_path):
    """`python models.py tiny` writes what `train_grpo.py --model tiny` builds (TASK_WORDS):
    a digits-only vocabulary would read the task's "list", "first" and "last" as <unk>."""
    from tasks.digits import TASK_WORDS

    proc = subprocess.run(
        [sys.executable, "models.py", "tiny", "--out", str(tmp_path / "cli")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli, demo = str(tmp_path / "cli"), build_tiny_model(str(tmp_path / "demo"), TASK_WORDS, seed=0)
    tok = AutoTokenizer.from_pretrained(cli)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(demo).get_vocab()
    for text in ("list 2 9 1 4 1 7 last", "list 0 1 2 3 4 5 first"):
        assert tok.unk_token_id not in tok.encode(text, add_special_tokens=False)
    a, b = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (cli, demo))
    assert all(torch.equal(a[k], b[k]) for k in a)
