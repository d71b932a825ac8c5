"""A rollout engine in plain transformers: a batched sampling loop with a KV cache, for machines
without vLLM (a GPU image with only torch and transformers). Slower than vLLM; the same interface
and the same log-probs, computed as vLLM's sampler computes them.
"""

import gc
import os

import torch

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
        self.model_path = str(model_path)
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        self.eos_ids = stop_token_ids(model_path)  # as vLLM: any EOS of the generation config or the tokenizer
        self.tokenizer = None  # loaded when a stop string is first asked for
        self.pad_id = getattr(self.model.config, "pad_token_id", None) or 0  # any id works: padding is masked out
        self.rng = torch.Generator().manual_seed(seed)  # draws prompt seeds when the caller gives none
        # name -> tensor in the model; a tied lm_head.weight is the same tensor as the embedding
        self.tensors = self.model.state_dict(keep_vars=True)

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
        from transformers import DynamicCache

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
        uniforms = torch.stack(
            [torch.rand(int(budget.max()), generator=torch.Generator().manual_seed(s)) for s in seeds]
        ).to(dev)
        eos = torch.tensor(sorted(stop_ids), device=dev)
        ends, generated = [None] * B, [[] for _ in range(B)]  # where a stop string ended each row; tokens
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
            at_eos = torch.isin(tok, eos)
            if stop_strings:  # the rows whose text now holds a stop string (even on their last token)
                for g, t in zip(generated, tok.tolist()):
                    g.append(t)
                done |= self._stopped(generated, done | at_eos, ends, stop_strings)
            done |= at_eos | (step + 1 >= budget)
            if done.all():
                break
            input_ids = tok[:, None]  # [B, 1]; finished rows keep going, their tokens are cut below
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)

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
        for name, tensor in named_tensors:
            if name not in self.tensors:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of the rollout model "
                    f"(expected Hugging Face names such as {next(iter(self.tensors))!r})"
                )
            self.tensors[name].copy_(tensor)  # also updates a tied lm_head, which shares the tensor

    def sleep(self):
        """Move the model to CPU while training, to free GPU memory for it; a no-op on CPU. The cache is
        not emptied: the trainer, in this process, reuses the freed blocks, where an emptied cache made
        every update map its memory afresh (0.56 s against 0.38 s per update on an H200, BENCHMARKS.md)."""
        if self.device.type == "cuda":
            self.model.to("cpu")  # moves the data of the same Parameters, so self.tensors stays valid

    def wake_up(self):
        self.model.to(self.device)

    def close(self):
        self.model = self.tensors = None
        gc.collect()
