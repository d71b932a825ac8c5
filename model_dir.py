"""A model directory, checked before anything loads it: the files at fault named, and nothing in it
that can run code. Ours, downloaded or copied, for --model, --reward-model and the engines.

    check_model_path(DIR)      # FileNotFoundError or ValueError naming the file, or None
    check_context_length(DIR, max_prompt_length, max_response_length)

Cheap: it reads JSON files and the safetensors headers only. A hub id that is not a local path passes
unchecked (transformers and vLLM check what they download; we load with trust_remote_code=False).
"""

import glob
import json
import os
import re

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
    config = read_json(os.path.join(path, "config.json"))
    if not os.path.isfile(os.path.join(path, "config.json")) or ("model_type" not in config and is_a_run(path)):
        raise FileNotFoundError(not_a_model_directory(path))  # a run directory's config.json holds its flags
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


def load_checked(model_class, path, **kwargs):
    """model_class.from_pretrained(path, **kwargs) with trust_remote_code=False, refused by check_loaded when the
    weights lack a parameter the model needs."""
    model, info = model_class.from_pretrained(path, trust_remote_code=False, output_loading_info=True, **kwargs)
    check_loaded(path, info)
    return model


def check_loaded(path, info):
    """transformers' loading report (from_pretrained(..., output_loading_info=True)) -> a SystemExit naming the
    parameters the directory's weights lacked: transformers initialises them at random and says so only in its
    log, and a teacher, reward model or policy with a random head trains the student toward noise. The usual
    cause: config.json says tie_word_embeddings false for weights saved with the head tied to the embeddings."""
    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return
    tied = read_json(os.path.join(str(path), "config.json")).get("tie_word_embeddings")
    hint = (
        "config.json says tie_word_embeddings false: if the model it came from ties its head to the embeddings, set "
        "it true; else"
        if tied is False and any(k.endswith("lm_head.weight") for k in missing)
        else "The weights are incomplete:"
    )
    raise SystemExit(
        f"model directory {str(path)!r}: its weights lack {len(missing)} parameter(s) the model needs "
        f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}), which transformers would initialise at "
        f"random. {hint} copy or export the model again, with all of its weights"
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
    if is_a_run(path):
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


def is_a_run(path):
    """Whether `path` is a training run's directory (train_grpo.py's --out-dir): its metrics, or checkpoints."""
    names = os.listdir(path)
    return any(
        n in ("latest_checkpointed_iteration.txt", "metrics.jsonl") or n.startswith("global_step_") for n in names
    )


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
