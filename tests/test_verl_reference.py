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


@pytest.mark.parametrize("mode", loss.AGG_MODES)
@pytest.mark.parametrize("scale", [None, 7.0])
def test_agg_loss_equals_verl(core_algos, mode, scale):
    for seed in range(5):
        _, _, _, mask, g = random_batch(seed)
        loss_mat = torch.randn(mask.shape, generator=g)
        theirs = core_algos.agg_loss(loss_mat, mask, mode, loss_scale_factor=scale)
        torch.testing.assert_close(loss.agg_loss(loss_mat, mask, mode, norm_len=scale), theirs, rtol=1e-6, atol=5e-7)
    # the case Dr. GRPO's old sum over sequences got wrong: verl gives 1, the sum gave 2
    two = core_algos.agg_loss(torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), mode)
    mine = loss.agg_loss(torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), mode)
    torch.testing.assert_close(mine, two)


@pytest.mark.parametrize("mode", loss.AGG_MODES)
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
        mine, _ = loss.gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=5e-7)


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


def test_all_equal_groups_are_exactly_zero_where_verl_leaves_rounding_noise(core_algos):
    scores, mask = [6.56] * 8 + [0.0, 1.0] * 4, torch.ones(16, 2)
    theirs = verl_grouped(core_algos, core_algos.compute_grpo_outcome_advantage, scores, 8, mask)
    mine = advantage.grpo_advantages(scores, 8)[:, None] * mask
    assert theirs[:8].abs().max() > 0.1  # verl: |A| of a group with nothing to learn from
    assert mine[:8].abs().max() == 0
    torch.testing.assert_close(mine[8:], theirs[8:], rtol=1e-6, atol=5e-7)
