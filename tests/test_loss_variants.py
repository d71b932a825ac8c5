"""loss.py's --loss-mode variants (cispo, sapo, geo_mean, clip_cov, kl_cov): hand-computed loss,
gradient with respect to logp, and metrics on small tensors, each number written out from the
formula in the function's docstring. Old log-probs are 0 throughout, so logp - old_logp = logp and
each token's ratio is exp(logp). test_verl_reference.py compares the same functions with verl's."""

import math

import pytest
import torch

from loss import LOSS_MODES, SEQ_MEAN_AGG, agg_denominator, aggregate, loss_agg_for, policy_loss
from loss_variants import (
    VARIANTS,
    cispo_policy_loss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
)

# two sequences of 3 tokens, the last token of sequence 1 padding; A = +1 for sequence 0, -1 for 1
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([[1.0], [-1.0]]).expand(2, 3)


def run(fn, logp_values, adv=ADV, mask=MASK, agg="token-mean", norm_len=None, **kw):
    """fn(logp, old_logp = 0, adv, mask, **kw) -> (loss, d loss / d logp, metrics as floats): policy_loss, or a
    variant's per-token terms aggregated as policy_loss aggregates its mode (`agg`: --loss-agg, which gspo, sapo
    and geo_mean ignore)."""
    logp = torch.tensor(logp_values, dtype=torch.float64, requires_grad=True)
    old, adv = torch.zeros_like(logp), adv.double()
    if fn is policy_loss:
        loss, metrics = fn(logp, old, adv, mask, agg=agg, norm_len=norm_len, **kw)
    else:
        mode = next(m for m, f in VARIANTS.items() if f is fn)
        loss, metrics = aggregate(*fn(logp, old, adv, mask, **kw), mask, loss_agg_for(mode, agg), norm_len)
    loss.backward()
    return loss.item(), logp.grad, {k: float(v) for k, v in metrics.items()}


def close(grad, expected):
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------------
# CISPO: l = -sg(clamp(r, 0.8, 1.2)) * A * logp


def test_cispo_hand_values_gradient_and_metrics():
    ln = math.log
    # ratios: sequence 0 (A = +1): 1.1 inside, 1.5 and 0.5 outside; sequence 1 (A = -1): 0.9 inside, 1.3 outside
    loss, grad, metrics = run(cispo_policy_loss, [[ln(1.1), ln(1.5), ln(0.5)], [ln(0.9), ln(1.3), 5.0]])
    # the clipped ratios are 1.1, 1.2, 0.8 and 0.9, 1.2; the padding token counts for nothing
    token_losses = [-1.1 * ln(1.1), -1.2 * ln(1.5), -0.8 * ln(0.5), 0.9 * ln(0.9), 1.2 * ln(1.3)]
    assert loss == pytest.approx(sum(token_losses) / 5)  # token-mean over the 5 tokens
    # d l / d logp = -clipped weight * A: the tokens outside the range keep a (capped) gradient
    close(grad, [[-1.1 / 5, -1.2 / 5, -0.8 / 5], [0.9 / 5, 1.2 / 5, 0.0]])
    assert metrics == pytest.approx(
        dict(pg_clipfrac=3 / 5, pg_clipfrac_lower=0.0, ppo_kl=-(ln(1.1) + ln(1.5) + ln(0.5) + ln(0.9) + ln(1.3)) / 5)
    )


def test_cispo_uses_the_aggregation_it_is_given_and_the_is_weights():
    logp = [[0.1, 0.0, 0.0], [-0.1, 0.15, 0.0]]  # all inside [0.8, 1.2]: weights = ratios
    # seq-mean-token-sum: (sum over sequence 0 + sum over sequence 1) / 2
    loss, grad, _ = run(cispo_policy_loss, logp, agg="seq-mean-token-sum")
    s0 = -math.exp(0.1) * 0.1
    s1 = math.exp(-0.1) * -0.1 + math.exp(0.15) * 0.15
    assert loss == pytest.approx((s0 + s1) / 2)
    close(grad, [[-math.exp(0.1) / 2, -1 / 2, -1 / 2], [math.exp(-0.1) / 2, math.exp(0.15) / 2, 0.0]])
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 0.0]], dtype=torch.float64)
    loss_w, grad_w, _ = run(cispo_policy_loss, logp, agg="seq-mean-token-sum", rollout_is_weights=w)
    assert loss_w == pytest.approx((2 * s0 + math.exp(-0.1) * -0.1 + 0.5 * math.exp(0.15) * 0.15) / 2)
    close(grad_w, [[-math.exp(0.1), -1 / 2, -1 / 2], [math.exp(-0.1) / 2, math.exp(0.15) / 4, 0.0]])


def test_cispo_clamps_the_log_ratio_at_20():
    one = torch.ones(1, 1)
    loss, grad, metrics = run(cispo_policy_loss, [[30.0]], adv=one, mask=one)
    assert loss == pytest.approx(-1.2 * 30.0) and grad.item() == pytest.approx(-1.2)
    assert metrics["ppo_kl"] == pytest.approx(-20.0) and metrics["pg_clipfrac"] == 1.0


# ----------------------------------------------------------------------------------------------
# SAPO: l = -sigmoid(tau (r - 1)) * 4 / tau * A, tau = 1 (A > 0) or 1.05 (A <= 0)


def test_sapo_hand_values_gradient_and_metrics():
    loss, grad, metrics = run(sapo_policy_loss, [[0.0, 0.5, -0.5], [0.5, 0.0, 9.0]])
    r = [[1.0, math.exp(0.5), math.exp(-0.5)], [math.exp(0.5), 1.0]]
    s0 = [sigmoid(1.0 * (x - 1)) for x in r[0]]  # tau_pos = 1
    s1 = [sigmoid(1.05 * (x - 1)) for x in r[1]]  # tau_neg = 1.05
    l0 = [-s * 4 / 1.0 for s in s0]  # A = +1
    l1 = [s * 4 / 1.05 for s in s1]  # A = -1
    assert l0[0] == pytest.approx(-2.0)  # at r = 1 the gate is 2 / tau
    assert loss == pytest.approx((sum(l0) / 3 + sum(l1) / 2) / 2)  # seq-mean-token-mean
    # d l / d logp = -A * 4 s (1 - s) r: exactly -A at r = 1; per-token weights 1/3 and 1/2, then / 2
    g0 = [-4 * s * (1 - s) * x / 3 / 2 for s, x in zip(s0, r[0])]
    g1 = [4 * s * (1 - s) * x / 2 / 2 for s, x in zip(s1, r[1])]
    assert g0[0] == pytest.approx(-1 / 6)
    close(grad, [g0, [*g1, 0.0]])
    assert metrics == pytest.approx(dict(pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=-(0.5 - 0.5 + 0.5) / 5))


def test_sapo_gate_fades_faster_with_a_larger_tau_and_zero_advantage_gives_nothing():
    one = torch.ones(1, 1)
    _, slow, _ = run(sapo_policy_loss, [[1.0]], adv=one, mask=one, tau_pos=1.0)  # r = e
    _, fast, _ = run(sapo_policy_loss, [[1.0]], adv=one, mask=one, tau_pos=8.0)
    s1, s8 = sigmoid(1.0 * (math.e - 1)), sigmoid(8.0 * (math.e - 1))
    assert slow.item() == pytest.approx(-4 * s1 * (1 - s1) * math.e)  # -1.40: with tau = 1, r = e still learns
    assert fast.item() == pytest.approx(-4 * s8 * (1 - s8) * math.e)  # -1.2e-5: with tau = 8, hardly
    loss, grad, _ = run(sapo_policy_loss, [[1.0]], adv=torch.zeros(1, 1), mask=one)
    assert loss == 0.0 and grad.item() == 0.0


def test_sapo_always_aggregates_by_sequence():
    values = [[0.0, 0.5, -0.5], [0.5, 0.0, 9.0]]
    reference = run(sapo_policy_loss, values)[0]
    for agg in ("token-mean", "seq-mean-token-sum"):
        assert run(policy_loss, values, mode="sapo", agg=agg)[0] == reference
    # an empty sequence counts for nothing
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([[1.0], [-1.0], [1.0]]).expand(3, 3)
    assert run(sapo_policy_loss, [*values, [3.0, 3.0, 3.0]], adv=adv, mask=mask)[0] == pytest.approx(reference)


# ----------------------------------------------------------------------------------------------
# GMPO (geo_mean): R_i = exp(mean_t of the one-sided clipped log-ratios), l_i = -mean_t(A) * R_i


def test_geo_mean_hand_values_gradient_and_metrics():
    clip = dict(clip_low=0.4, clip_high=0.4)
    loss, grad, metrics = run(geo_mean_policy_loss, [[0.1, 0.6, -0.7], [0.6, -0.5, 9.0]], **clip)
    # sequence 0, A > 0: capped at 0.4 from above only: 0.1, 0.4 (clipped), -0.7 (not clipped)
    R0 = math.exp((0.1 + 0.4 - 0.7) / 3)
    # sequence 1, A < 0: floored at -0.4 from below only: 0.6 (not clipped), -0.4 (clipped)
    R1 = math.exp((0.6 - 0.4) / 2)
    assert loss == pytest.approx((-1 * R0 + 1 * R1) / 2)
    # d l_0 / d logp_t = -R0 / 3 where not clipped, 0 where clipped; the same for l_1 with +R1 / 2
    close(grad, [[-R0 / 3 / 2, 0.0, -R0 / 3 / 2], [R1 / 2 / 2, 0.0, 0.0]])
    # verl's clip fractions count every token outside [-0.4, 0.4], on whichever side
    assert metrics == pytest.approx(
        dict(pg_clipfrac=2 / 5, pg_clipfrac_lower=2 / 5, ppo_kl=-(0.1 + 0.6 - 0.7 + 0.6 - 0.5) / 5)
    )


def test_geo_mean_zero_advantage_tokens_empty_sequences_and_is_weights():
    one_seq = torch.ones(1, 2)
    # A = 0 on a token: its log-ratio counts as 0 (sign 0), it still counts in n and in the mean advantage
    loss, grad, _ = run(geo_mean_policy_loss, [[0.2, 0.3]], adv=torch.tensor([[1.0, 0.0]]), mask=one_seq)
    assert loss == pytest.approx(-0.5 * math.exp(0.1))
    close(grad, [[-0.5 * math.exp(0.1) / 2, 0.0]])
    # a sequence with no tokens (e.g. --mask-truncated) counts for nothing; verl would average over it
    values = [[0.1, 0.6, -0.7], [0.6, -0.5, 9.0]]
    reference = run(geo_mean_policy_loss, values)[0]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([[1.0], [-1.0], [1.0]]).expand(3, 3)
    assert run(geo_mean_policy_loss, [*values, [3.0, 3.0, 3.0]], adv=adv, mask=mask)[0] == pytest.approx(reference)
    # the engine/trainer weights enter as their geometric mean over the sequence's tokens
    w = torch.tensor([[4.0, 1.0, 1.0], [2.0, 0.5, 0.0]], dtype=torch.float64)
    loss_w, _, _ = run(geo_mean_policy_loss, values, rollout_is_weights=w)
    R0, R1 = math.exp((0.1 + 0.4 - 0.7) / 3), math.exp((0.6 - 0.4) / 2)
    assert loss_w == pytest.approx((-R0 * 4 ** (1 / 3) + R1 * 1.0) / 2)


# ----------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov: both select tokens by cov_t = (A_t - mean A) (logp_t - mean logp)

COV_LOGP = [[0.3, 0.1, -0.1], [-0.3, 0.1, 5.0]]
# over the 5 tokens: mean A = (1 + 1 + 1 - 1 - 1) / 5 = 0.2, mean logp = (0.3 + 0.1 - 0.1 - 0.3 + 0.1) / 5 = 0.02
COV = [[0.8 * 0.28, 0.8 * 0.08, 0.8 * -0.12], [-1.2 * -0.32, -1.2 * 0.08]]  # 0.224, 0.064, -0.096; 0.384, -0.096


def test_clip_cov_cuts_a_high_covariance_token_that_ppo_did_not_clip():
    # PPO's clip (0.2) clips sequence 0's first token (r = e^0.3 > 1.2, A > 0) and sequence 1's first
    # (r = e^-0.3 < 0.8, A < 0): those are not candidates although their covariance is the largest.
    # Of the rest, only sequence 0's second token (0.064) is in (0.05, 1): it is cut.
    loss, grad, metrics = run(clip_cov_policy_loss, COV_LOGP, clip_cov_lb=0.05, clip_cov_ub=1.0)
    token_losses = [-1.2, 0.0, -math.exp(-0.1), 0.8, math.exp(0.1)]  # clipped, cut, inside, clipped, inside
    assert loss == pytest.approx(sum(token_losses) / 5)
    close(grad, [[0.0, 0.0, -math.exp(-0.1) / 5], [0.0, math.exp(0.1) / 5, 0.0]])
    assert metrics == pytest.approx(dict(pg_clipfrac=1 / 5, ppo_kl=-0.1 / 5))  # only the cut token counts
    # a window holding no candidate cuts nothing: PPO's clip without the dual clip
    loss, grad, metrics = run(clip_cov_policy_loss, COV_LOGP, clip_cov_lb=0.2, clip_cov_ub=1.0)
    assert loss == pytest.approx((-1.2 - math.exp(0.1) - math.exp(-0.1) + 0.8 + math.exp(0.1)) / 5)
    close(grad, [[0.0, -math.exp(0.1) / 5, -math.exp(-0.1) / 5], [0.0, math.exp(0.1) / 5, 0.0]])
    assert metrics["pg_clipfrac"] == 0.0


def test_clip_cov_draws_at_random_among_more_candidates_than_it_cuts():
    # cov = [[0.15, -0.05], [0.15, -0.05]]: two candidates in (0.1, 1), none clipped by PPO
    logp, adv = [[0.15, -0.05], [-0.15, 0.05]], torch.tensor([[1.0], [-1.0]]).expand(2, 2)
    mask = torch.ones(2, 2)
    kw = dict(adv=adv, mask=mask, clip_cov_lb=0.1, clip_cov_ub=1.0)
    cut = set()
    for seed in range(20):
        torch.manual_seed(seed)
        _, grad, metrics = run(clip_cov_policy_loss, logp, clip_cov_ratio=0.25, **kw)  # max(1, int(0.25 * 4)) = 1
        zero = tuple((grad == 0).nonzero().flatten().tolist())
        assert metrics["pg_clipfrac"] == 1 / 4 and zero in ((0, 0), (1, 0))
        torch.manual_seed(seed)
        assert torch.equal(run(clip_cov_policy_loss, logp, clip_cov_ratio=0.25, **kw)[1], grad)  # same seed, same cut
        cut.add(zero)
    assert cut == {(0, 0), (1, 0)}
    _, grad, metrics = run(clip_cov_policy_loss, logp, clip_cov_ratio=0.5, **kw)  # 2: both
    assert metrics["pg_clipfrac"] == 0.5 and grad[0, 0] == 0 and grad[1, 0] == 0


def test_kl_cov_penalizes_the_largest_covariance_tokens_and_clips_nothing():
    # K = max(1, int(5 * 0.4)) = 2 tokens: sequence 1's first (0.384) and sequence 0's first (0.224)
    loss, grad, metrics = run(kl_cov_policy_loss, COV_LOGP, kl_cov_ratio=0.4, ppo_kl_coef=0.1)
    e = math.exp
    token_losses = [-e(0.3) + 0.1 * 0.3, -e(0.1), -e(-0.1), e(-0.3) + 0.1 * 0.3, e(0.1)]
    assert loss == pytest.approx(sum(token_losses) / 5)
    # no clip: r = e^0.3 keeps its gradient; |d|'s gradient is sign(d)
    close(grad, [[(-e(0.3) + 0.1) / 5, -e(0.1) / 5, -e(-0.1) / 5], [(e(-0.3) - 0.1) / 5, e(0.1) / 5, 0.0]])
    assert metrics == pytest.approx(dict(ppo_kl=(0.3 + 0.1 + 0.1 + 0.3 + 0.1) / 5))  # mean |d|, as verl logs it
    # verl's default ratio (2e-4): K = max(1, int(5 * 2e-4)) = 1, the largest alone
    loss, _, _ = run(kl_cov_policy_loss, COV_LOGP)
    assert loss == pytest.approx((sum(token_losses) - 0.1 * 0.3) / 5)


# ----------------------------------------------------------------------------------------------
# all variants


def test_on_policy_every_variant_gives_the_policy_gradient():
    # logp == old_logp: every ratio is 1, nothing is clipped, and each variant's gradient is -A per
    # token, aggregated as its mode aggregates (seq-mean-token-mean here for all)
    g = torch.Generator().manual_seed(8)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    expected = -adv * mask / mask.sum(-1, keepdim=True) / 3
    for mode in LOSS_MODES:
        logp.grad = None
        cov = dict(clip_cov_lb=100.0, clip_cov_ub=200.0)  # no token in Clip-Cov's window
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-mean", mode=mode, **cov)
        loss.backward()
        torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12, msg=mode)


def test_metrics_are_verls_keys():
    keys = {
        "cispo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "sapo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "geo_mean": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "clip_cov": {"pg_clipfrac", "ppo_kl"},
        "kl_cov": {"ppo_kl"},
    }
    for mode, names in keys.items():
        _, _, metrics = run(policy_loss, COV_LOGP, mode=mode)
        assert set(metrics) == names, mode


@pytest.mark.parametrize("mode", ["sapo", "geo_mean"])
def test_sequence_mean_variants_split_into_micro_batches_exactly(mode):
    # the trainer weights each micro-batch by agg_denominator(its mask, loss_agg_for(mode, ...))
    agg = loss_agg_for(mode, "token-mean")
    assert agg == SEQ_MEAN_AGG and loss_agg_for("cispo", "token-mean") == "token-mean"
    g = torch.Generator().manual_seed(3)
    logp, old = torch.randn(6, 5, generator=g) * 0.3, torch.randn(6, 5, generator=g) * 0.3
    adv = torch.randn(6, 1, generator=g).expand(6, 5)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0], mask[4] = 1, 0  # and one sequence with no tokens
    whole, _ = policy_loss(logp, old, adv, mask, mode=mode)
    pieces = sum(
        policy_loss(logp[rows], old[rows], adv[rows], mask[rows], mode=mode)[0]
        * agg_denominator(mask[rows], agg)
        / agg_denominator(mask, agg)
        for rows in (slice(0, 2), slice(2, 6))
    )
    assert pieces.item() == pytest.approx(whole.item(), rel=1e-6)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown policy loss mode 'dppo_kl'; expected one of .*'kl_cov'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), mode="dppo_kl")
    x = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(TypeError, match=r"unexpected arguments \['tau_postive'\]"):  # a misspelt variant argument
        policy_loss(*x, mode="sapo", tau_postive=2.0)
    # a variant gets the arguments it names: SAPO's tau_pos changes its loss; GSPO, which has none, ignores it
    g = torch.Generator().manual_seed(0)
    y = (0.1 * torch.randn(2, 3, generator=g), 0.1 * torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g))
    y += (torch.ones(2, 3),)
    assert policy_loss(*y, mode="sapo", tau_pos=2.0)[0] != policy_loss(*y, mode="sapo", tau_pos=1.0)[0]
    assert policy_loss(*y, mode="gspo", tau_pos=2.0)[0] == policy_loss(*y, mode="gspo")[0]
