"""Group-normalized advantages: the "group relative" in GRPO.

Each prompt is sampled n times; a sample's advantage is how much better its reward is than its
siblings'. No value network is needed: the group mean is the baseline.
"""

import torch


def grpo_advantages(scores, group_size, norm_by_std=True, eps=1e-6):
    """Per-sample advantages from per-sample scores, [B*n] -> [B*n] fp32.

    `scores` holds each prompt's `group_size` (n) samples next to each other. Per group:

        A_i = (r_i - mean(r)) / (std(r) + eps)    norm_by_std=True  (GRPO, as verl computes it)
        A_i =  r_i - mean(r)                      norm_by_std=False (Dr. GRPO: no std scaling)

    std is the unbiased (n - 1) estimate, as in verl.

    Edge cases, on purpose:
    - A group whose rewards are all equal gets A = 0 for every sample: nothing to learn from it,
      so it contributes no policy gradient (the trainer logs their share as frac_reward_zero_std).
    - A group of size 1 has no siblings to compare with. Like verl, we then use mean 0 and std 1,
      so A = r / (1 + eps) (plain REINFORCE without a baseline) rather than NaN.

    The trainer broadcasts A over each response's tokens: advantages[:, None] * response_mask.
    """
    scores = torch.as_tensor(scores, dtype=torch.float32)
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(scores.shape)}"
        )
    groups = scores.view(-1, group_size)  # [B, n]
    if group_size == 1:
        mean, std = torch.zeros_like(groups), torch.ones_like(groups)
    else:
        mean = groups.mean(dim=1, keepdim=True)  # [B, 1]
        std = groups.std(dim=1, keepdim=True, unbiased=True)  # [B, 1]
    adv = groups - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.reshape(-1)


def zero_std_fraction(scores, group_size):
    """Share of groups whose rewards are all equal (they carry no learning signal)."""
    groups = torch.as_tensor(scores, dtype=torch.float32).view(-1, group_size)
    return (groups.max(dim=1).values == groups.min(dim=1).values).float().mean().item()
