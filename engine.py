"""What every rollout engine shares (vllm_engine.py, hf_engine.py): one interface, generate(prompts, n,
...) -> Rollout with each response token's log-prob, update_weights, sleep and wake_up; the tokens
that end a response; and each sample's seed. rollout.py drives an engine through it.

Log-probs are those of the distribution each token was drawn from, log softmax(logits / T)[token] in
fp32 nats, what the trainer computes (logprobs.logprobs_from_logits); with top_k / top_p they are over
the kept tokens, renormalised, and greedy (T = 0) reports them at temperature 1.

Seeds: a prompt's n samples get seeds s*n .. s*n+n-1 from its seed s (rollout.sampling_seeds). The two
engines draw different samples.
"""

from dataclasses import dataclass, field


@dataclass
class Rollout:
    """The samples of one `generate` call, prompt-major: prompt i's n samples are at [i*n:(i+1)*n]."""

    response_ids: list[list[int]] = field(default_factory=list)  # [B*n][T_i], EOS included when generated
    logprobs: list[list[float]] = field(
        default_factory=list
    )  # [B*n][T_i] nats, log softmax(logits / temperature); [] if not asked
    truncated: list[bool] = field(default_factory=list)  # [B*n], True when max_new_tokens ran out before EOS
    # multi-turn (multi_turn.py) only, else []: per response token, 1 if the model wrote it, 0 if a tool's
    # result or the chat template's framing; and per sample, its conversation (multi_turn.Turns)
    model_mask: list[list[int]] = field(default_factory=list)  # [B*n][T_i]
    turns: list = field(default_factory=list)  # [B*n]


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


def per_prompt(max_new_tokens, n_prompts):
    """max_new_tokens as one budget per prompt: an int for all of them, or already a list of them."""
    return [max_new_tokens] * n_prompts if isinstance(max_new_tokens, int) else list(max_new_tokens)


def sample_seeds(seeds, n_prompts, n):
    """The seed of each sample, prompt-major [B*n]: prompt seed s -> s*n + j for sample j."""
    if len(seeds) != n_prompts:
        raise ValueError(f"got {len(seeds)} seeds for {n_prompts} prompts; pass one seed per prompt or None")
    return [int(s) * n + j for s in seeds for j in range(n)]
