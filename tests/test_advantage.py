"""advantage.py: hand-computed groups, verl's edge cases, and invariances, for every estimator."""

import math
from collections import defaultdict

import pytest
import torch

from advantage import ADV_ESTIMATORS, compute_advantages, grpo_advantages, zero_std_fraction


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


# ----------------------------------------------------------------------------------------------
# compute_advantages: RLOO and REINFORCE++-baseline


def test_grpo_estimator_is_grpo_advantages():
    scores = [1.0, 0.0, 0.0, 1.0, 2.0, 5.0]
    torch.testing.assert_close(compute_advantages(scores, 3), grpo_advantages(scores, 3), rtol=0, atol=0)
    torch.testing.assert_close(
        compute_advantages(scores, 3, norm_by_std=False), grpo_advantages(scores, 3, norm_by_std=False)
    )


def test_rloo_hand_computed():
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0], group_size=4, estimator="rloo")
    # first group: 1 - (0 + 0 + 1) / 3 = 2/3,  0 - (1 + 0 + 1) / 3 = -2/3
    # second group: 3 - (1 + 2 + 2) / 3 = 4/3,  1 - 7/3 = -4/3,  2 - 6/3 = 0
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    # norm_by_std and eps are GRPO's options: RLOO ignores them, as in verl
    torch.testing.assert_close(compute_advantages([1.0, 0.0], 2, "rloo", norm_by_std=False), torch.tensor([1.0, -1.0]))


def test_rloo_group_of_one_keeps_the_reward():
    # verl's compute_rloo_outcome_advantage leaves a lone sample's score as its advantage
    adv = compute_advantages([2.0, -1.0, 0.5], group_size=1, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0, 0.5]))


def test_rloo_matches_leave_one_out_loop():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (6 * 5,), generator=g).float()
    expected = []
    for i, s in enumerate(scores.tolist()):
        start = i // 5 * 5
        others = [scores[j].item() for j in range(start, start + 5) if j != i]
        expected.append(s - sum(others) / len(others))
    torch.testing.assert_close(compute_advantages(scores, 5, "rloo"), torch.tensor(expected), atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_hand_computed():
    # group means: (1 + 0) / 2 and (2 + 2) / 2 -> per-sample advantages 0.5, -0.5, 0, 0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv = compute_advantages([1.0, 0.0, 2.0, 2.0], 2, "reinforce_plus_plus_baseline", response_mask=mask)
    # the 7 unmasked tokens hold 0.5, 0.5, -0.5, 0, 0, 0, 0: mean 1/14;
    # centred: 6/14, 6/14, -8/14, -1/14 (x4); squares sum to (36 + 36 + 64 + 4) / 196 = 5/7;
    # unbiased variance (5/7) / 6 = 5/42
    std = math.sqrt(5 / 42)
    a, b, c = (6 / 14) / std, (-8 / 14) / std, (-1 / 14) / std
    expected = torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [c, 0.0, 0.0]])
    assert adv.shape == (4, 3)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_is_whitened_over_tokens():
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(4 * 3, generator=g)
    lengths = torch.randint(1, 7, (12,), generator=g)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()  # [12, 6]
    adv = compute_advantages(scores, 3, "reinforce_plus_plus_baseline", response_mask=mask)
    tokens = adv[mask.bool()]
    assert abs(tokens.mean().item()) < 1e-6
    assert tokens.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    assert (adv[~mask.bool()] == 0).all()
    # group of one: the baseline is 0, so only the whitening is left
    one = compute_advantages([1.0, 3.0], 1, "reinforce_plus_plus_baseline", response_mask=torch.ones(2, 1))
    torch.testing.assert_close(one, torch.tensor([[-1.0], [1.0]]) / math.sqrt(2))  # mean 2, unbiased std sqrt(2)


def test_reinforce_pp_baseline_errors():
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages([1.0, 0.0], 2, "reinforce_plus_plus_baseline")
    with pytest.raises(ValueError, match=r"\[2, T\]"):
        compute_advantages([1.0, 0.0], 2, "reinforce_plus_plus_baseline", response_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="at least 2"):  # like verl's masked_var: unbiased needs 2 tokens
        compute_advantages([1.0, 0.0], 2, "reinforce_plus_plus_baseline", response_mask=torch.tensor([[1], [0]]))


def test_unknown_estimator_names_the_choices():
    assert ADV_ESTIMATORS == ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk")
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages([1.0, 0.0], 2, "gae")


def test_grpo_passk_hand_computed():
    scores = [
        *[0.0, 1.0, 0.0, 0.0],  # one right answer: it alone learns
        *[1.0, 0.0, 1.0, 0.0],  # a tie for the best: nothing to learn
        *[0.5, 0.5, 0.5, 0.5],  # all equal: nothing to learn
        *[0.2, 3.0, 1.0, 1.0],  # best 3, second best 1 (itself tied): the gap is 2
    ]
    # std of one 1 among four 0/1 rewards: mean 1/4, squares 9/16 + 3/16 = 3/4, / 3 = 1/4 -> std 1/2
    # last group: mean 1.3, squares 1.21 + 2.89 + 0.09 + 0.09 = 4.28, / 3 -> std sqrt(4.28 / 3)
    adv = compute_advantages(scores, 4, "grpo_passk")  # eps = 1e-6, as verl
    expected = [0, 1 / (0.5 + 1e-6), 0, 0] + [0] * 8 + [0, 2 / (math.sqrt(4.28 / 3) + 1e-6), 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert torch.count_nonzero(adv[4:12]) == 0  # exactly: the gap is 0, whatever the std
    # Dr. GRPO's norm_by_std=False: the bare gap
    torch.testing.assert_close(
        compute_advantages(scores, 4, "grpo_passk", norm_by_std=False),
        torch.tensor([0, 1.0, 0, 0] + [0] * 8 + [0, 2.0, 0, 0]),
    )


def test_grpo_passk_pairs_and_negative_rewards():
    # a pair: std = gap / sqrt(2), so with eps 0 the better one gets sqrt(2) whatever the gap and the sign
    adv = compute_advantages([-1.0, -3.0, 5.0, 7.0], 2, "grpo_passk", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([math.sqrt(2), 0, 0, math.sqrt(2)]))


def test_grpo_passk_matches_leave_one_out_of_the_max():
    """A_i = max(group) - max(group without i): the best's lead over the second best, 0 for the others."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (10 * 5,), generator=g).float()  # small integers: many ties
    expected = []
    for i in range(len(scores)):
        group = scores[i // 5 * 5 : i // 5 * 5 + 5].tolist()
        others = group[: i % 5] + group[i % 5 + 1 :]
        expected.append(max(group) - max(others))
    torch.testing.assert_close(compute_advantages(scores, 5, "grpo_passk", norm_by_std=False), torch.tensor(expected))
    std = scores.view(10, 5).std(dim=1).repeat_interleave(5)
    torch.testing.assert_close(compute_advantages(scores, 5, "grpo_passk"), torch.tensor(expected) / (std + 1e-6))


def test_grpo_passk_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="at least 2 samples per group"):  # verl raises too
        compute_advantages([1.0, 0.0], 1, "grpo_passk")
    with pytest.raises(ValueError, match="group_size=2"):
        compute_advantages([1.0, 0.0, 1.0], 2, "grpo_passk")


def test_reinforce_pp_whitens_a_share_with_the_whole_batchs_statistics():
    """Each of two ranks holds half the batch; `total` adds the other half's part of each statistic,
    as the trainer's all-reduce does: the same advantages as the whole batch at once."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]]
    ).float()
    whole = compute_advantages(scores, 2, "reinforce_plus_plus_baseline", response_mask=mask)
    baselined = (scores.view(-1, 2) - scores.view(-1, 2).mean(1, keepdim=True)).reshape(-1, 1) * mask  # [8, 3]
    mean = baselined.sum() / mask.sum()

    def part(rows):  # a rank's token count, masked sum, and squared deviations from the batch mean
        return [mask[rows].sum(), baselined[rows].sum(), ((baselined[rows] - mean).square() * mask[rows]).sum()]

    got = []
    for mine, other in ((slice(0, 4), slice(4, 8)), (slice(4, 8), slice(0, 4))):
        others = iter(part(other))
        share = compute_advantages(
            scores[mine],
            2,
            "reinforce_plus_plus_baseline",
            response_mask=mask[mine],
            total=lambda t, o=others: t + next(o),
        )
        got.append(share)
    torch.testing.assert_close(torch.cat(got), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0.9, 6.56, 1 / 3, 0.1 + 0.2, 0.7 * 0.5 + 0.3 * 1.2, -2.7, 1e6 + 0.1])
@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_all_equal_groups_get_exactly_zero_whatever_the_value(value, estimator, norm_by_std):
    # float32 rounding makes the mean of eight 6.56s differ from 6.56; divided by std + 1e-6 (std being
    # of the same size) that gave |A| up to 0.3 for a group with nothing to learn
    scores = [value] * 8 + [0.0, 1.0] * 3 + [0.0, 2.0]  # an all-equal group beside an informative one
    mask = torch.ones(16, 5)
    adv = compute_advantages(scores, 8, estimator, norm_by_std, mask)
    assert torch.count_nonzero(adv[:8]) == 0
    assert torch.count_nonzero(adv[8:]) > 0
    only_equal = compute_advantages(
        [value] * 16, 8, estimator, norm_by_std, mask
    )  # a whole batch with nothing to learn
    assert torch.count_nonzero(only_equal) == 0


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "grpo_passk"])
def test_a_sample_no_reward_function_applies_to_is_left_out_of_its_group(estimator):
    """TRL's rule for a sample every function returned None for: its group's advantages are those of the
    scored samples alone, and its own is 0. Groups without one are untouched."""
    scores = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25]  # two groups of 4; sample 1 unscored (logged as 0)
    unscored = [False, True, False, False, False, False, False, False]
    adv = compute_advantages(scores, 4, estimator, unscored=unscored)
    kept = compute_advantages([1.0, 0.0, 1.0], 3, estimator)
    torch.testing.assert_close(adv[[0, 2, 3]], kept)
    assert adv[1] == 0.0
    torch.testing.assert_close(adv[4:], compute_advantages(scores[4:], 4, estimator))
    # a group with nothing scored has nothing to learn from
    none = compute_advantages([0.0, 0.0, 1.0, 0.0], 2, estimator, unscored=[True, True, False, False])
    assert none[:2].tolist() == [0.0, 0.0]


def test_reinforce_pp_sees_an_unscored_sample_at_its_groups_mean_then_zero():
    scores, mask = [1.0, 0.0, 0.0, 1.0], torch.ones(4, 3)
    adv = compute_advantages(scores, 4, "reinforce_plus_plus_baseline", response_mask=mask, unscored=[0, 1, 0, 0])
    filled = compute_advantages([1.0, 2 / 3, 0.0, 1.0], 4, "reinforce_plus_plus_baseline", response_mask=mask)
    assert adv[1].abs().sum() == 0.0
    torch.testing.assert_close(adv[[0, 2, 3]], filled[[0, 2, 3]])
