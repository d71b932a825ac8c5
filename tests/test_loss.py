"""loss.py: hand-computed cases, properties and equivalences for every formula (the --loss-mode variants
other than gspo: test_loss_variants.py; the log-probs: test_logprobs.py)."""

import math

import pytest
import torch

from loss import LOSS_MODES, agg_denominator, agg_loss, kl_penalty, policy_loss

# ----------------------------------------------------------------------------------------------
# KL estimators


def test_kl_penalty_hand_values():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # d = logp - ref = 1
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "abs").item() == pytest.approx(1.0)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1.0))  # e^-1 - (-1) - 1
    assert kl_penalty(ref, logp, "k3").item() == pytest.approx(math.e - 2.0)  # e^1 - 1 - 1


@pytest.mark.parametrize("alias,name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_kl_penalty_accepts_verl_names(alias, name):
    logp, ref = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, name))


def test_kl_k3_clamps_like_verl():
    # log r = ref - logp = 30 is clamped to 20 -> e^20 - 21, then the value to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0
    # log r = -9 is inside both clamps: e^-9 + 9 - 1
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-9.0]), "k3").item() == pytest.approx(8.0 + math.exp(-9.0))
    # without the clamp on log r, e^100 overflows fp32 and the gradient becomes inf * 0 = NaN
    logp = torch.tensor([-100.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([0.0]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # tokens sampled from pi; the mean estimate must approach KL(pi || pi_ref) computed exactly
    g = torch.Generator().manual_seed(4)
    pi = torch.softmax(torch.randn(6, generator=g), 0)
    ref = torch.softmax(torch.randn(6, generator=g), 0)
    exact = (pi * (pi.log() - ref.log())).sum().item()
    tokens = torch.multinomial(pi, 400_000, replacement=True, generator=g)
    logp, ref_logp = pi.log()[tokens], ref.log()[tokens]
    assert kl_penalty(logp, ref_logp, "k1").mean().item() == pytest.approx(exact, abs=5e-3)
    assert kl_penalty(logp, ref_logp, "k3").mean().item() == pytest.approx(exact, abs=5e-3)


def test_kl_penalty_rejects_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ----------------------------------------------------------------------------------------------
# aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last sequence has no tokens


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the empty sequence is not counted
        ("seq-mean-token-mean", (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # the seq-mean of token sums, divided by T = 3
    ],
)
def test_agg_loss_hand_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_dr_grpo_constant_and_unknown_mode():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.35)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "sum")


def test_dr_grpo_is_a_mean_over_sequences_divided_by_a_constant():
    # verl 0.9.1 gives 1 here: (2 + 2) / 2 sequences / 2 columns. Summing over sequences instead, as
    # older verl did, gives 2, and the loss, its gradient and the clipping scale with the batch size.
    loss, mask = torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == 1.0
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=4).item() == 0.5
    # a batch twice as large of the same sequences has the same loss
    assert agg_loss(loss.repeat(2, 1), mask.repeat(2, 1), "seq-mean-token-sum-norm").item() == 1.0


def test_agg_modes_agree_when_all_sequences_have_equal_length():
    g = torch.Generator().manual_seed(5)
    loss, mask = torch.randn(4, 6, generator=g), torch.ones(4, 6)
    token_mean = agg_loss(loss, mask, "token-mean")
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), token_mean)
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), token_mean * 6)
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), token_mean)  # norm_len = T


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_pieces_weighted_by_agg_denominator_sum_to_the_whole(mode):
    # how the trainer splits a mini-batch over micro-batches and ranks and still gets agg_loss of the whole
    g = torch.Generator().manual_seed(7)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[2] = 0  # a sequence with no tokens
    whole_denominator = agg_denominator(mask, mode)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        piece = agg_denominator(mask[rows], mode)
        weight = piece / whole_denominator
        total += agg_loss(loss[rows], mask[rows], mode, norm_len=5) * weight
    torch.testing.assert_close(total, agg_loss(loss, mask, mode, norm_len=5))


# ----------------------------------------------------------------------------------------------
# the clipped surrogate


def one_token(adv, ratio, clip_c=3.0):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), clip_c=clip_c)
    loss.backward()
    return loss.item(), logp.grad.item(), {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize(
    "adv,ratio,loss,clipped,lower,has_grad",
    [
        (1.0, 1.0, -1.0, 0, 0, True),  # on-policy: the plain policy gradient
        (1.0, 1.5, -1.2, 1, 0, False),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (1.0, 0.5, -0.5, 0, 0, True),  # A > 0, ratio below 1 - eps: not clipped
        (-1.0, 0.5, 0.8, 1, 0, False),  # A < 0, ratio below 1 - eps: clipped
        (-1.0, 1.5, 1.5, 0, 0, True),  # A < 0, ratio above 1 + eps, under clip_c: not clipped
        (-1.0, 5.0, 3.0, 0, 1, False),  # A < 0, ratio above clip_c: dual clip bounds it at -A * c
    ],
)
def test_policy_loss_hand_cases(adv, ratio, loss, clipped, lower, has_grad):
    value, grad, metrics = one_token(adv, ratio)
    assert value == pytest.approx(loss)
    assert metrics["pg_clipfrac"] == clipped
    assert metrics["pg_clipfrac_lower"] == lower
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio))
    assert (grad != 0) == has_grad


def test_policy_loss_on_policy_gradient_is_the_policy_gradient():
    # with logp == old_logp, d loss / d logp_t = -A_t / (number of tokens) under token-mean
    g = torch.Generator().manual_seed(6)
    logp = torch.randn(3, 4, generator=g).requires_grad_()
    adv = torch.randn(3, 1, generator=g).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / mask.sum())
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item(), abs=1e-6)


def test_policy_loss_asymmetric_clip_and_bad_clip_c():
    logp = torch.tensor([[math.log(1.25)]])
    args = (torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert policy_loss(logp, *args, clip_high=0.28)[0].item() == pytest.approx(-1.25)  # DAPO's clip-higher
    assert policy_loss(logp, *args, clip_high=0.2)[0].item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(logp, *args, clip_c=1.0)


def test_rollout_is_weights_scale_each_tokens_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), adv, mask, rollout_is_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    torch.testing.assert_close(logp.grad, -weights / 2)


# ----------------------------------------------------------------------------------------------
# GSPO: the same surrogate on a per-sequence ratio

# two sequences; old log-probs 0, so logp - old_logp = logp
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
GSPO_ADV = torch.tensor([[1.0], [-1.0]]).expand(2, 3)  # A = +1 for sequence 0, -1 for sequence 1


def gspo(logp_values, clip=0.3, adv=GSPO_ADV, mask=GSPO_MASK, **kw):
    logp = torch.tensor(logp_values, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv, mask, clip, clip, mode="gspo", **kw)
    loss.backward()
    return loss, logp.grad, {k: v.item() for k, v in metrics.items()}


def test_gspo_hand_values_and_gradient():
    # log s_0 = (0.1 + 0.2 + 0.3) / 3 = 0.2; log s_1 = (-0.1 + 0.0) / 2 = -0.05 (the 5.0 is masked)
    loss, grad, metrics = gspo([[0.1, 0.2, 0.3], [-0.1, 0.0, 5.0]])
    s0, s1 = math.exp(0.2), math.exp(-0.05)  # both inside [0.7, 1.3]: nothing clipped
    # seq-mean-token-mean: each sequence's per-token loss is -A * s, the same on all its tokens
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    # d/d logp_t of s_t is s (the stop-gradients), scaled by 1 / (2 sequences x its token count)
    expected = torch.tensor([[-s0 / 6, -s0 / 6, -s0 / 6], [s1 / 4, s1 / 4, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-(0.1 + 0.2 + 0.3 - 0.1 + 0.0) / 5)  # per token, masked


def test_gspo_clips_whole_sequences():
    # clip 0.1: s_0 = e^0.2 > 1.1 with A > 0 is clipped (no gradient); s_1 = e^-0.05 > 0.9 is not
    loss, grad, metrics = gspo([[0.1, 0.2, 0.3], [-0.1, 0.0, 5.0]], clip=0.1)
    s1 = math.exp(-0.05)
    assert loss.item() == pytest.approx((-1.1 + s1) / 2, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]]), atol=1e-6, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 5)  # a token share: sequence 0's 3 of 5 tokens
    # GSPO's own clip range (3e-4 / 4e-4): both sequences clipped, nothing to learn from
    logp = torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.0, 5.0]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), GSPO_ADV, GSPO_MASK, 3e-4, 4e-4, mode="gspo")
    loss.backward()
    assert loss.item() == pytest.approx((-(1 + 4e-4) + (1 - 3e-4)) / 2, abs=1e-6)
    assert logp.grad.abs().max().item() == 0.0 and metrics["pg_clipfrac"].item() == 1.0


def test_gspo_has_no_dual_clip_and_clamps_the_log_ratio_at_10():
    adv, mask = torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    # A < 0 and s = e^2: vanilla's dual clip would cap the loss at 3; verl's GSPO does not
    loss, _, metrics = gspo([[2.0, 2.0]], adv=adv, mask=mask)
    assert loss.item() == pytest.approx(math.exp(2.0), rel=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0
    # log s = 20 is clamped to 10 (from above only), and the clamp stops the gradient
    loss, grad, metrics = gspo([[20.0, 20.0]], adv=adv, mask=mask)
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)
    assert grad.abs().max().item() == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-20.0)  # not clamped
    # A > 0 and log s = -30: not clamped at -20 as vanilla would (the unclipped term is the larger)
    loss, _, _ = gspo([[-30.0, -30.0]], adv=-adv, mask=mask)
    assert loss.item() == pytest.approx(-math.exp(-30.0), rel=1e-5)


def test_gspo_always_aggregates_seq_mean_token_mean_and_applies_is_weights():
    values = [[0.1, 0.2, 0.3], [-0.1, 0.0, 5.0]]
    reference, _, _ = gspo(values)
    for agg in ("token-mean", "seq-mean-token-sum"):
        assert gspo(values, agg=agg)[0].item() == reference.item()
    s0, s1 = math.exp(0.2), math.exp(-0.05)
    weights = torch.tensor([[0.5, 1.0, 2.0], [2.0, 2.0, 0.0]])
    loss, grad, _ = gspo(values, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-s0 * 3.5 / 3 + s1 * 4.0 / 2) / 2, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-s0 / 6, -s0 / 6, -s0 / 6], [s1 / 4, s1 / 4, 0.0]]) * weights)


def test_gspo_on_policy_equals_vanilla_seq_mean_token_mean():
    # with logp == old_logp every ratio is 1, and both losses are the plain policy gradient
    g = torch.Generator().manual_seed(8)
    logp = torch.randn(3, 4, generator=g).requires_grad_()
    adv = torch.randn(3, 1, generator=g).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    grads = []
    for mode in ("vanilla", "gspo"):
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-mean", mode=mode)
        loss.backward()
        grads.append((loss.item(), logp.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_unknown_loss_mode():
    assert "dppo_tv" not in LOSS_MODES  # one of verl's we do not have
    with pytest.raises(ValueError, match="gspo"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), mode="dppo_tv")
