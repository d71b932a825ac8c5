"""Group-normalized advantages: the "group relative" in GRPO.

Each prompt is sampled n times; a sample's advantage is how much better its reward is than its
siblings'. No value network is needed: the group mean is the baseline.
compute_advantages also offers three of verl's other outcome-reward estimators: RLOO,
REINFORCE++ with a group baseline, and GRPO's pass@k variant (only a group's best sample learns).

A new estimator: a function here ([B*n] scores -> [B*n] advantages, or [B*n, T] per token), its name in
ADV_ESTIMATORS and a branch in compute_advantages, and the name in config.py's --adv-estimator choices
(config.py imports no feature module, so it lists them itself; tests/test_config.py checks the two agree).
"""

import torch


def grpo_advantages(scores, group_size, norm_by_std=True, eps=1e-6):
    """Per-sample advantages from per-sample scores, [B*n] -> [B*n] fp32.

    `scores` holds each prompt's `group_size` (n) samples next to each other. Per group:

        A_i = (r_i - mean(r)) / (std(r) + eps)    norm_by_std=True  (GRPO, as verl computes it)
        A_i =  r_i - mean(r)                      norm_by_std=False (Dr. GRPO: no std scaling)

    std is the unbiased (n - 1) estimate, as in verl.

    Edge cases, on purpose:
    - A group whose rewards are all equal gets exactly A = 0 for every sample, whatever the value:
      nothing to learn from it, so it contributes no policy gradient (the trainer logs their share as
      frac_reward_zero_std). verl computes (r - mean) / (std + eps) as is: for a reward such as 0.9 or
      1/3 the float32 mean differs from r by a rounding error, std is of the same size, and dividing
      one by the other gives |A| up to about 1 for a group with nothing to learn (group_deviations).
    - A group of size 1 has no siblings to compare with. Like verl, we then use mean 0 and std 1,
      so A = r / (1 + eps) (plain REINFORCE without a baseline) rather than NaN.

    The trainer broadcasts A over each response's tokens: advantages[:, None] * response_mask.
    """
    groups = _groups(scores, group_size)  # [B, n]
    _, std = group_stats(groups)  # [B, 1]
    adv = group_deviations(groups)  # [B, n] r_i - mean(r)
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.reshape(-1)


def group_stats(groups):
    """Each group's mean and std, [B, n] -> ([B, 1], [B, 1]), as grpo_advantages uses them: std unbiased
    (n - 1); a group of one has mean 0 and std 1, as in verl."""
    if groups.shape[1] == 1:
        return torch.zeros_like(groups), torch.ones_like(groups)
    return groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True, unbiased=True)


def group_deviations(groups):
    """r_i - mean(r) within each group, [B, n] -> [B, n]: exactly 0 for a group whose rewards are all
    equal (its float mean can be a rounding error away from them), and r_i itself for groups of one
    (mean 0, as verl uses: no siblings, no baseline)."""
    if groups.shape[1] == 1:
        return groups.clone()
    equal = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # [B, 1]
    return torch.where(equal, torch.zeros_like(groups), groups - groups.mean(dim=1, keepdim=True))


def zero_std_fraction(scores, group_size):
    """Share of groups whose rewards are all equal (they carry no learning signal)."""
    groups = torch.as_tensor(scores, dtype=torch.float32).view(-1, group_size)
    return (groups.max(dim=1).values == groups.min(dim=1).values).float().mean().item()


# ----------------------------------------------------------------------------------------------
# Other outcome-reward estimators, as verl defines them (verl/trainer/ppo/core_algos.py)

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk")


def compute_advantages(
    scores, group_size, estimator="grpo", norm_by_std=True, response_mask=None, eps=1e-6, total=None, unscored=None
):
    """Advantages from per-sample scores [B*n] by one of verl's outcome estimators (ADV_ESTIMATORS).

      grpo                          -> [B*n]     grpo_advantages(scores, group_size, norm_by_std, eps)
      rloo                          -> [B*n]     rloo_advantages(scores, group_size)
      reinforce_plus_plus_baseline  -> [B*n, T]  reinforce_pp_baseline_advantages(scores, group_size, response_mask)
      grpo_passk                    -> [B*n]     grpo_passk_advantages(scores, group_size, norm_by_std, eps)

    The [B*n] ones are broadcast over the response tokens by the caller (A[:, None] * response_mask);
    REINFORCE++-baseline already returns per-token advantages [B*n, T], masked, because its whitening
    is over tokens. As in verl, only grpo and grpo_passk read `norm_by_std` and `eps` (verl's
    norm_adv_by_std_in_grpo and epsilon); the other two ignore them. `total`: see masked_whiten.
    `unscored` [B*n] bools: samples no reward function applied to (left_out_of_groups).
    """
    if unscored is not None and any(unscored):
        how = dict(norm_by_std=norm_by_std, response_mask=response_mask, eps=eps, total=total)
        return left_out_of_groups(scores, unscored, group_size, estimator, **how)
    if estimator == "grpo":
        return grpo_advantages(scores, group_size, norm_by_std=norm_by_std, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(scores, group_size)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_pp_baseline_advantages(scores, group_size, response_mask, total)
    if estimator == "grpo_passk":
        return grpo_passk_advantages(scores, group_size, norm_by_std=norm_by_std, eps=eps)
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {list(ADV_ESTIMATORS)}")


def left_out_of_groups(scores, unscored, group_size, estimator, **how):
    """TRL's rule for a sample that no reward function applies to (each returned None): it is left out of
    its group's baseline and spread, and its advantage is 0. grpo, rloo and grpo_passk compute each such
    group over its scored samples alone (a group of k); reinforce_plus_plus_baseline, whose whitening spans
    the batch, sees them at their group's scored mean (no deviation), then 0."""
    groups = torch.as_tensor(scores, dtype=torch.float32).view(-1, group_size)  # [B, n]
    out = torch.as_tensor([bool(u) for u in unscored]).view(-1, group_size)  # [B, n]
    filled = groups.clone()
    for g in range(len(groups)):
        kept = ~out[g]
        filled[g, out[g]] = groups[g, kept].mean() if kept.any() else 0.0
    adv = compute_advantages(filled.view(-1), group_size, estimator, **how)  # [B*n] or [B*n, T]
    if estimator != "reinforce_plus_plus_baseline":
        per_group = adv.view(-1, group_size)
        for g in range(len(groups)):
            kept = ~out[g]
            if out[g].any() and kept.any():
                how_g = dict(norm_by_std=how["norm_by_std"], eps=how["eps"])
                per_group[g, kept] = compute_advantages(groups[g, kept], int(kept.sum()), estimator, **how_g)
    adv[out.view(-1)] = 0.0
    return adv


def _groups(scores, group_size):
    """scores [B*n] -> [B, n] fp32, with the same shape check as grpo_advantages."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(scores.shape)}"
        )
    return scores.view(-1, group_size)


def rloo_advantages(scores, group_size):
    """REINFORCE leave-one-out (Ahmadian et al. 2024), [B*n] -> [B*n] fp32. Per group of n:

        A_i = r_i - mean_{j != i} r_j  =  r_i * n / (n - 1) - mean(r) * n / (n - 1)

    computed in the second form, verl's (compute_rloo_outcome_advantage), except that a group whose
    rewards are all equal gets exactly 0 (group_deviations), not a rounding error. No std scaling.
    A group of size 1 has no others to leave out: verl's loop then keeps A = r (no baseline),
    and so do we. (verl's rloo_vectorized gives 0 there instead; we follow the default "rloo".)
    """
    groups = _groups(scores, group_size)  # [B, n]
    n = group_size
    if n == 1:
        return groups.reshape(-1).clone()
    mean = groups.mean(dim=1, keepdim=True)  # [B, 1]
    adv = groups * n / (n - 1) - mean * n / (n - 1)
    return torch.where(group_deviations(groups) == 0, torch.zeros_like(adv), adv).reshape(-1)


def grpo_passk_advantages(scores, group_size, norm_by_std=True, eps=1e-6):
    """GRPO for pass@k (verl's compute_grpo_passk_outcome_advantage), [B*n] -> [B*n] fp32. Per group of n:

        A_i = (r_max - r_second_max) / (std(r) + eps)   for the group's best sample    norm_by_std=True
        A_i =  r_max - r_second_max                     for the group's best sample    norm_by_std=False
        A_i = 0                                         for every other sample

    The objective is the group's best reward, max_i r_i (pass@n for 0/1 rewards; k is the group size,
    verl has no k of its own): leaving sample i out changes the max only if i is the best, and then by
    r_max - r_second_max. std is the unbiased (n - 1) estimate, as in GRPO. A tie for the best gives
    every sample 0 (the gap is 0), so which of the tied samples counts as best does not matter; an
    all-equal group is exactly 0. With 0/1 rewards only a group with exactly one right answer learns:
    that answer gets 1 / (std + eps). Like verl, a group of one is an error (no second best).
    """
    if group_size < 2:
        raise ValueError(
            f"grpo_passk needs at least 2 samples per group (the best and the second best), got {group_size}"
        )
    groups = _groups(scores, group_size)  # [B, n]
    top, best = groups.topk(2, dim=1)  # [B, 2] values and their positions in the group
    gap = top[:, 0] - top[:, 1]  # [B]; 0 when the best is tied
    if norm_by_std:
        gap = gap / (groups.std(dim=1, unbiased=True) + eps)
    return torch.zeros_like(groups).scatter_(1, best[:, :1], gap[:, None]).reshape(-1)


def masked_whiten(values, mask, total=None):
    """(x - mean) / sqrt(var + 1e-8) over the unmasked entries of the whole tensor, as verl's
    masked_whiten with its default shift_mean=True (the mean is not added back):

        mean = sum(x m) / (sum(m) + 1e-8)
        var  = sum((x - mean)^2 m) / (sum(m) + 1e-8) * sum(m) / (sum(m) - 1)    (unbiased)

    Like verl, fewer than 2 unmasked entries is an error (the unbiased variance divides by 0).
    Masked entries come back whitened too (not zero): multiply by the mask afterwards.
    `total` sums a 0-d tensor over every rank (the trainer passes an all-reduce), so that each rank
    whitens its share with the whole batch's statistics; None: this tensor is the whole batch.
    """
    total = total or (lambda t: t)
    count = total(mask.sum())
    if count < 2:
        raise ValueError(f"masked_whiten needs at least 2 unmasked entries, got {int(count)}; use a larger batch")
    mean = total((values * mask).sum()) / (count + 1e-8)
    var = total(((values - mean).square() * mask).sum()) / (count + 1e-8) * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def reinforce_pp_baseline_advantages(scores, group_size, response_mask, total=None):
    """REINFORCE++ with a group baseline (Hu et al. 2025), per token: [B*n], [B*n, T] -> [B*n, T] fp32.

        A_i    = r_i - mean(group of i)                (a group of size 1 uses mean 0, like verl;
                                                        exactly 0 for an all-equal group)
        A_it   = A_i * m_it                            broadcast over the response tokens
        A_it  <- masked_whiten(A_it, m) * m_it         mean and unbiased std over every unmasked
                                                       token of the batch, eps 1e-8 inside the sqrt

    As verl's compute_reinforce_plus_plus_baseline_outcome_advantage: the whitening statistics are
    over tokens, so a long response weighs more in them than a short one, and they are over the
    whole batch: pass `total` (masked_whiten) when each rank holds a share of it.
    """
    if response_mask is None:
        raise ValueError(
            "estimator 'reinforce_plus_plus_baseline' needs response_mask [B*n, T]: its advantages are whitened over tokens"
        )
    groups = _groups(scores, group_size)  # [B, n]
    mask = torch.as_tensor(response_mask).to(torch.float32)  # [B*n, T]
    if mask.dim() != 2 or mask.shape[0] != groups.numel():
        raise ValueError(f"response_mask must be [{groups.numel()}, T] (one row per score), got {tuple(mask.shape)}")
    adv = group_deviations(groups).reshape(-1, 1) * mask  # [B*n, T]; all-equal groups exactly 0
    return masked_whiten(adv, mask, total) * mask
