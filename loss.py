"""The GRPO loss of one micro-batch, in the order a reader needs it: the clipped surrogate (policy_loss),
the KL penalty to the reference (kl_penalty), how per-token terms become one number (agg_loss), and
micro_batch_loss, which puts them together and weights the micro-batch so that the gradients summed over
micro-batches and ranks are the whole mini-batch's. The other --loss-mode's per-token terms are one call
into loss_variants.py. The teacher's terms (--teacher --distill-loss) come last, after the GRPO loss: a reader
of GRPO can stop at micro_batch_loss. The log-probs come from logprobs.py.

Shapes: B sequences (prompts x samples), T response tokens. `mask` is 1 on response tokens that
count and 0 on padding. Log-probabilities are in nats. Each function states its formula; the
definitions follow verl's `core_algos.py` so that numbers from the two codebases can be compared.
"""

import torch

from loss_variants import LOSS_MODES, VARIANT_ARGS, variant_token_losses  # noqa: F401  LOSS_MODES: config's choices

# ----------------------------------------------------------------------------------------------
# The clipped surrogate


def clipped_surrogate(logp, old_logp, advantages, clip_low=0.2, clip_high=0.2, clip_c=3.0):
    """PPO's clipped surrogate with dual clip, per token: the GRPO policy-gradient loss before aggregation.
    All inputs [B, T]:

      ratio   = exp(clamp(logp - old_logp, -20, 20))
      l_clip  = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
      l       = min(l_clip, -A * clip_c)   where A < 0   (dual clip: bounds the loss when a token
                l_clip                     where A >= 0   with A < 0 has become far more likely)

    Returns (l [B, T], metrics per token [B, T], detached): pg_clipfrac (1 where the clipped term is the
    larger one: it was clipped), pg_clipfrac_lower (1 where A < 0 and the dual clip bound applied),
    ppo_kl (old_logp - logp, the k1 estimate of KL(old || new)) and the ratio itself (shown, not logged)."""
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1.0 for the dual clip to bound anything, got {clip_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_clip, -advantages * clip_c)
    loss_mat = torch.where(advantages < 0, loss_dual, loss_clip)
    with torch.no_grad():
        dual = ((loss_clip > -advantages * clip_c) & (advantages < 0)).to(logp.dtype)
        clipped = (loss_clipped > loss_unclipped).to(logp.dtype)
        metrics = dict(pg_clipfrac=clipped, pg_clipfrac_lower=dual, ppo_kl=-log_ratio, ratio=ratio.detach())
    return loss_mat, metrics


POLICY_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")  # logged as their masked token means, verl's


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
    """The policy-gradient loss of --loss-mode `mode`, aggregated: clipped_surrogate for vanilla (PPO's, GRPO's),
    another mode's per-token terms from loss_variants.variant_token_losses (`variant`: their own arguments,
    VARIANT_ARGS, named and defaulted as in verl). All inputs [B, T].

      loss = agg_loss(l * w, mask, agg, norm_len)      w = rollout_is_weights, or 1 (no gradient)

    `rollout_is_weights` [B, T] is the truncated importance-sampling correction for the gap between the
    rollout engine and the trainer: w = min(pi_old / pi_engine, cap). gspo, sapo and geo_mean aggregate by
    seq-mean-token-mean whatever `agg` says (loss_agg_for). Returns (loss, metrics: POLICY_METRICS' masked
    token means, those the mode has)."""
    if mode == "vanilla":
        loss_mat, per_token = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, clip_c)
        if rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights.detach()
    else:
        shared = dict(clip_low=clip_low, clip_high=clip_high, rollout_is_weights=rollout_is_weights)
        loss_mat, per_token = variant_token_losses(mode, logp, old_logp, advantages, mask, **shared, **variant)
    return aggregate(loss_mat, per_token, mask, loss_agg_for(mode, agg), norm_len)


def aggregate(loss_mat, per_token, mask, agg, norm_len=None):
    """(agg_loss of the per-token loss, the masked token mean of each of POLICY_METRICS in per_token)."""
    mask_f = mask.to(loss_mat.dtype)
    metrics = {k: masked_mean(v, mask_f) for k, v in per_token.items() if k in POLICY_METRICS}
    return agg_loss(loss_mat, mask_f, agg, norm_len), metrics


# ----------------------------------------------------------------------------------------------
# The KL penalty to the reference model

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
# Aggregation: a [B, T] matrix of per-token terms -> one number

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEQ_MEAN_AGG = "seq-mean-token-mean"


def masked_mean(x, mask):
    """sum(x * mask) / sum(mask); 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat, mask, mode="token-mean", norm_len=None):
    """Reduce a per-token loss [B, T] to a scalar, as verl 0.9 does on one rank.

      token-mean:               sum_{i,t} l_it m_it / sum_{i,t} m_it        (DAPO; verl's default)
      seq-mean-token-sum:       mean_i  sum_t l_it m_it
      seq-mean-token-mean:      mean_i (sum_t l_it m_it / sum_t m_it)      (the original GRPO paper)
      seq-mean-token-sum-norm:  mean_i  sum_t l_it m_it / norm_len          (Dr. GRPO)

    mean_i is over the sequences with at least one unmasked token. Dr. GRPO divides each sequence's
    token sum by one constant instead of by its own length, so that a long response's tokens weigh as
    much as a short one's: `norm_len` is verl's loss_scale_factor, and defaults to T (the padded
    width of this batch). The trainer always passes a constant (--loss-scale-factor, by default
    --max-response-length), never the width of a micro-batch, which changes from batch to batch.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(-1)  # [B]
    seq_valid = (mask.sum(-1) > 0).to(loss_mat.dtype)  # [B]
    if mode == "seq-mean-token-sum":
        return masked_mean(seq_sum, seq_valid)
    if mode == "seq-mean-token-mean":
        return masked_mean(seq_sum / mask.sum(-1).clamp(min=1), seq_valid)
    if mode == "seq-mean-token-sum-norm":
        return masked_mean(seq_sum, seq_valid) / (loss_mat.shape[-1] if norm_len is None else norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {list(AGG_MODES)}")


def agg_denominator(mask, mode):
    """What agg_loss averages a batch over: its unmasked tokens (token-mean) or its sequences with at least one
    unmasked token (every seq-mean-* mode; Dr. GRPO's constant comes on top). micro_batch_loss weights each
    micro-batch by its share of the whole mini-batch's."""
    if mode == "token-mean":
        return mask.sum().item()
    return (mask.sum(-1) > 0).sum().item()


def loss_agg_for(mode, agg):
    """The aggregation --loss-mode `mode` uses: gspo, sapo and geo_mean are means over sequences
    whatever --loss-agg says (SEQ_MEAN_AGG); the others use `agg`. It weights micro-batches
    (agg_denominator), and the KL and entropy terms are aggregated with it too."""
    return SEQ_MEAN_AGG if mode in ("gspo", "sapo", "geo_mean") else agg


def loss_denominator(mask, args):
    """agg_denominator of a batch's mask [N, R] under the run's --loss-mode and --loss-agg."""
    return agg_denominator(mask, loss_agg_for(args.loss_mode, args.loss_agg))


# ----------------------------------------------------------------------------------------------
# One micro-batch's loss


def micro_batch_loss(logp, token_entropy, mb, *, args, whole, world):
    """The loss of one micro-batch `mb` (policy.micro_batch: its rows' advantages and old, reference, engine and
    teacher log-probs [b, r]), from the policy's logp and token_entropy [b, r] (logp [b, r, 1 + K] with
    forward_kl_topk: also at the teacher's top-k ids), each term aggregated by agg_loss:

        loss = policy_loss + kl_coef * agg(kl_penalty(logp, ref_logp)) - entropy_coef * agg(entropy)
               (+ the teacher's term, distill_loss, when it is a loss of its own)

    and weighted for the backward by this micro-batch's share of the whole mini-batch (`whole`: loss_denominator
    of the mini-batch's mask, summed over ranks). With agg a mean over the D tokens (or sequences) of the
    mini-batch, and micro-batch k holding D_k of them, agg over the mini-batch = sum_k (D_k / D) agg over k,
    exactly; FSDP averages the gradients over ranks, so each rank's share is multiplied by `world` first.
    Returns (the weighted loss to back-propagate, {name: number} of every unweighted term for the log, the old
    log-probs [b, r]: logp itself, detached, when the update is on-policy).

    With --tis-cap C the surrogate is AReaL's decoupled PPO objective, per token t:

        loss_t = -min(w_t, C) * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
        r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav (no gradient),

    pi_behav the engine's log-probs (the policy that sampled: with --max-staleness S, up to S updates
    old), pi_prox the trainer's at the start of the step (old_logp). The clip keeps the update near the
    current policy however stale the samples; w corrects for sampling from pi_behav, capped."""
    device = logp.device
    if logp.dim() == 3:  # forward_kl_topk: [b, r, 1 + K], the sampled token's then the teacher's top-k ids' (one pass)
        logp, mb = logp[..., 0], dict(mb, student_topk_logp=logp[..., 1:])
    m = mb["response_mask"].to(device)  # [b, r]
    old = logp.detach() if mb.get("old_logp") is None else mb["old_logp"].to(device)  # on-policy: ratio 1
    is_weights = None
    if args.tis_cap > 0:  # truncated importance sampling: the engine sampled, the trainer scores
        is_weights = torch.exp(old - mb["engine_logp"].to(device)).clamp(max=args.tis_cap) * m
    agg = loss_agg_for(args.loss_mode, args.loss_agg)
    norm_len = args.loss_scale_factor or args.max_response_length  # Dr. GRPO's constant, never the micro-batch's width
    variant = {k: getattr(args, k) for k in VARIANT_ARGS}  # what the other --loss-mode's take (loss_variants.py)
    clip = dict(clip_low=args.clip_low, clip_high=args.clip_high, clip_c=args.clip_c, mode=args.loss_mode)
    pg_loss, pg_metrics = policy_loss(logp, old, mb["advantages"].to(device), m, agg=agg, rollout_is_weights=is_weights,
                                      norm_len=norm_len, **clip, **variant)  # fmt: skip
    loss, kl_loss, distilled = pg_loss, torch.zeros(()), {}
    if mb.get("ref_logp") is not None:
        kl_loss = agg_loss(kl_penalty(logp, mb["ref_logp"].to(device), args.kl_kind), m, agg, norm_len)
        loss = loss + args.kl_coef * kl_loss
    entropy = agg_loss(token_entropy, m, agg, norm_len)
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * entropy
    if teacher_in_loss(args):  # --teacher with a --distill-loss of its own (else its term is in the advantages)
        distill, distilled = distill_loss(
            logp, old, mb, m, args=args, agg=agg, norm_len=norm_len, is_weights=is_weights
        )
        loss = loss + distill
    terms = dict(pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, policy_loss=loss, **pg_metrics, **distilled)
    share = agg_denominator(m, agg) / max(whole, 1) * world  # D_k / D, times the ranks FSDP averages over
    return loss * share, {k: v.item() for k, v in terms.items()} | {"tokens": m.sum().item()}, old


# ----------------------------------------------------------------------------------------------
# The teacher's term (--teacher --distill-loss MODE): verl 0.9.1's distillation losses, by verl's names

DISTILL_LOSSES = dict(KL_KINDS, forward_kl_topk="forward_kl_topk")


def teacher_in_loss(args):
    """Whether the teacher's term is a loss of its own (distill_loss): every --distill-loss but k1, and k1 with
    --distill-clip; plain k1 (the default) adds it to each token's advantage instead (distill.teacher_advantages)."""
    return bool(args.teacher) and (DISTILL_LOSSES[args.distill_loss] != "k1" or args.distill_clip > 0)


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


def distill_loss(logp, old_logp, mb, mask, *, args, agg, norm_len, is_weights=None):
    """The teacher's term of a micro-batch's loss, --distill-coef x (verl's distillation_loss):

      k2, k3, abs:       agg(kl_penalty(log pi_theta, log pi_T, mode))      back-propagated through log pi_theta
      forward_kl_topk:   agg(topk_forward_kl(log pi_theta[ids], log pi_T[ids]))   ids: the teacher's top k
      k1, --distill-clip C:  policy_loss with A_t = -(log pi_old - log pi_T), its ratio clipped to [1 - C, 1 + C]

    each token's loss clamped to [-c, c] first with --distill-loss-clamp c. logp [b, r] (and with forward_kl_topk
    the student's log-probs at the teacher's ids, mb["student_topk_logp"] [b, r, K]), from the same pass. Where
    we differ from verl (tests/test_verl_reference.py): k1's advantage takes pi_old, fixed for the step as the
    reward's is, where verl takes the current log-prob (equal on-policy); and beta stays --distill-coef with
    --no-reward, where verl sets it to 1. Returns (loss, {distill/loss, distill/loss_max, distill/loss_min,
    with forward_kl_topk distill/student_mass and distill/teacher_mass}: token means or extremes, detached)."""
    mode, on = DISTILL_LOSSES[args.distill_loss], mask.bool()
    metrics = {}
    if mode == "forward_kl_topk":
        losses, student_mass, teacher_mass = topk_forward_kl(
            mb["student_topk_logp"], mb["teacher_topk_logp"].to(logp.device), args.distill_logp_clamp
        )
        metrics = {
            "distill/student_mass": masked_mean(student_mass, mask),
            "distill/teacher_mass": masked_mean(teacher_mass, mask),
        }
    else:  # k1: the advantage's pi_old, no gradient; the others: the current log-prob, with its gradient
        losses = kl_penalty(old_logp if mode == "k1" else logp, mb["teacher_logp"].to(logp.device), mode)  # [b, r]
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
