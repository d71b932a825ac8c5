"""tiny_model.py: the local model and tokenizer load back through the Auto classes unchanged."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_model import build_tiny_model


def test_tiny_model_round_trips_through_auto_classes(tmp_path):
    words = [str(d) for d in range(10)] + ["list", "pos"]
    path = build_tiny_model(str(tmp_path / "tiny"), words, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    # the word-level tokenizer survives loading (transformers swaps in Qwen's byte-level one for qwen2 configs)
    assert tok.encode("list 1 2 pos 1", add_special_tokens=False) == tok.convert_tokens_to_ids(["list", "1", "2", "pos", "1"])
    assert tok.decode(tok.convert_tokens_to_ids(["1", "2", "<eos>"]), skip_special_tokens=True) == "1 2"
    text = tok.apply_chat_template([{"role": "user", "content": "list 1 2"}], add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|> list 1 2 <|assistant|>"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert config.vocab_size == len(tok) and config.hidden_size // config.num_attention_heads == 64  # vLLM CPU needs 64
    assert config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "1"}], add_generation_prompt=True, return_dict=False)])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    # the same seed gives the same weights
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(tmp_path / "again"), words, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
