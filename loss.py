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
from loss_variants import LOSS_MODES, VARIANT_ARGS, variant_policy_loss  # noqa: F401  LOSS_MODES: config's choices

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
# The teacher's term (--teacher --distill-loss MODE): verl 0.9.1's distillation losses, by verl's names

DISTILL_LOSSES = dict(KL_KINDS, forward_kl_topk="forward_kl_topk")


def topk_forward_kl(student_topk_logp, teacher_topk_logp, logp_min=0.0):
    """The forward KL over the teacher's top-k tokens at each position, [b, r, K] x 2 -> [b, r] each:

        loss_t = max(0, sum_k p_T,k (log p_T,k - log p_theta,k)),   p_T,k = exp(log p_T,k)
        student_mass_t = sum_k p_theta,k      teacher_mass_t = sum_k p_T,k      (before the clamp)

    k runs over the teacher's k most likely token ids at position t; log p_theta,k is the student's log-prob of
    those same ids. logp_min < 0 clamps both log-probs below (verl's log_prob_min_clamp; 0: off). Outside the
    top k neither distribution sums to 1, so the sum can be negative: it is clamped at 0, as verl does."""
    s, t = student_topk_logp.float(), teacher_topk_logp.float()
    student_mass, teacher_mass = s.exp().sum(-1), t.exp().sum(-1)
    if logp_min < 0:
        s, t = s.clamp_min(logp_min), t.clamp_min(logp_min)
    return (t.exp() * (t - s)).sum(-1).clamp_min(0.0), student_mass, teacher_mass


def distill_loss(logp, old_logp, view, mask, *, args, agg, norm_len, is_weights=None):
    """The teacher's term of a micro-batch's loss, --distill-coef x (verl's distillation_loss):

      k2, k3, abs:       agg(kl_penalty(log pi_theta, log pi_T, mode))      back-propagated through log pi_theta
      forward_kl_topk:   agg(topk_forward_kl(log pi_theta[ids], log pi_T[ids]))   ids: the teacher's top k
      k1, --distill-clip C:  policy_loss with A_t = -(log pi_old - log pi_T), its ratio clipped to [1 - C, 1 + C]

    each token's loss clamped to [-c, c] first with --distill-loss-clamp c. logp [b, r] (and with forward_kl_topk
    the student's log-probs at the teacher's ids, view["student_topk_logp"] [b, r, K]), from the same pass. Where
    we differ from verl (tests/test_verl_reference.py): k1's advantage takes pi_old, fixed for the step as the
    reward's is, where verl takes the current log-prob (equal on-policy); and beta stays --distill-coef with
    --no-reward, where verl sets it to 1. Returns (loss, {distill/loss, distill/loss_max, distill/loss_min,
    with forward_kl_topk distill/student_mass and distill/teacher_mass}: token means or extremes, detached)."""
    mode, on = DISTILL_LOSSES[args.distill_loss], mask.bool()
    metrics = {}
    if mode == "forward_kl_topk":
        losses, student_mass, teacher_mass = topk_forward_kl(
            view["student_topk_logp"], view["teacher_topk_logp"].to(logp.device), args.distill_logp_clamp
        )
        metrics = {
            "distill/student_mass": masked_mean(student_mass, mask),
            "distill/teacher_mass": masked_mean(teacher_mass, mask),
        }
    else:  # k1: the advantage's pi_old, no gradient; the others: the current log-prob, with its gradient
        losses = kl_penalty(old_logp if mode == "k1" else logp, view["teacher_logp"].to(logp.device), mode)  # [b, r]
    metrics |= {"distill/loss_max": losses[on].max(), "distill/loss_min": losses[on].min()} if on.any() else {}
    if args.distill_loss_clamp > 0:
        losses = losses.clamp(-args.distill_loss_clamp, args.distill_loss_clamp)
    if mode == "k1":
        clip = args.distill_clip
        loss, _ = policy_loss(
            logp, old_logp, -losses.detach(), mask, clip, clip, args.clip_c, agg, is_weights, norm_len
        )
    else:
        loss = agg_loss(losses, mask, agg, norm_len)
    metrics["distill/loss"] = loss
    return args.distill_coef * loss, {k: v.detach() for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# The clipped surrogate and its variants


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
    **variant,
):
    """PPO's clipped surrogate with dual clip, the GRPO policy-gradient loss. All inputs [B, T].
    Any other `mode` (LOSS_MODES) computes that variant instead (loss_variants.variant_policy_loss; `variant`:
    their own arguments, VARIANT_ARGS, named and defaulted as in verl).

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
    if mode != "vanilla":
        how = dict(clip_low=clip_low, clip_high=clip_high, agg=agg, rollout_is_weights=rollout_is_weights)
        return variant_policy_loss(mode, logp, old_logp, advantages, mask, norm_len=norm_len, **how, **variant)
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
    reference, + the teacher's term when it is a loss (distill_loss), - entropy_coef x the entropy, each aggregated
    by `agg` (train_grpo's --flags in `args`). logp and token_entropy [b, r]: the policy's, for the micro-batch's
    window of the batch (`view`: policy.window), which carries the advantages and the old, reference, engine and
    teacher log-probs (logp [b, r, 1 + K] with forward_kl_topk: also at the teacher's top-k ids). Returns (loss, {name: number} of every term for the log, the old log-probs [b, r]).

    With --tis-cap C the surrogate is AReaL's decoupled PPO objective, per token t:

        loss_t = -min(w_t, C) * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
        r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav (no gradient),

    pi_behav the engine's log-probs (the policy that sampled: with --max-staleness S, up to S updates
    old), pi_prox the trainer's at the start of the step (old_logp). The clip keeps the update near the
    current policy however stale the samples; w corrects for sampling from pi_behav, capped."""
    device = logp.device
    if logp.dim() == 3:  # forward_kl_topk: [b, r, 1 + K], the sampled token's then the teacher's top-k ids' (one pass)
        logp, view = logp[..., 0], dict(view, student_topk_logp=logp[..., 1:])
    m = view["response_mask"].to(device)  # [b, r]
    old = logp.detach() if view.get("old_logp") is None else view["old_logp"].to(device)  # on-policy: ratio 1
    is_weights = None
    if args.tis_cap > 0:  # truncated importance sampling: the engine sampled, the trainer scores
        is_weights = torch.exp(old - view["engine_logp"].to(device)).clamp(max=args.tis_cap) * m
    adv = view["advantages"].to(device)  # [b, r]
    norm_len = args.loss_scale_factor or args.max_response_length  # Dr. GRPO's constant, never the window's width
    how = dict(clip_low=args.clip_low, clip_high=args.clip_high, clip_c=args.clip_c, agg=agg, norm_len=norm_len)
    variant = {k: getattr(args, k) for k in VARIANT_ARGS}  # what the other --loss-mode's take (loss_variants.py)
    pg_loss, pg_metrics = policy_loss(
        logp, old, adv, m, rollout_is_weights=is_weights, mode=args.loss_mode, **how, **variant
    )
    loss, kl_loss, distilled = pg_loss, torch.zeros(()), {}
    if teacher_in_loss(args):  # --teacher with a --distill-loss of its own (else its term is in the advantages)
        distill, distilled = distill_loss(
            logp, old, view, m, args=args, agg=agg, norm_len=norm_len, is_weights=is_weights
        )
        loss = loss + distill
    if view.get("ref_logp") is not None:
        kl_loss = agg_loss(kl_penalty(logp, view["ref_logp"].to(device), args.kl_kind), m, agg, norm_len)
        loss = loss + args.kl_coef * kl_loss
    entropy = agg_loss(token_entropy, m, agg, norm_len)
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * entropy
    terms = dict(pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, policy_loss=loss, **pg_metrics, **distilled)
    return loss, {k: v.item() for k, v in terms.items()} | {"tokens": m.sum().item()}, old


def teacher_in_loss(args):
    """Whether the teacher's term is a loss of its own (distill_loss): every --distill-loss but k1, and k1 with
    --distill-clip; plain k1 (the default) adds it to each token's advantage instead (distill.teacher_advantages)."""
    return bool(args.teacher) and (DISTILL_LOSSES[args.distill_loss] != "k1" or args.distill_clip > 0)
