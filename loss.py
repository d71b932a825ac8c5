"""The GRPO objective: KL estimators, loss aggregation, the clipped policy-gradient surrogate and
its variants (--loss-mode), and a micro-batch's whole loss. The log-probs it takes come from
logprobs.py.

Shapes: B sequences (prompts x samples), T response tokens. `mask` is 1 on response tokens that
count and 0 on padding. Log-probabilities are in nats.

Each function states its formula; the definitions follow verl's `core_algos.py` so that numbers
from the two codebases can be compared directly.
"""

import torch

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
# Loss aggregation

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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
    --max-response-length), never the width of a micro-batch's window, which changes from batch to batch.
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
    """What agg_loss averages this batch over: its unmasked tokens (token-mean) or its sequences
    with at least one unmasked token (every seq-mean-* mode; Dr. GRPO's constant comes on top).

    A batch split into micro-batches (and over ranks) gives exactly agg_loss of the whole batch
    when each piece's loss is weighted by  piece's denominator / whole batch's denominator, and the
    weighted losses are summed.
    """
    if mode == "token-mean":
        return mask.sum().item()
    return (mask.sum(-1) > 0).sum().item()


# ----------------------------------------------------------------------------------------------
# The clipped surrogate and its variants

LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")
SEQ_MEAN_AGG = "seq-mean-token-mean"


def loss_agg_for(mode, agg):
    """The aggregation --loss-mode `mode` uses: gspo, sapo and geo_mean are means over sequences
    whatever --loss-agg says (SEQ_MEAN_AGG); the others use `agg`. The trainer weights micro-batches
    by it (agg_denominator) and aggregates the KL and entropy terms with it too."""
    return SEQ_MEAN_AGG if mode in ("gspo", "sapo", "geo_mean") else agg


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


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4, rollout_is_weights=None):
    """GSPO (Zheng et al. 2025): the clipped surrogate on a per-sequence ratio, as verl's
    compute_policy_loss_gspo. All inputs [B, T].

      log s_i  = sum_t (logp_it - old_logp_it) m_it / max(sum_t m_it, 1)      length-normalized seq ratio
      log s_it = min(logp_it - sg(logp_it) + sg(log s_i), 10)                  sg = stop-gradient (detach)
      l_it     = max(-A_it * s_it, -A_it * clamp(s_it, 1 - clip_low, 1 + clip_high))
      loss     = agg_loss(l * w, mask, "seq-mean-token-mean")                  w = rollout_is_weights, or 1

    s_it has the value s_i (the same for every token of sequence i), and its gradient is
    s_i * grad(logp_it): the sequence ratio weights each token's policy gradient, and a sequence
    whose clipped term wins (s_i past the clip range on the side A favours) gives no gradient. GSPO's clip range is far narrower than PPO's (the paper uses
    3e-4 / 4e-4): pass it as clip_low / clip_high.

    What we matched in verl: no dual clip (clip_c is not used); log s_it is clamped from above only,
    at 10, and logp - old_logp is not clamped at +-20 as in the vanilla loss; the aggregation is
    always seq-mean-token-mean (SEQ_MEAN_AGG), whatever the caller's agg; rollout_is_weights multiply the
    per-token loss before aggregation.

    Returns (loss, metrics), with verl's definitions (masked token means, detached):
      pg_clipfrac        share of tokens where the clipped term is the larger one
      pg_clipfrac_lower  0 (there is no dual clip; kept so the logged keys do not change)
      ppo_kl             mean of old_logp - logp, per token, not clamped
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    seq_log_ratio = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)  # [B], log s_i
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [B, T], value log s_i
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))  # [B, T]
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(mask_f.dtype), mask_f),
            "pg_clipfrac_lower": torch.zeros((), dtype=mask_f.dtype, device=mask_f.device),
            "ppo_kl": masked_mean(-log_ratio, mask_f),
        }
    return agg_loss(loss_mat, mask_f, SEQ_MEAN_AGG), metrics


def _zero(like):
    """The 0 verl logs for a metric a variant does not have, on like's device."""
    return torch.zeros((), dtype=like.dtype, device=like.device)


def cispo_policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    agg="token-mean",
    rollout_is_weights=None,
    norm_len=None,
):
    """CISPO (MiniMax-M1, Chen et al. 2025): each token's REINFORCE term, weighted by its importance
    ratio clipped and detached, as verl's compute_policy_loss_cispo. All inputs [B, T].

      r    = exp(clamp(logp - old_logp, -20, 20))
      l    = -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp       sg = stop-gradient (detach)
      loss = agg_loss(l * w, mask, agg, norm_len)                          w = rollout_is_weights, or 1

    d l / d logp = -clamp(r, ...) * A: a token whose ratio left the range keeps its gradient, with the
    weight capped, where PPO's clip would give it none. The value is -A logp weighted, not a ratio.

    Returns (loss, metrics): pg_clipfrac (share of tokens with r outside the range),
    pg_clipfrac_lower (0), ppo_kl (mean of old_logp - logp, clamped as above); masked token means.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss_mat = -weight * advantages * logp
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    with torch.no_grad():
        clipped = (ratio != weight).to(mask_f.dtype)
        metrics = dict(pg_clipfrac=masked_mean(clipped, mask_f), pg_clipfrac_lower=_zero(mask_f))
        metrics["ppo_kl"] = masked_mean(-log_ratio, mask_f)
    return agg_loss(loss_mat, mask_f, agg, norm_len), metrics


def sapo_policy_loss(logp, old_logp, advantages, mask, tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None):
    """SAPO (Gao et al. 2025): a smooth gate on the ratio in place of the clip, as verl's
    compute_policy_loss_sapo. All inputs [B, T].

      r    = exp(clamp(logp - old_logp, -20, 20))
      tau  = tau_pos where A > 0, tau_neg where A <= 0
      f(r) = sigmoid(tau (r - 1)) * 4 / tau
      l    = -f(r) * A
      loss = agg_loss(l * w, mask, "seq-mean-token-mean")                  w = rollout_is_weights, or 1

    d l / d logp = -A * 4 s (1 - s) r with s = sigmoid(tau (r - 1)): exactly the policy gradient -A at
    r = 1; 4 s (1 - s) is a bell of width about 1 / tau around r = 1, so a token far off-policy gets
    little gradient, fading smoothly (sooner for a larger tau) instead of PPO's hard cut.
    The aggregation is always seq-mean-token-mean (SEQ_MEAN_AGG), as in verl.

    Returns (loss, metrics): pg_clipfrac and pg_clipfrac_lower (0: nothing is clipped), ppo_kl
    (mean of old_logp - logp, clamped as above).
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    tau = torch.full_like(advantages, tau_neg).masked_fill_(advantages > 0, tau_pos)  # [B, T]
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    with torch.no_grad():
        metrics = dict(pg_clipfrac=_zero(mask_f), pg_clipfrac_lower=_zero(mask_f))
        metrics["ppo_kl"] = masked_mean(-log_ratio, mask_f)
    return agg_loss(loss_mat, mask_f, SEQ_MEAN_AGG), metrics


def geo_mean_policy_loss(logp, old_logp, advantages, mask, clip_low=0.4, clip_high=0.4, rollout_is_weights=None):
    """GMPO (Zhao et al. 2025): the geometric mean of a sequence's token ratios, each clipped in log
    space, as verl's compute_policy_loss_geo_mean. All inputs [B, T]; n_i = sum_t m_it.

      d_t  = logp_t - old_logp_t                                            (not clamped)
      e_t  = s_t min(s_t d_t, s_t clamp(d_t, -clip_low, clip_high)),  s_t = sign(A_t)
      R_i  = exp(sum_t e_t m_t / n_i)              the geometric mean of the clipped token ratios
      l_i  = -(sum_t A_t m_t / n_i) * R_i * W_i,   W_i = exp(sum_t log(w_t) m_t / n_i), 1 without w
      loss = mean of l_i over the sequences with n_i > 0

    The clip is one-sided: A > 0 caps d_t at clip_high, A < 0 floors it at -clip_low (no gradient
    there), A = 0 makes e_t = 0. The paper's range is (e^-0.4, e^0.4): --clip-low 0.4 --clip-high 0.4.

    Where we differ from verl: verl averages l_i over all B sequences, those without tokens too; we
    average over those with tokens, as agg_loss's seq-mean modes (and verl's) do, so that a sequence
    masked whole (--mask-truncated) counts for nothing. verl divides by n_i + 1e-8, we by n_i.

    Returns (loss, metrics): pg_clipfrac and pg_clipfrac_lower (shares of tokens with d_t outside
    [-clip_low, clip_high] and A > 0, resp. A < 0), ppo_kl (mean of -d_t); masked token means.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    sign = torch.sign(advantages)
    in_range = torch.clamp(log_ratio, -clip_low, clip_high)
    clipped = sign * torch.minimum(sign * log_ratio, sign * in_range)  # [B, T], e_t
    n = mask_f.sum(-1)  # [B]
    ratio = torch.exp((clipped * mask_f).sum(-1) / n.clamp(min=1))  # [B], R_i
    seq_loss = -(advantages * mask_f).sum(-1) / n.clamp(min=1) * ratio  # [B]
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach().clamp(min=1e-10))
        seq_loss = seq_loss * torch.exp((log_w * mask_f).sum(-1) / n.clamp(min=1))
    with torch.no_grad():
        outside = (log_ratio != in_range).to(mask_f.dtype)
        metrics = {
            "pg_clipfrac": masked_mean(outside * (advantages > 0), mask_f),
            "pg_clipfrac_lower": masked_mean(outside * (advantages < 0), mask_f),
            "ppo_kl": masked_mean(-log_ratio, mask_f),
        }
    return masked_mean(seq_loss, (n > 0).to(mask_f.dtype)), metrics


def _covariance(advantages, logp, mask_f):
    """Each token's (A_t - mean A) (logp_t - mean logp), means over the unmasked tokens. The policy's
    entropy falls with this covariance (Cui et al. 2025): its largest tokens are those whose update
    collapses the entropy most, which Clip-Cov and KL-Cov restrain. [B, T], detached."""
    logp = logp.detach()
    return (advantages - masked_mean(advantages, mask_f)) * (logp - masked_mean(logp, mask_f))


def clip_cov_policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    clip_cov_ratio=2e-4,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    agg="token-mean",
    rollout_is_weights=None,
    norm_len=None,
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO's clipped
    surrogate, with the gradient of a few high-covariance tokens cut, as verl's
    compute_policy_loss_clip_cov. All inputs [B, T]; cov_t as in _covariance.

      r      = exp(logp - old_logp)                                        (not clamped)
      l_clip = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))          (no dual clip)
      C      = unmasked tokens PPO's clip left alone, with clip_cov_lb < cov_t < clip_cov_ub
      K      = max(1, floor(clip_cov_ratio * unmasked tokens)) tokens of C drawn at random (all if fewer)
      l      = 0 on the tokens in K, l_clip elsewhere
      loss   = agg_loss(l * w, mask, agg, norm_len)                         w = rollout_is_weights, or 1

    As in verl, the draw is torch.randperm on torch's global generator over C in row-major order,
    and the means and K are over the tokens of the batch given: in the trainer, a micro-batch.

    Returns (loss, metrics): pg_clipfrac (share of tokens in K; PPO's clipped ones do not count),
    ppo_kl (mean of old_logp - logp); masked token means.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        cov = _covariance(advantages, logp, mask_f)
        free = (mask > 0) & ~(loss_clipped > loss_unclipped)
        candidates = torch.nonzero(free & (cov > clip_cov_lb) & (cov < clip_cov_ub))  # [c, 2]
        count = max(int(clip_cov_ratio * mask_f.sum().item()), 1)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[:count]]
        keep = torch.ones_like(mask_f)
        keep[candidates[:, 0], candidates[:, 1]] = 0.0
    loss_mat = torch.maximum(loss_unclipped, loss_clipped) * keep
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    metrics = {"pg_clipfrac": masked_mean(1.0 - keep, mask_f), "ppo_kl": masked_mean(-log_ratio.detach(), mask_f)}
    return agg_loss(loss_mat, mask_f, agg, norm_len), metrics


def kl_cov_policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    kl_cov_ratio=2e-4,
    ppo_kl_coef=0.1,
    agg="token-mean",
    rollout_is_weights=None,
    norm_len=None,
):
    """KL-Cov (Cui et al. 2025): the unclipped surrogate, with a KL penalty on the tokens of largest
    covariance, as verl's compute_policy_loss_kl_cov. All inputs [B, T]; cov_t as in _covariance.

      d    = logp - old_logp                                                (not clamped)
      K    = the max(1, floor(kl_cov_ratio * unmasked tokens)) unmasked tokens of largest cov_t
      l    = -A exp(d) + ppo_kl_coef * |d| * [t in K]                       (no clip anywhere)
      loss = agg_loss(l * w, mask, agg, norm_len)                           w = rollout_is_weights, or 1

    As in verl, the covariance and K are over the tokens of the batch given: in the trainer, a micro-batch.

    Returns (loss, metrics): ppo_kl, which here (as in verl) is the mean of |d|, a masked token mean.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    with torch.no_grad():
        cov = torch.where(mask > 0, _covariance(advantages, logp, mask_f), -torch.inf).flatten()
        tokens = int(mask_f.sum().item())
        top = torch.topk(cov, max(1, int(tokens * kl_cov_ratio))).indices if tokens else cov[:0].long()
        penalized = torch.zeros_like(cov)
        penalized[top] = 1.0
    loss_mat = -advantages * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * penalized.view_as(mask_f)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    metrics = {"ppo_kl": masked_mean(log_ratio.detach().abs(), mask_f)}
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
