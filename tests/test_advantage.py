"""advantage.py: hand-computed groups, verl's edge cases, and invariances."""

import math
from collections import defaultdict

import pytest
import torch

from advantage import grpo_advantages, zero_std_fraction


def test_hand_computed_group():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 1/sqrt(3)
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0], group_size=4, eps=0.0)
    expected = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]))


def test_groups_are_normalized_separately():
    adv = grpo_advantages([1.0, 0.0, 5.0, 7.0], group_size=2, eps=0.0)
    s = 1 / math.sqrt(2)  # unbiased std of a pair differing by 1 is 1/sqrt(2), by 2 is sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, -1 / math.sqrt(2), 1 / math.sqrt(2)]))


def test_identical_rewards_give_zero_advantage():
    adv = grpo_advantages([0.7, 0.7, 0.7, 1.0, 0.0, 0.0], group_size=3)
    assert adv[:3].abs().max().item() == 0.0
    assert adv[3:].abs().max().item() > 0
    assert zero_std_fraction([0.7, 0.7, 0.7, 1.0, 0.0, 0.0], 3) == 0.5


def test_group_of_one_is_reinforce_without_baseline():
    # verl: mean 0, std 1 for a single sample, so A = r / (1 + eps) instead of NaN
    adv = grpo_advantages([2.0, -1.0, 0.0], group_size=1)
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0, 0.0]) / (1 + 1e-6))


def test_dr_grpo_skips_std_scaling():
    adv = grpo_advantages([3.0, 1.0, 2.0, 2.0], group_size=2, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def verl_reference(scores, group_size, eps=1e-6):
    """verl's loop over prompt ids (compute_grpo_outcome_advantage), written independently."""
    by_prompt = defaultdict(list)
    for i, s in enumerate(scores):
        by_prompt[i // group_size].append(s)
    out = []
    for i, s in enumerate(scores):
        group = torch.tensor(by_prompt[i // group_size])
        out.append((s - group.mean()) / (group.std() + eps))
    return torch.stack(out)


def test_matches_verl_loop_and_invariances():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (8 * 5,), generator=g).float()
    adv = grpo_advantages(scores, group_size=5)
    torch.testing.assert_close(adv, verl_reference(scores.tolist(), 5))
    groups = adv.view(8, 5)
    varied = groups.std(1) > 0
    torch.testing.assert_close(groups.sum(1), torch.zeros(8), atol=1e-5, rtol=0)  # zero-mean per group
    torch.testing.assert_close(groups[varied].std(1), torch.ones(int(varied.sum())), atol=1e-4, rtol=0)
    # shifting and scaling all rewards leaves GRPO advantages unchanged
    torch.testing.assert_close(grpo_advantages(scores * 3 + 7, 5), adv, atol=1e-5, rtol=0)


def test_bad_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="group_size=4"):
        grpo_advantages([1.0, 2.0, 3.0], group_size=4)
