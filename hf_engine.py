"""A rollout engine in plain transformers: a batched sampling loop with a KV cache, for machines
without vLLM (a GPU image with only torch and transformers). Slower than vLLM; the same interface
and the same log-probs, computed as vLLM's sampler computes them.

On one rank it holds no model of its own: it generates with the policy's weights as FSDP2 gathers them
(gathered_model), as TRL generates without vLLM, so there is nothing to copy after an update. Elsewhere it
loads its own copy, which the trainer syncs. Decoding: CacheDecoder on the CPU; on CUDA, GraphDecoder, one
CUDA graph replay per token.
"""

import gc
import os
import sys

import torch
from torch.distributed.fsdp import FSDPModule

from engine import Rollout, per_prompt, sample_seeds, stop_token_ids
from model_dir import check_model_path


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
        shares_policy=False,
        cuda_graphs=True,
        verbose=False,
        **unused,
    ):
        """shares_policy (one rank): load no model; generate with the policy's own weights, given by share().
        cuda_graphs: on CUDA, each new token is one replay of a captured decode step (GraphDecoder)."""
        # `verbose` is accepted for VLLMEngine's sake: this engine prints nothing of its own
        check_model_path(model_path)
        from transformers import AutoConfig, AutoModelForCausalLM

        local_gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # eval.py under torchrun: one GPU per rank
        self.device = torch.device(device or (local_gpu if torch.cuda.is_available() else "cpu"))
        self.shares_policy, self.policy, self.model, self.tensors = shares_policy, None, None, {}
        self.gathered = None  # shares_policy: the plain model over the policy's gathered weights
        if not shares_policy:
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, trust_remote_code=False)
            self.model = self.model.to(self.device).eval()
            # name -> tensor in the model; a tied lm_head.weight is the same tensor as the embedding
            self.tensors = self.model.state_dict(keep_vars=True)
        self.model_path = str(model_path)
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        self.graphs = cuda_graphs and self.device.type == "cuda"
        self.eos_ids = stop_token_ids(model_path)  # as vLLM: any EOS of the generation config or the tokenizer
        self.tokenizer = None  # loaded when a stop string is first asked for
        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=False)
        self.pad_id = getattr(config, "pad_token_id", None) or 0  # any id works: padding is masked out
        self.rng = torch.Generator().manual_seed(seed)  # draws prompt seeds when the caller gives none

    def share(self, policy):
        """Generate with `policy`'s own weights from now on (one rank, shares_policy): wake_up gathers them
        into a plain transformers model (gathered_model), sleep frees them. Nothing to copy or sync."""
        self.policy = policy

    @torch.no_grad()
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
        in its text (kept whole, as vLLM keeps it)."""
        if seeds is None:
            seeds = torch.randint(0, 2**31, (len(prompts),), generator=self.rng).tolist()
        budgets = per_prompt(max_new_tokens, len(prompts))
        rows = [list(p) for p in prompts for _ in range(n)]  # [B*n] prompts, prompt-major
        row_seeds = sample_seeds(seeds, len(prompts), n)  # [B*n]
        row_budgets = [b for b in budgets for _ in range(n)]
        rollout, chunk, stops = Rollout(), self.max_batch_size, (set(self.eos_ids) | set(stop_token_ids), list(stop))
        for s in range(0, len(rows), chunk):  # chunks bound the KV cache's memory
            part = slice(s, s + chunk)
            self._generate_batch(
                rollout, rows[part], row_seeds[part], (temperature, top_k, top_p), row_budgets[part], stops
            )
        if not logprobs:
            rollout.logprobs = []  # computed anyway: sampling needs them, and they cost nothing more here
        return rollout

    def _generate_batch(self, rollout, prompts, seeds, sampling, max_new_tokens, stops):
        """Sample one response per row of `prompts` and append them to `rollout`. sampling: (temperature,
        top_k, top_p); max_new_tokens: one per row; stops: (stop token ids, stop strings)."""
        (temperature, top_k, top_p), (stop_ids, stop_strings) = sampling, stops
        B, T0, dev = len(prompts), max(len(p) for p in prompts), self.device
        if T0 >= self.max_model_len:
            raise ValueError(
                f"a prompt of {T0} tokens leaves no room to generate in max_model_len={self.max_model_len}"
            )
        # each row stops at max_new_tokens or at max_model_len, whichever comes first (as in vLLM)
        budget = [min(m, self.max_model_len - len(p)) for m, p in zip(max_new_tokens, prompts)]
        budget = torch.tensor(budget, device=dev)  # [B]
        # left-pad so that every row's next token is at the last position
        input_ids = torch.full((B, T0), self.pad_id, dtype=torch.long, device=dev)  # [B, T0]
        mask = torch.zeros((B, T0), dtype=torch.long, device=dev)  # [B, T0], 1 on real tokens
        for i, p in enumerate(prompts):
            input_ids[i, T0 - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, T0 - len(p) :] = 1
        # each row draws all its uniforms up front from its own generator, so a row's samples do not
        # depend on the rest of the batch, and sampling a step is one batched op: [B, steps]
        steps = int(budget.max())
        uniforms = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(dev)
        eos = torch.tensor(sorted(stop_ids), device=dev)
        ends, generated = [None] * B, [[] for _ in range(B)]  # where a stop string ended each row; tokens
        decoder = (GraphDecoder if self.graphs else CacheDecoder)(self.model, mask, steps)
        logits = decoder.prefill(input_ids)  # [B, V] fp32: each row's first new token
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        tokens, logps = [], []  # per step, [B] each
        for step in range(steps):
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
            at_eos = torch.isin(tok, eos)
            if stop_strings:  # the rows whose text now holds a stop string (even on their last token)
                for g, t in zip(generated, tok.tolist()):
                    g.append(t)
                done |= self._stopped(generated, done | at_eos, ends, stop_strings)
            done |= at_eos | (step + 1 >= budget)
            if done.all():
                break
            logits = decoder.step(tok)  # finished rows keep going, their tokens are cut below
        if getattr(decoder, "failed", None) and self.graphs:  # said once; the eager steps from now on
            self.graphs = False
            print(f"hf_engine: CUDA graphs off, decoding eagerly: {decoder.failed}", file=sys.stderr, flush=True)

        tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # [B, T]
        for i in range(B):
            ids = tokens[i][: int(budget[i]) if ends[i] is None else ends[i]]
            stopped = [t + 1 for t, tok in enumerate(ids) if tok in stop_ids]  # just past each EOS
            stopped = stopped[:1] or ([len(ids)] if ends[i] is not None else [])
            rollout.response_ids.append(ids[: stopped[0]] if stopped else ids)  # the first EOS is kept
            rollout.logprobs.append(logps[i][: len(rollout.response_ids[-1])])
            rollout.truncated.append(not stopped)

    def _stopped(self, generated, done, ends, stop_strings):
        """[B] bools: the rows not done whose last token completed a stop string in their text (vLLM's
        rule); records in `ends` the length each such row ends at."""
        hit = torch.zeros_like(done)
        longest = max(map(len, stop_strings))
        for i in (~done).nonzero().flatten().tolist():
            last = generated[i][-(longest + 1) :]  # a token is at least one character
            text, before = self.decode(last), self.decode(last[:-1])
            if any(s in text and s not in before for s in stop_strings):
                hit[i], ends[i] = True, len(generated[i])
        return hit

    def decode(self, ids):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @torch.no_grad()
    def prompt_logprobs(self, ids):
        """log softmax(logits)[token] of each of ids[1:] given the ones before it: [len(ids) - 1] floats."""
        logits = self.model(torch.tensor([ids], device=self.device)).logits[0, :-1].float()
        return (
            torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device=self.device)[:, None])[:, 0].tolist()
        )

    @torch.no_grad()
    def update_weights(self, named_tensors):
        """Copy (hf_name, full tensor) pairs into the model in place, one at a time."""
        if self.shares_policy:
            raise RuntimeError("update_weights: this engine generates with the policy's own weights; nothing to copy")
        for name, tensor in named_tensors:
            if name not in self.tensors:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of the rollout model "
                    f"(expected Hugging Face names such as {next(iter(self.tensors))!r})"
                )
            self.tensors[name].copy_(tensor)  # also updates a tied lm_head, which shares the tensor

    def wake_up(self):
        """Before generating: with shares_policy, gather the policy's weights (gathered_model); else, on CUDA,
        move the model back from the CPU."""
        if self.shares_policy:
            try:
                self.model = self.gathered = gathered_model(self.policy, self.gathered)
            except Exception as e:  # a model class that cannot be built empty, or lays its tensors out otherwise
                raise RuntimeError(
                    f"the transformers engine could not generate with the policy's own weights ({type(e).__name__}: "
                    f"{e}); --no-engine-shares-policy gives it a copy of its own, synced after every update"
                ) from e
        else:
            self.model.to(self.device)

    def sleep(self):
        """While training: with shares_policy, free the gathered weights (the trainer gathers its own); else, on
        CUDA, move the model to CPU to free GPU memory for training (a no-op on CPU). The cache is not emptied:
        the trainer, in this process, reuses the freed blocks, where an emptied cache made every update map its
        memory afresh (0.56 s against 0.38 s per update on an H200, BENCHMARKS.md)."""
        if self.shares_policy:
            self.model = None
            for module in self.policy.modules() if self.policy is not None else []:
                if isinstance(module, FSDPModule):
                    module.reshard()  # frees what gathered_model gathered
        elif self.device.type == "cuda":
            self.model.to("cpu")  # moves the data of the same Parameters, so self.tensors stays valid

    def close(self):
        self.model = self.tensors = self.policy = self.gathered = None
        gc.collect()


def gathered_model(policy, before=None):
    """One rank: the FSDP2 policy as a plain transformers model whose tensors are the weights FSDP2 gathers for
    a forward (bf16 ones with --dtype bf16): no second copy, and no FSDP2 hooks between the kernels. The same
    class built on the meta device (no memory), then each of its parameters and buffers replaced by the
    policy's own tensor of that name (a tied head by the same one). Valid until the policy reshards. `before`,
    an earlier result, is returned again if it still holds the policy's tensors: FSDP2 gathers into the same
    ones each time."""
    from transformers import AutoModelForCausalLM

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.unshard()  # on one rank a copy of the shard, cast to the compute dtype
    if before is not None and all(t is before.get_parameter(n) for n, t in policy.named_parameters()):
        return before
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(policy.config, attn_implementation=policy.config._attn_implementation)
    for kind, named in (("_parameters", policy.named_parameters), ("_buffers", policy.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            getattr(plain.get_submodule(owner), kind)[attr] = tensor
    missing = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"gathered_model: {type(plain).__name__} has tensors the policy lacks: {missing[:3]}")
    return plain.eval()


# ----------------------------------------------------------------------------------------------
# Decoding: the forward passes of one batch, the prompts' then one per new token


class CacheDecoder:
    """transformers' DynamicCache, grown by one position per token; each forward launches every layer's
    kernels from Python. What the CPU runs (there it measures no slower than GraphDecoder's eager steps)."""

    def __init__(self, model, mask, steps):
        self.model, self.mask, self.cache = model, mask, None  # mask [B, T]: 1 on real tokens

    def prefill(self, input_ids):
        """The logits of each row's first new token, fp32 [B, V], from its left-padded prompt [B, T0]."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        return self._forward(input_ids)

    def step(self, tok):
        """The next logits [B, V] after each row's new token tok [B]."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        return self._forward(tok[:, None])

    def _forward(self, input_ids):
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]  # left padding shifts them
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1].float()


class GraphDecoder:
    """A decode step whose every tensor keeps its address, so that CUDA can replay it: a StaticCache of T0 +
    steps positions, the attention masks made here as [B, 1, query, key] booleans (transformers uses a 4D mask
    as given), and the inputs, positions and masks updated in place. The first step runs eagerly, is then
    captured as a CUDA graph, and every later token is one replay: one launch in place of each layer's kernels
    launched from Python, which made the eager loop CPU-bound on a GPU. Off CUDA every step runs eagerly (the
    tests compare it with CacheDecoder). If capturing fails, the steps run eagerly and `failed` says why."""

    def __init__(self, model, mask, steps):
        from transformers import StaticCache

        B, T0 = mask.shape
        dev, L = mask.device, T0 + steps
        self.model, self.cache = model, StaticCache(config=model.config, max_cache_len=L)
        real = torch.zeros((B, L), dtype=torch.bool, device=dev)  # [B, L] the prompts' real tokens
        real[:, :T0] = mask.bool()
        q, k = torch.arange(T0, device=dev)[:, None], torch.arange(L, device=dev)[None, :]
        # a prompt position sees the real tokens up to itself; a padding position itself only (else no key: NaN)
        self.prefill_mask = ((k <= q) & real[:, None, :] | (k == q))[:, None]  # [B, 1, T0, L]
        self.prefill_positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T0]
        self.visible = real[:, None, None, :].clone()  # [B, 1, 1, L] what a new token sees; grows by one a step
        self.ids = torch.zeros((B, 1), dtype=torch.long, device=dev)  # the token being fed
        self.position = mask.sum(-1, keepdim=True)  # [B, 1] its position: the first new token's is the prompt's length
        self.slot = torch.full((1,), T0, dtype=torch.long, device=dev)  # its place in the cache
        self.graph, self.out, self.failed = None, None, None

    def prefill(self, input_ids):
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.prefill_mask,
            position_ids=self.prefill_positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _decode(self):
        """One token per row: ids at `position`, written to the cache at `slot`; then both move on by one."""
        self.visible.index_fill_(-1, self.slot, True)
        out = self.model(
            input_ids=self.ids,
            attention_mask=self.visible,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.position.add_(1)
        self.slot.add_(1)
        return out.logits[:, -1].float()  # [B, V]

    def step(self, tok):
        self.ids.copy_(tok[:, None])
        if self.graph is not None:
            self.graph.replay()
            return self.out.clone()  # the graph writes the next step's logits into the same tensor
        if self.ids.device.type != "cuda" or self.failed is not None:
            return self._decode()
        # the first step: eagerly, on a side stream (as torch.cuda.graph's documentation warms up), then captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._decode()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # records a step; runs nothing
                self.out = self._decode()
            self.graph = graph
        except Exception as e:  # e.g. a model whose forward reads a value back from the GPU
            self.failed = f"{type(e).__name__}: {e}"
        return logits
