"""A rollout engine in plain transformers: a batched sampling loop with a KV cache, for machines
without vLLM (a GPU image with only torch and transformers). Slower than vLLM; the same interface
and the same log-probs, computed as vLLM's sampler computes them.
"""

import gc
import os

import torch

from models import check_model_path
from rollout import Rollout, sample_seeds, stop_token_ids


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
