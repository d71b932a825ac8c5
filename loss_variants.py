"""The policy losses of --loss-mode other than vanilla PPO, each as verl's function of the same name
(core_algos.py) computes it: GSPO, CISPO, SAPO, GMPO (geo_mean), Clip-Cov and KL-Cov. loss.policy_loss
calls them (variant_token_losses) and aggregates what they return, as it does PPO's clipped surrogate.

Each returns per-token terms, nothing aggregated: (loss_mat [B, T], metrics {name: [B, T]}), the loss of
each token and the per-token values of the metrics verl logs, whose masked token means loss.policy_loss
logs. gspo, sapo and geo_mean are aggregated by seq-mean-token-mean whatever --loss-agg says
(loss.loss_agg_for). All inputs [B, T]; log-probabilities in nats; each states its formula.
"""

import inspect

import torch


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4, rollout_is_weights=None):
    """GSPO (Zheng et al. 2025): the clipped surrogate on a per-sequence ratio, as verl's
    compute_policy_loss_gspo. All inputs [B, T].

      log s_i  = sum_t (logp_it - old_logp_it) m_it / max(sum_t m_it, 1)      length-normalized seq ratio
      log s_it = min(logp_it - sg(logp_it) + sg(log s_i), 10)                  sg = stop-gradient (detach)
      l_it     = max(-A_it * s_it, -A_it * clamp(s_it, 1 - clip_low, 1 + clip_high))
      loss_mat = l * w,  aggregated by seq-mean-token-mean                     w = rollout_is_weights, or 1

    s_it has the value s_i (the same for every token of sequence i), and its gradient is
    s_i * grad(logp_it): the sequence ratio weights each token's policy gradient, and a sequence
    whose clipped term wins (s_i past the clip range on the side A favours) gives no gradient. GSPO's clip range is far narrower than PPO's (the paper uses
    3e-4 / 4e-4): pass it as clip_low / clip_high.

    What we matched in verl: no dual clip (clip_c is not used); log s_it is clamped from above only,
    at 10, and logp - old_logp is not clamped at +-20 as in the vanilla loss; the aggregation is
    always seq-mean-token-mean, whatever the caller's agg; rollout_is_weights multiply the
    per-token loss before aggregation.

    Returns (loss_mat, metrics per token), with verl's definitions (detached):
      pg_clipfrac        1 where the clipped term is the larger one
      pg_clipfrac_lower  0 (there is no dual clip; kept so the logged keys do not change)
      ppo_kl             old_logp - logp, not clamped
      ratio              s_i, the sequence's ratio, on each of its tokens (shown, not logged)
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
        clipped = (loss_clipped > loss_unclipped).to(mask_f.dtype)
        metrics = dict(pg_clipfrac=clipped, pg_clipfrac_lower=torch.zeros_like(mask_f), ppo_kl=-log_ratio)
        metrics["ratio"] = ratio.detach()
    return loss_mat, metrics


def cispo_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, rollout_is_weights=None):
    """CISPO (MiniMax-M1, Chen et al. 2025): each token's REINFORCE term, weighted by its importance
    ratio clipped and detached, as verl's compute_policy_loss_cispo. All inputs [B, T].

      r    = exp(clamp(logp - old_logp, -20, 20))
      l    = -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp       sg = stop-gradient (detach)
      loss_mat = l * w                                                    w = rollout_is_weights, or 1

    d l / d logp = -clamp(r, ...) * A: a token whose ratio left the range keeps its gradient, with the
    weight capped, where PPO's clip would give it none. The value is -A logp weighted, not a ratio.

    Returns (loss_mat, metrics per token): pg_clipfrac (1 where r is outside the range),
    pg_clipfrac_lower (0), ppo_kl (old_logp - logp, clamped as above), ratio (r, not logged).
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
        metrics = dict(pg_clipfrac=clipped, pg_clipfrac_lower=torch.zeros_like(mask_f), ppo_kl=-log_ratio)
        metrics["ratio"] = ratio.detach()
    return loss_mat, metrics


def sapo_policy_loss(logp, old_logp, advantages, mask, tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None):
    """SAPO (Gao et al. 2025): a smooth gate on the ratio in place of the clip, as verl's
    compute_policy_loss_sapo. All inputs [B, T].

      r    = exp(clamp(logp - old_logp, -20, 20))
      tau  = tau_pos where A > 0, tau_neg where A <= 0
      f(r) = sigmoid(tau (r - 1)) * 4 / tau
      l    = -f(r) * A
      loss_mat = l * w,  aggregated by seq-mean-token-mean                 w = rollout_is_weights, or 1

    d l / d logp = -A * 4 s (1 - s) r with s = sigmoid(tau (r - 1)): exactly the policy gradient -A at
    r = 1; 4 s (1 - s) is a bell of width about 1 / tau around r = 1, so a token far off-policy gets
    little gradient, fading smoothly (sooner for a larger tau) instead of PPO's hard cut.
    The aggregation is always seq-mean-token-mean, as in verl.

    Returns (loss_mat, metrics per token): pg_clipfrac and pg_clipfrac_lower (0: nothing is clipped),
    ppo_kl (old_logp - logp, clamped as above), ratio (r, not logged).
    """
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    tau = torch.full_like(advantages, tau_neg).masked_fill_(advantages > 0, tau_pos)  # [B, T]
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    with torch.no_grad():
        zero = torch.zeros_like(mask, dtype=logp.dtype)
        metrics = dict(pg_clipfrac=zero, pg_clipfrac_lower=zero, ppo_kl=-log_ratio, ratio=log_ratio.exp())
    return loss_mat, metrics


def geo_mean_policy_loss(logp, old_logp, advantages, mask, clip_low=0.4, clip_high=0.4, rollout_is_weights=None):
    """GMPO (Zhao et al. 2025): the geometric mean of a sequence's token ratios, each clipped in log
    space, as verl's compute_policy_loss_geo_mean. All inputs [B, T]; n_i = sum_t m_it.

      d_t  = logp_t - old_logp_t                                            (not clamped)
      e_t  = s_t min(s_t d_t, s_t clamp(d_t, -clip_low, clip_high)),  s_t = sign(A_t)
      R_i  = exp(sum_t e_t m_t / n_i)              the geometric mean of the clipped token ratios
      l_i  = -(sum_t A_t m_t / n_i) * R_i * W_i,   W_i = exp(sum_t log(w_t) m_t / n_i), 1 without w
      loss_mat = l_i on each token of sequence i: seq-mean-token-mean, its aggregation, gives the mean
                 of l_i over the sequences with n_i > 0

    The clip is one-sided: A > 0 caps d_t at clip_high, A < 0 floors it at -clip_low (no gradient
    there), A = 0 makes e_t = 0. The paper's range is (e^-0.4, e^0.4): --clip-low 0.4 --clip-high 0.4.

    Where we differ from verl: verl averages l_i over all B sequences, those without tokens too; we
    average over those with tokens, as agg_loss's seq-mean modes (and verl's) do, so that a sequence
    masked whole (--mask-truncated) counts for nothing. verl divides by n_i + 1e-8, we by n_i.

    Returns (loss_mat, metrics per token): pg_clipfrac and pg_clipfrac_lower (1 where d_t is outside
    [-clip_low, clip_high] and A > 0, resp. A < 0), ppo_kl (-d_t), ratio (R_i on each token, not logged).
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
        metrics = dict(pg_clipfrac=outside * (advantages > 0), pg_clipfrac_lower=outside * (advantages < 0))
        metrics.update(ppo_kl=-log_ratio, ratio=ratio.detach()[:, None].expand_as(mask_f))
    return seq_loss[:, None].expand_as(mask_f), metrics


def _covariance(advantages, logp, mask_f):
    """Each token's (A_t - mean A) (logp_t - mean logp), means over the unmasked tokens. The policy's
    entropy falls with this covariance (Cui et al. 2025): its largest tokens are those whose update
    collapses the entropy most, which Clip-Cov and KL-Cov restrain. [B, T], detached."""
    logp = logp.detach()
    return (advantages - _token_mean(advantages, mask_f)) * (logp - _token_mean(logp, mask_f))


def _token_mean(x, mask):
    """sum(x * mask) / sum(mask), 0 for an empty mask: the covariance's means (loss.masked_mean's formula)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


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
    rollout_is_weights=None,
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO's clipped
    surrogate, with the gradient of a few high-covariance tokens cut, as verl's
    compute_policy_loss_clip_cov. All inputs [B, T]; cov_t as in _covariance.

      r      = exp(logp - old_logp)                                        (not clamped)
      l_clip = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))          (no dual clip)
      C      = unmasked tokens PPO's clip left alone, with clip_cov_lb < cov_t < clip_cov_ub
      K      = max(1, floor(clip_cov_ratio * unmasked tokens)) tokens of C drawn at random (all if fewer)
      l      = 0 on the tokens in K, l_clip elsewhere
      loss_mat = l * w                                                      w = rollout_is_weights, or 1

    As in verl, the draw is torch.randperm on torch's global generator over C in row-major order,
    and the means and K are over the tokens of the batch given: in the trainer, a micro-batch.

    Returns (loss_mat, metrics per token): pg_clipfrac (1 on the tokens in K; PPO's clipped ones do not
    count), ppo_kl (old_logp - logp), ratio (r, not logged).
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
    metrics = {"pg_clipfrac": 1.0 - keep, "ppo_kl": -log_ratio.detach(), "ratio": ratio.detach()}
    return loss_mat, metrics


def kl_cov_policy_loss(logp, old_logp, advantages, mask, kl_cov_ratio=2e-4, ppo_kl_coef=0.1, rollout_is_weights=None):
    """KL-Cov (Cui et al. 2025): the unclipped surrogate, with a KL penalty on the tokens of largest
    covariance, as verl's compute_policy_loss_kl_cov. All inputs [B, T]; cov_t as in _covariance.

      d    = logp - old_logp                                                (not clamped)
      K    = the max(1, floor(kl_cov_ratio * unmasked tokens)) unmasked tokens of largest cov_t
      l    = -A exp(d) + ppo_kl_coef * |d| * [t in K]                       (no clip anywhere)
      loss_mat = l * w                                                      w = rollout_is_weights, or 1

    As in verl, the covariance and K are over the tokens of the batch given: in the trainer, a micro-batch.

    Returns (loss_mat, metrics per token): ppo_kl, which here (as in verl) is |d|; ratio (exp(d), not logged).
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
    metrics = {"ppo_kl": log_ratio.detach().abs(), "ratio": log_ratio.detach().exp()}
    return loss_mat, metrics


LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")  # --loss-mode
VARIANT_ARGS = ("tau_pos", "tau_neg", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


VARIANTS = {
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
}
SHARED_ARGS = ("clip_low", "clip_high", "rollout_is_weights")  # policy_loss's own, passed on


def variant_token_losses(mode, logp, old_logp, advantages, mask, **how):
    """The per-token terms of --loss-mode `mode`, one of LOSS_MODES but vanilla: (loss_mat [B, T], metrics
    {name: [B, T]}), which loss.policy_loss aggregates. `how`: SHARED_ARGS and VARIANT_ARGS; each variant takes
    those its signature names, and its own (verl's) defaults for the rest."""
    if mode not in VARIANTS:
        raise ValueError(f"unknown policy loss mode {mode!r}; expected one of {list(LOSS_MODES)}")
    if unknown := set(how) - set(SHARED_ARGS) - set(VARIANT_ARGS):
        raise TypeError(f"policy_loss got unexpected arguments {sorted(unknown)}")
    fn = VARIANTS[mode]
    takes = inspect.signature(fn).parameters
    return fn(logp, old_logp, advantages, mask, **{k: v for k, v in how.items() if k in takes})
