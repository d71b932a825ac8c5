"""A tiny randomly-initialised causal LM and word-level tokenizer, built locally (no network).

The demo and the tests train this from scratch. It is saved in Hugging Face format, so everything
that loads a real model (transformers, vLLM, our trainer) loads it the same way, by path:

    python tiny_model.py --out runs/tiny_model

The architecture is Llama at toy size. vLLM's CPU attention needs head_dim 64, so
hidden / heads = 64. (Not Qwen2: transformers 5 loads any qwen2 checkpoint with Qwen's byte-level
tokenizer, whatever tokenizer the checkpoint declares.)
"""

import argparse
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]

# Renders [{"role": "user", "content": "..."}] as "<bos><|user|> ... <|assistant|>"; the model
# answers after <|assistant|> and ends with <eos>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(words):
    """A word-level tokenizer over `words` plus the special tokens: one token per word, split on
    whitespace, decoded with spaces between words."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [w for w in dict.fromkeys(words) if w not in SPECIAL_TOKENS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_tiny_model(out_dir, words, hidden=128, layers=2, heads=2, intermediate=512, seed=0):
    """Write a random-init Llama model and its tokenizer to `out_dir`; returns `out_dir`."""
    tokenizer = build_tokenizer(words)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,  # as in Qwen2.5-0.5B, so weight sync handles tied embeddings
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    args = parser.parse_args()
    print(build_tiny_model(args.out, [str(d) for d in range(10)], seed=args.seed))
