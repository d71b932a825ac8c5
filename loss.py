"""The GRPO objective: KL estimators, the clipped policy-gradient surrogate (its --loss-mode variants
are in loss_variants.py, how token terms become one number in loss_agg.py), and a micro-batch's whole
loss. The log-probs it takes come from logprobs.py.

Shapes: B sequences (prompts x samples), T response tokens. `mask` is 1 on response tokens that
count and 0 on padding. Log-probabilities are in nats.

Each function states its formula; the definitions follow verl's `core_algos.py` so that numbers
from the two codebases can be compared directly.
"""

import torch

from loss_agg import agg_loss, masked_mean
from loss_variants import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
)

# ----------------------------------------------------------------------------------------------
# KL estimators

KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, [B, T] -> [B, T].

    With d = logp - ref_logp (tokens sampled from pi):
      k1  ("kl"):          d                                    unbiased, high variance, can be < 0
      abs:                 |d|
      k2  ("mse"):         d^2 / 2
      k3  ("low_var_kl"):  exp(-d) - (-d) - 1 = r - log r - 1,  r = pi_ref / pi
                           unbiased, low variance, always >= 0 (Schulman, "Approximating KL").
                           As in verl, log r is clamped to [-20, 20] and the value to [-10, 10].
    verl's names are accepted as aliases.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_KINDS)}")
    kind = KL_KINDS[kind]
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    log_r = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)


# ----------------------------------------------------------------------------------------------
# The clipped surrogate and its variants

LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")


def policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    clip_c=3.0,
    agg="token-mean",
    rollout_is_weights=None,
    norm_len=None,
    mode="vanilla",
    tau_pos=1.0,
    tau_neg=1.05,
    clip_cov_ratio=2e-4,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    kl_cov_ratio=2e-4,
    ppo_kl_coef=0.1,
):
    """PPO's clipped surrogate with dual clip, the GRPO policy-gradient loss. All inputs [B, T].
    Any other `mode` (LOSS_MODES) computes that variant instead: gspo_policy_loss, cispo_policy_loss,
    sapo_policy_loss, geo_mean_policy_loss, clip_cov_policy_loss, kl_cov_policy_loss (see each; they
    take what they use of these arguments, and their own, named and defaulted as in verl).

      ratio   = exp(clamp(logp - old_logp, -20, 20))
      l_clip  = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
      l       = min(l_clip, -A * clip_c)   where A < 0   (dual clip: bounds the loss when a token
                l_clip                     where A >= 0   with A < 0 has become far more likely)
      loss    = agg_loss(l * w, mask, agg, norm_len)   w = rollout_is_weights, or 1

    `rollout_is_weights` [B, T] is the truncated importance-sampling correction for the gap
    between the rollout engine and the trainer: w = min(pi_old / pi_engine, cap), no gradient.

    Returns (loss, metrics). Metrics, all masked token means and detached:
      pg_clipfrac        share of tokens where the clipped term is the larger one (it was clipped)
      pg_clipfrac_lower  share of tokens with A < 0 where the dual clip bound applied
      ppo_kl             mean of old_logp - logp (k1 estimate of KL(old || new))
    """
    inputs, w = (logp, old_logp, advantages, mask), rollout_is_weights  # each variant's own arguments follow
    if mode == "gspo":
        return gspo_policy_loss(*inputs, clip_low, clip_high, w)
    if mode == "cispo":
        return cispo_policy_loss(*inputs, clip_low, clip_high, agg, w, norm_len)
    if mode == "sapo":
        return sapo_policy_loss(*inputs, tau_pos, tau_neg, w)
    if mode == "geo_mean":
        return geo_mean_policy_loss(*inputs, clip_low, clip_high, w)
    if mode == "clip_cov":
        return clip_cov_policy_loss(
            *inputs, clip_low, clip_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, agg, w, norm_len
        )
    if mode == "kl_cov":
        return kl_cov_policy_loss(*inputs, kl_cov_ratio, ppo_kl_coef, agg, w, norm_len)
    if mode != "vanilla":
        raise ValueError(f"unknown policy loss mode {mode!r}; expected one of {list(LOSS_MODES)}")
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1.0 for the dual clip to bound anything, got {clip_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_clip, -advantages * clip_c)
    loss_mat = torch.where(advantages < 0, loss_dual, loss_clip)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()

    mask_f = mask.to(loss_mat.dtype)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(mask_f.dtype), mask_f),
            "pg_clipfrac_lower": masked_mean(
                ((loss_clip > -advantages * clip_c) & (advantages < 0)).to(mask_f.dtype), mask_f
            ),
            "ppo_kl": masked_mean(-log_ratio, mask_f),
        }
    return agg_loss(loss_mat, mask_f, agg, norm_len), metrics


def micro_batch_loss(logp, token_entropy, view, *, agg, args):
    """The loss of one micro-batch: the clipped surrogate or its --loss-mode variant, + kl_coef x the KL to the
    reference, - entropy_coef x the entropy, each aggregated by `agg` (train_grpo's --flags in
    `args`). logp and token_entropy [b, r]: the policy's, for the micro-batch's window of the batch
    (`view`: policy.window), which carries the advantages and the old, reference and engine
    log-probs. Returns (loss, {name: number} of every term for the log, the old log-probs [b, r]).

    With --tis-cap C the surrogate is AReaL's decoupled PPO objective, per token t:

        loss_t = -min(w_t, C) * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
        r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav (no gradient),

    pi_behav the engine's log-probs (the policy that sampled: with --max-staleness S, up to S updates
    old), pi_prox the trainer's at the start of the step (old_logp). The clip keeps the update near the
    current policy however stale the samples; w corrects for sampling from pi_behav, capped."""
    device = logp.device
    m = view["response_mask"].to(device)  # [b, r]
    old = logp.detach() if view.get("old_logp") is None else view["old_logp"].to(device)  # on-policy: ratio 1
    is_weights = None
    if args.tis_cap > 0:  # truncated importance sampling: the engine sampled, the trainer scores
        is_weights = torch.exp(old - view["engine_logp"].to(device)).clamp(max=args.tis_cap) * m
    adv = view["advantages"].to(device)  # [b, r]
    norm_len = args.loss_scale_factor or args.max_response_length  # Dr. GRPO's constant, never the window's width
    pg_loss, pg_metrics = policy_loss(
        logp,
        old,
        adv,
        m,
        clip_low=args.clip_low,
        clip_high=args.clip_high,
        clip_c=args.clip_c,
        agg=agg,
        rollout_is_weights=is_weights,
        norm_len=norm_len,
        mode=args.loss_mode,
        tau_pos=args.tau_pos,
        tau_neg=args.tau_neg,
        clip_cov_ratio=args.clip_cov_ratio,
        clip_cov_lb=args.clip_cov_lb,
        clip_cov_ub=args.clip_cov_ub,
        kl_cov_ratio=args.kl_cov_ratio,
        ppo_kl_coef=args.ppo_kl_coef,
    )
    loss, kl_loss = pg_loss, torch.zeros(())
    if view.get("ref_logp") is not None:
        kl_loss = agg_loss(kl_penalty(logp, view["ref_logp"].to(device), args.kl_kind), m, agg, norm_len)
        loss = loss + args.kl_coef * kl_loss
    entropy = agg_loss(token_entropy, m, agg, norm_len)
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * entropy
    terms = dict(pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, policy_loss=loss, **pg_metrics)
    return loss, {k: v.item() for k, v in terms.items()} | {"tokens": m.sum().item()}, old
