"""Our formulas against verl 0.9.1's own code (verl/trainer/ppo/core_algos.py) on random batches.

verl is not a dependency: `bash install.sh --dev` puts its modules (no dependencies) into .verl_ref/,
and only this file imports them. Where verl is not there, these tests skip; the hand-computed cases in
test_loss.py and test_advantage.py always run.

Where we differ from verl on purpose, the test says so: a group whose rewards are all equal gets
exactly 0 advantage here, and verl's a rounding error divided by std + eps.
"""

import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch

import advantage
import loss
import loss_agg
import loss_variants

VERL_REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".verl_ref")


@pytest.fixture(scope="module")
def core_algos():
    if not os.path.isdir(os.path.join(VERL_REF, "verl")):
        pytest.skip(f"verl's reference code is not in {VERL_REF} (bash install.sh --dev puts it there)")
    saved_path, saved_modules = list(sys.path), dict(sys.modules)
    try:
        # verl/protocol.py names ray.ObjectRef in an annotation; no ray function is called
        sys.modules.setdefault("ray", types.SimpleNamespace(ObjectRef=object, remote=lambda *a, **k: a and a[0]))
        # omegaconf 2.3 needs antlr4 4.9; math-verify (ours) needs 4.13: 4.9 only while omegaconf imports
        antlr = [m for m in sys.modules if m.startswith("antlr4")]
        for m in antlr:
            del sys.modules[m]
        sys.path[:0] = [os.path.join(VERL_REF, "antlr4_49"), VERL_REF]
        importlib.import_module("omegaconf")
        sys.path.remove(os.path.join(VERL_REF, "antlr4_49"))
        for m in [m for m in sys.modules if m.startswith("antlr4")]:
            del sys.modules[m]
        module = importlib.import_module("verl.trainer.ppo.core_algos")
        yield module
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - set(saved_modules):
            if name.startswith(("verl", "omegaconf", "tensordict", "antlr4", "ray", "codetiming", "pyvers", "orjson")):
                del sys.modules[name]
        sys.modules.update({k: v for k, v in saved_modules.items() if k.startswith("antlr4")})


class ActorConfig(dict):
    """What verl's policy losses read from their config: attributes and .get."""

    __getattr__ = dict.__getitem__


def verl_config(loss_agg_mode, clip_low=0.2, clip_high=0.28, clip_c=3.0, loss_scale_factor=None):
    return ActorConfig(
        clip_ratio=clip_low,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=clip_c,
        loss_agg_mode=loss_agg_mode,
        global_batch_info=dict(loss_scale_factor=loss_scale_factor) if "norm" in loss_agg_mode else {},
    )


def random_batch(seed, B=12, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[3] = 0  # a sequence with no tokens
    mask[:, 0] = torch.where(torch.arange(B) == 3, 0.0, 1.0)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    return logp, old, adv, mask, g


@pytest.mark.parametrize("mode", loss_agg.AGG_MODES)
@pytest.mark.parametrize("scale", [None, 7.0])
def test_agg_loss_equals_verl(core_algos, mode, scale):
    for seed in range(5):
        _, _, _, mask, g = random_batch(seed)
        loss_mat = torch.randn(mask.shape, generator=g)
        theirs = core_algos.agg_loss(loss_mat, mask, mode, loss_scale_factor=scale)
        torch.testing.assert_close(
            loss_agg.agg_loss(loss_mat, mask, mode, norm_len=scale), theirs, rtol=1e-6, atol=5e-7
        )
    # the case Dr. GRPO's old sum over sequences got wrong: verl gives 1, the sum gave 2
    two = core_algos.agg_loss(torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), mode)
    mine = loss_agg.agg_loss(torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), mode)
    torch.testing.assert_close(mine, two)


@pytest.mark.parametrize("mode", loss_agg.AGG_MODES)
def test_vanilla_policy_loss_equals_verl(core_algos, mode):
    for seed in range(5):
        logp, old, adv, mask, g = random_batch(seed)
        weights = torch.rand(mask.shape, generator=g) * 2
        theirs, their_metrics = core_algos.compute_policy_loss_vanilla(
            old, logp, adv, mask, mode, verl_config(mode, loss_scale_factor=9.0), rollout_is_weights=weights
        )
        mine, metrics = loss.policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, mode, weights, norm_len=9.0)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=5e-7)
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            assert metrics[key].item() == pytest.approx(their_metrics[f"actor/{key}"], abs=5e-7)


def test_gspo_loss_equals_verl(core_algos):
    for seed in range(5):
        logp, old, adv, mask, _ = random_batch(seed)
        old = logp + 0.001 * (old - logp)  # GSPO's clip range is narrow: ratios near 1
        # GSPO checks isinstance(config, verl's ActorConfig): an instance of it, with only what it reads set
        config = object.__new__(core_algos.ActorConfig)
        fields = dict(clip_ratio=3e-4, clip_ratio_low=3e-4, clip_ratio_high=4e-4, global_batch_info={})
        for key, value in fields.items():
            object.__setattr__(config, key, value)
        theirs, _ = core_algos.compute_policy_loss_gspo(old, logp, adv, mask, "seq-mean-token-mean", config)
        mine, _ = loss_variants.gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=5e-7)


# ---- the --loss-mode variants: value, gradient with respect to logp, and the metrics verl logs


def real_actor_config(core_algos, **fields):
    """An instance of verl's ActorConfig (CISPO and SAPO check isinstance) with only what they read set."""
    config = object.__new__(core_algos.ActorConfig)
    for key, value in dict(global_batch_info={}, **fields).items():
        object.__setattr__(config, key, value)
    return config


def assert_same_as_verl(theirs, mine, batch, seed=0):
    """theirs(old, logp, adv, mask, weights) (verl's argument order) and mine(logp, old, adv, mask,
    weights), each -> (loss, metrics), called after torch.manual_seed(seed) (Clip-Cov draws at random):
    equal loss, d loss / d logp and metrics."""
    logp, old, adv, mask, weights = batch
    lp_theirs, lp_mine = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    torch.manual_seed(seed)
    their_loss, their_metrics = theirs(old, lp_theirs, adv, mask, weights)
    torch.manual_seed(seed)
    my_loss, metrics = mine(lp_mine, old, adv, mask, weights)
    their_loss.backward(), my_loss.backward()
    torch.testing.assert_close(my_loss, their_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp_mine.grad, lp_theirs.grad, rtol=1e-6, atol=1e-6)
    assert set(metrics) == {k.removeprefix("actor/") for k in their_metrics}
    for key, value in metrics.items():
        assert value.item() == pytest.approx(their_metrics[f"actor/{key}"], abs=1e-6), key


@pytest.mark.parametrize("mode", loss_agg.AGG_MODES)
def test_cispo_equals_verl(core_algos, mode):
    config = real_actor_config(core_algos, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    if "norm" in mode:
        config.global_batch_info["loss_scale_factor"] = 9.0

    def theirs(old, logp, adv, mask, w):
        return core_algos.compute_policy_loss_cispo(old, logp, adv, mask, mode, config, rollout_is_weights=w)

    def mine(logp, old, adv, mask, w):
        return loss.policy_loss(
            logp, old, adv, mask, 0.2, 0.28, agg=mode, rollout_is_weights=w, norm_len=9.0, mode="cispo"
        )

    for seed in range(5):
        _, old, adv, mask, g = random_batch(seed)
        logp = old + 0.3 * torch.randn(mask.shape, generator=g)
        assert_same_as_verl(theirs, mine, (logp, old, adv, mask, torch.rand(mask.shape, generator=g) * 2))


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_equals_verl(core_algos, tau_pos, tau_neg):
    config = real_actor_config(core_algos, tau_pos=tau_pos, tau_neg=tau_neg)

    def theirs(old, logp, adv, mask, w):
        return core_algos.compute_policy_loss_sapo(old, logp, adv, mask, "seq-mean-token-mean", config, w)

    def mine(logp, old, adv, mask, w):
        return loss.policy_loss(
            logp, old, adv, mask, rollout_is_weights=w, mode="sapo", tau_pos=tau_pos, tau_neg=tau_neg
        )

    for seed in range(5):
        logp, old, adv, mask, g = random_batch(seed)
        adv[0] = 0  # A = 0 takes tau_neg
        assert_same_as_verl(theirs, mine, (logp, old, adv, mask, torch.rand(mask.shape, generator=g) * 2))


@pytest.mark.parametrize("clip_low, clip_high", [(0.4, 0.4), (0.2, 0.28)])
def test_geo_mean_equals_verl(core_algos, clip_low, clip_high):
    config = verl_config("token-mean", clip_low, clip_high)

    def theirs(old, logp, adv, mask, w):
        return core_algos.compute_policy_loss_geo_mean(old, logp, adv, mask, "token-mean", config, w)

    def mine(logp, old, adv, mask, w):
        return loss.policy_loss(logp, old, adv, mask, clip_low, clip_high, rollout_is_weights=w, mode="geo_mean")

    for seed in range(5):
        logp, old, adv, mask, g = random_batch(seed)
        mask[3, 0] = 1  # every sequence has a token: verl averages over the empty ones too (below)
        weights = (torch.rand(mask.shape, generator=g) * 2 + 0.1) * mask  # zero on padding, as the trainer's
        assert_same_as_verl(theirs, mine, (logp, old, adv, mask, weights))


def test_geo_mean_skips_the_empty_sequences_verl_averages_over(core_algos):
    logp, old, adv, mask, _ = random_batch(0)  # sequence 3 has no tokens
    config = verl_config("token-mean", 0.4, 0.4)
    theirs, _ = core_algos.compute_policy_loss_geo_mean(old, logp, adv, mask, "token-mean", config)
    mine, _ = loss_variants.geo_mean_policy_loss(logp, old, adv, mask, 0.4, 0.4)
    torch.testing.assert_close(mine, theirs * 12 / 11, rtol=1e-6, atol=1e-6)  # verl: / 12 sequences, ours: / 11


def cov_batch(seed):
    """random_batch, and the covariance (A - mean A)(logp - mean logp) of its unmasked tokens [n]."""
    logp, old, adv, mask, g = random_batch(seed)
    valid = mask > 0
    cov = (adv[valid] - adv[valid].mean()) * (logp[valid] - logp[valid].mean())
    return (logp, old, adv, mask, torch.rand(mask.shape, generator=g) * 2), cov


@pytest.mark.parametrize("ratio", [2e-4, 0.05, 1.0])
def test_clip_cov_equals_verl(core_algos, ratio):
    """The same tokens are cut: the same candidates (no covariance within 1e-4 of the window's bounds,
    so rounding cannot move one in or out) and verl's random draw seeded alike."""
    lb, ub = 0.5, 2.0
    policy = ActorConfig(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
    config = ActorConfig(verl_config("token-mean"), policy_loss=policy)

    def theirs(old, logp, adv, mask, w):
        return core_algos.compute_policy_loss_clip_cov(old, logp, adv, mask, "token-mean", config, w)

    def mine(logp, old, adv, mask, w):
        cov = dict(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
        return loss.policy_loss(logp, old, adv, mask, 0.2, 0.28, rollout_is_weights=w, mode="clip_cov", **cov)

    for seed in range(5):
        batch, cov = cov_batch(seed)
        assert (cov - lb).abs().min() > 1e-4 and (cov - ub).abs().min() > 1e-4
        in_window = ((cov > lb) & (cov < ub)).sum().item()
        assert ratio == 1.0 or in_window > max(int(ratio * len(cov)), 1)  # more candidates than cuts: a real draw
        assert_same_as_verl(theirs, mine, batch, seed=seed)


@pytest.mark.parametrize("ratio, coef", [(2e-4, 0.1), (0.1, 1.0), (0.5, 0.3)])
def test_kl_cov_equals_verl(core_algos, ratio, coef):
    """The same tokens are penalized: the k-th and (k+1)-th largest covariances differ by more than 1e-4."""
    config = ActorConfig(verl_config("token-mean"), policy_loss=ActorConfig(kl_cov_ratio=ratio, ppo_kl_coef=coef))

    def theirs(old, logp, adv, mask, w):
        return core_algos.compute_policy_loss_kl_cov(old, logp, adv, mask, "token-mean", config, w)

    def mine(logp, old, adv, mask, w):
        return loss.policy_loss(
            logp, old, adv, mask, rollout_is_weights=w, mode="kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=coef
        )

    for seed in range(5):
        batch, cov = cov_batch(seed)
        k, top = max(1, int(len(cov) * ratio)), cov.sort(descending=True).values
        assert top[k - 1] - top[k] > 1e-4
        assert_same_as_verl(theirs, mine, batch)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_estimators_equal_verl(core_algos, kind):
    logp, old, _, _, _ = random_batch(1)
    torch.testing.assert_close(loss.kl_penalty(logp, old, kind), core_algos.kl_penalty(logp, old, kind))


def verl_grouped(core_algos, fn, scores, n, mask, **kw):
    index = np.repeat(np.arange(len(scores) // n), n)
    rewards = torch.zeros(mask.shape)
    rewards[:, 0] = torch.tensor(scores)  # the score sits on one token; verl sums over tokens
    adv, _ = fn(rewards, mask, index, **kw)
    return adv


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_and_rloo_advantages_equal_verl(core_algos, norm_by_std):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(32, generator=g).tolist()
    mask = torch.ones(32, 4)
    theirs = verl_grouped(
        core_algos, core_algos.compute_grpo_outcome_advantage, scores, 8, mask, norm_adv_by_std_in_grpo=norm_by_std
    )
    mine = advantage.grpo_advantages(scores, 8, norm_by_std)[:, None] * mask
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=5e-7)
    theirs = verl_grouped(core_algos, core_algos.compute_rloo_outcome_advantage, scores, 8, mask)
    torch.testing.assert_close(advantage.rloo_advantages(scores, 8)[:, None] * mask, theirs, rtol=1e-6, atol=5e-7)


def test_reinforce_pp_baseline_equals_verl(core_algos):
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(16, generator=g).tolist()
    mask = (torch.rand(16, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    theirs = verl_grouped(
        core_algos, core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage, scores, 4, mask
    )
    mine = advantage.reinforce_pp_baseline_advantages(scores, 4, mask)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_grpo_passk_equals_verl(core_algos, norm_by_std, n):
    for seed in range(5):  # 0/1 rewards, small integers (ties for the best and for the second) and floats
        g = torch.Generator().manual_seed(seed)
        binary, few = torch.randint(0, 2, (8 * n,), generator=g), torch.randint(0, 4, (8 * n,), generator=g)
        for scores in (binary.float(), few.float() * 0.7, torch.rand(8 * n, generator=g)):
            mask = (torch.rand(8 * n, 3, generator=g) > 0.3).float()
            mask[:, 0] = 1
            # verl reads norm_adv_by_std_in_grpo from its config, not from the keyword
            config = dict(norm_adv_by_std_in_grpo=norm_by_std)
            theirs = verl_grouped(
                core_algos, core_algos.compute_grpo_passk_outcome_advantage, scores.tolist(), n, mask, config=config
            )
            mine = advantage.compute_advantages(scores, n, "grpo_passk", norm_by_std)[:, None] * mask
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_all_equal_groups_are_exactly_zero_where_verl_leaves_rounding_noise(core_algos):
    scores, mask = [6.56] * 8 + [0.0, 1.0] * 4, torch.ones(16, 2)
    theirs = verl_grouped(core_algos, core_algos.compute_grpo_outcome_advantage, scores, 8, mask)
    mine = advantage.grpo_advantages(scores, 8)[:, None] * mask
    assert theirs[:8].abs().max() > 0.1  # verl: |A| of a group with nothing to learn from
    assert mine[:8].abs().max() == 0
    torch.testing.assert_close(mine[8:], theirs[8:], rtol=1e-6, atol=5e-7)
