"""Our formulas against verl 0.9.1's own code (verl/trainer/ppo/core_algos.py, and for --distill-loss
verl/trainer/distillation's distillation_ppo_loss with its loss registry whole) on random batches.

verl is not a dependency: `bash install.sh --dev` puts its modules (no dependencies) into .verl_ref/,
and only this file imports them. Where verl is not there, these tests skip; the hand-computed cases in
test_loss.py and test_advantage.py always run.

Where we differ from verl on purpose, the test says so: a group whose rewards are all equal gets
exactly 0 advantage here, and verl's a rounding error divided by std + eps; k1's advantage takes pi_old where
verl's takes the current log-prob, and --distill-coef stays beta without a task reward, where verl uses 1.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

import numpy as np
import pytest
import torch

import advantage
import distill
import loss
import loss_variants
from config import Args

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
        mine, _ = loss.aggregate(
            *loss_variants.gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4), mask, loss.SEQ_MEAN_AGG
        )
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


@pytest.mark.parametrize("mode", loss.AGG_MODES)
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
    mine, _ = loss.aggregate(
        *loss_variants.geo_mean_policy_loss(logp, old, adv, mask, 0.4, 0.4), mask, loss.SEQ_MEAN_AGG
    )
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


# ---- on-policy distillation: --distill-loss against verl's distillation_ppo_loss (verl/trainer/distillation)


class _Absent(types.ModuleType):
    """A stand-in for a package verl's dataset modules import at the top and the losses never call (datasets,
    pandas): any class name it is asked for is an empty class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


@pytest.fixture(scope="module")
def verl_distillation(core_algos):
    """verl's distillation losses (its registry whole), with no_padding_2_padding as the identity: we hand it
    padded [B, T] tensors where verl's engine hands it packed ones."""
    stubs = [n for n in ("datasets", "pandas") if importlib.util.find_spec(n) is None]
    for n in stubs:
        sys.modules[n] = _Absent(n)
        sys.modules[n].__spec__ = importlib.machinery.ModuleSpec(n, None)
    try:
        losses = importlib.import_module("verl.trainer.distillation.losses")
        fsdp = importlib.import_module("verl.trainer.distillation.fsdp.losses")
        config = importlib.import_module("verl.workers.config")
        utils_losses = importlib.import_module("verl.workers.utils.losses")
        for module in (losses, utils_losses):
            module.no_padding_2_padding = lambda tensor, data: tensor
        yield types.SimpleNamespace(losses=losses, fsdp=fsdp, config=config)
    finally:
        for n in stubs:
            del sys.modules[n]


class VerlData(dict):
    """What verl's losses read from a micro-batch's TensorDict: items, .get, .select(...).to_padded_tensor()."""

    def select(self, *keys):
        return VerlData({k: self[k] for k in keys})

    def to_padded_tensor(self):
        return self


def verl_distill_loss(
    v, mode, student_logits, labels, old, adv, mask, teacher, agg, *, reward, coef, clamp, logp_clamp, clip
):
    """verl's distillation_ppo_loss on one micro-batch: the student's logits [B, T, V] (top-k: their log-softmax
    at the teacher's ids inside verl's own fsdp function), the sampled tokens, the old log-probs, the reward's
    advantages, and the teacher: log-probs [B, T] or (top-k log-probs, ids) [B, T, K]. Returns (loss, metrics)."""
    B, T, V = student_logits.shape
    log_probs = torch.log_softmax(student_logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    topk = mode == "forward_kl_topk"
    loss_config = v.config.DistillationLossConfig(
        loss_mode=mode,
        topk=teacher[0].shape[-1] if topk else None,
        use_task_rewards=reward,
        distillation_loss_coef=coef,
        loss_max_clamp=clamp,
        log_prob_min_clamp=logp_clamp,
        use_policy_gradient=not topk and loss.DISTILL_LOSSES[mode] == "k1",
        clip_ratio=clip,
        clip_ratio_low=clip,
        clip_ratio_high=clip,
    )
    distillation = types.SimpleNamespace(distillation_loss=loss_config)
    config = ActorConfig(
        verl_config(agg, 0.2, 0.28, loss_scale_factor=9.0 if "norm" in agg else None),
        loss_scale_factor=9.0 if "norm" in agg else None,
        policy_loss=dict(loss_mode="vanilla"),
        entropy_coeff=0.0,
        use_kl_loss=False,
    )
    data = VerlData(response_mask=mask, old_log_probs=old, advantages=adv, dp_size=1)
    data.update(batch_num_tokens=None, global_batch_size=None)
    output = dict(log_probs=log_probs)
    if topk:
        nested = [torch.nested.as_nested_tensor([t.reshape(B * T, -1)], layout=torch.jagged) for t in teacher]
        their = v.fsdp.compute_forward_kl_topk(student_logits.reshape(1, B * T, V), *nested, distillation, "thd")
        output.update({k: x.reshape(B, T) for k, x in their.items()})
    else:
        data["teacher_logprobs"] = teacher[..., None]
    return v.losses.distillation_ppo_loss(config, distillation, output, data)


def my_distill_loss(
    mode, student_logits, labels, old, adv, mask, teacher, agg, *, reward, coef, clamp, logp_clamp, clip
):
    """loss.micro_batch_loss on the same micro-batch, the way the trainer calls it: logp [B, T], or [B, T, 1 + K]
    with the student's log-probs at the teacher's top-k ids (the fused head's one pass)."""
    args = Args(teacher="t", distill_loss=mode, distill_coef=coef, clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    args.distill_loss_clamp, args.distill_logp_clamp, args.distill_clip = clamp or 0.0, logp_clamp or 0.0, clip
    args.loss_agg, args.loss_scale_factor, args.reward = agg, 9.0, reward
    log_softmax = torch.log_softmax(student_logits.float(), -1)
    view = dict(response_mask=mask, old_logp=old, advantages=adv if reward else torch.zeros_like(adv))
    if mode == "forward_kl_topk":
        view.update(teacher_topk_logp=teacher[0])
        logp = log_softmax.gather(-1, torch.cat([labels[..., None], teacher[1]], -1))  # [B, T, 1 + K]
    else:
        view.update(teacher_logp=teacher)
        logp = log_softmax.gather(-1, labels[..., None]).squeeze(-1)
    whole = loss.loss_denominator(mask, args)  # one micro-batch: its loss unweighted
    total, terms, _ = loss.micro_batch_loss(logp, torch.zeros(mask.shape), view, args=args, whole=whole, world=1)
    return total, terms


def distill_batch(seed, mode, B=6, T=5, V=40, K=8, on_policy=False):
    """Student logits, sampled tokens, old log-probs (the sampled tokens' under logits moved a little, or the
    same), a reward's advantages, a mask with an empty row, and the teacher's log-probs of the sampled tokens
    or its top-K (log-probs, ids)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    moved = logits if on_policy else logits + 0.3 * torch.randn(B, T, V, generator=g)
    old = torch.log_softmax(moved, -1).gather(-1, labels[..., None]).squeeze(-1)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[2], mask[:, 0] = 0, torch.where(torch.arange(B) == 2, 0.0, 1.0)
    teacher_all = torch.log_softmax(torch.randn(B, T, V, generator=g) * 2, -1)
    if mode == "forward_kl_topk":
        return logits, labels, old, adv, mask, tuple(teacher_all.topk(K, -1))
    return logits, labels, old, adv, mask, teacher_all.gather(-1, labels[..., None]).squeeze(-1)


DISTILL_MODES = ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "forward_kl_topk"]


@pytest.mark.parametrize("mode", DISTILL_MODES)
@pytest.mark.parametrize("agg", loss.AGG_MODES)
@pytest.mark.parametrize("reward", [True, False])
def test_every_distill_loss_equals_verls_loss_and_gradient(verl_distillation, mode, agg, reward):
    """verl's distillation_ppo_loss and ours: the same loss, the same gradient with respect to the student's
    logits (through the sampled token's log-prob and, for top-k, the teacher's ids'), the same loss_max/min and
    masses. With a reward, beta 0.5 and verl's coefficient 0.5; without one verl sets beta to 1, so we use 1
    (test_without_a_reward_beta_scales_what_verl_fixes_at_1 shows the difference). k1 is verl's policy-gradient
    mode, its surrogate clipped at 0.1 of its own; on-policy here, where verl's current log-prob is pi_old."""
    coef = 0.5 if reward else 1.0
    for seed, clamp, logp_clamp in ((0, None, None), (1, 0.7, -2.0), (2, None, -2.0), (3, 2.0, None)):
        *batch, teacher = distill_batch(seed, mode, on_policy=loss.DISTILL_LOSSES[mode] == "k1")
        how = dict(reward=reward, coef=coef, clamp=clamp, logp_clamp=logp_clamp if mode == "forward_kl_topk" else None)
        how["clip"] = 0.1 if loss.DISTILL_LOSSES[mode] == "k1" else 0.0
        theirs_in, mine_in = batch[0].clone().requires_grad_(), batch[0].clone().requires_grad_()
        their_loss, their_metrics = verl_distill_loss(
            verl_distillation, mode, theirs_in, *batch[1:], teacher, agg, **how
        )
        my_loss, terms = my_distill_loss(mode, mine_in, *batch[1:], teacher, agg, **how)
        their_loss.backward(), my_loss.backward()
        torch.testing.assert_close(my_loss, their_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-5)
        assert mine_in.grad.abs().max() > 0
        verl_value = {k: v.values[0] if hasattr(v, "values") else v for k, v in their_metrics.items()}
        for name in ("loss", "loss_max", "loss_min") + (("student_mass", "teacher_mass") if "topk" in mode else ()):
            assert terms[f"distill/{name}"] == pytest.approx(float(verl_value[f"distillation/{name}"]), abs=1e-5), name


@pytest.mark.parametrize("agg", loss.AGG_MODES)
@pytest.mark.parametrize("reward", [True, False])
def test_the_default_k1_advantage_equals_verls_policy_gradient_mode_on_policy(verl_distillation, agg, reward):
    """The default (--distill-loss k1, no --distill-clip): the teacher's term joins the reward's advantage, one
    surrogate (distill.teacher_advantages). verl runs two surrogates, the reward's and the teacher's; on-policy
    (ratio 1) each is linear in its advantage, so one surrogate of the sum is the same loss and gradient."""
    coef = 0.5 if reward else 1.0
    for seed in range(3):
        logits, labels, old, adv, mask, teacher = distill_batch(seed, "k1", on_policy=True)
        how = dict(reward=reward, coef=coef, clamp=None, logp_clamp=None, clip=0.2)
        theirs_in, mine_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        their_loss, _ = verl_distill_loss(
            verl_distillation, "k1", theirs_in, labels, old, adv, mask, teacher, agg, **how
        )
        args = Args(clip_low=0.2, clip_high=0.28, kl_coef=0.0, loss_scale_factor=9.0, loss_agg=agg)
        summed = (adv if reward else 0) + distill.teacher_advantages(teacher, old, mask, coef)
        logp = torch.log_softmax(mine_in, -1).gather(-1, labels[..., None]).squeeze(-1)
        view = dict(response_mask=mask, old_logp=old, advantages=summed)
        whole = loss.loss_denominator(mask, args)  # one micro-batch: its loss unweighted
        my_loss, _, _ = loss.micro_batch_loss(logp, torch.zeros(mask.shape), view, args=args, whole=whole, world=1)
        their_loss.backward(), my_loss.backward()
        torch.testing.assert_close(my_loss, their_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-5)


def test_k1_with_its_own_clip_takes_pi_old_where_verl_takes_the_current_log_prob(verl_distillation):
    """Off-policy (the policy moved since the old log-probs: a second mini-batch or PPO epoch) our k1 advantage
    is -(log pi_old - log pi_T), fixed for the step like the reward's, where verl's is -(log pi_theta - log pi_T)
    at the current weights: the losses differ, and ours is verl's own vanilla surrogate on pi_old's advantage."""
    logits, labels, old, adv, mask, teacher = distill_batch(0, "k1", on_policy=False)
    how = dict(reward=False, coef=1.0, clamp=None, logp_clamp=None, clip=0.1)
    their_loss, _ = verl_distill_loss(
        verl_distillation, "k1", logits, labels, old, adv, mask, teacher, "token-mean", **how
    )
    my_loss, _ = my_distill_loss("k1", logits, labels, old, adv, mask, teacher, "token-mean", **how)
    assert (my_loss - their_loss).abs() > 1e-3
    core = importlib.import_module("verl.trainer.ppo.core_algos")
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    config = verl_config("token-mean", 0.1, 0.1)
    on_old, _ = core.compute_policy_loss_vanilla(old, logp, -(old - teacher), mask, "token-mean", config)
    torch.testing.assert_close(my_loss, on_old, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["k3", "forward_kl_topk", "k1"])
def test_without_a_reward_beta_scales_what_verl_fixes_at_1(verl_distillation, mode):
    """verl ignores distillation_loss_coef without task rewards (beta = 1); --distill-coef keeps its meaning
    with --no-reward: beta 0.25 is a quarter of verl's loss."""
    *batch, teacher = distill_batch(4, mode, on_policy=True)
    how = dict(reward=False, clamp=None, logp_clamp=None, clip=0.2 if mode == "k1" else 0.0)
    their_loss, _ = verl_distill_loss(verl_distillation, mode, *batch, teacher, "token-mean", coef=0.25, **how)
    my_loss, _ = my_distill_loss(mode, *batch, teacher, "token-mean", coef=0.25, **how)
    assert their_loss.abs() > 1e-3
    torch.testing.assert_close(my_loss, 0.25 * their_loss, rtol=1e-5, atol=1e-6)
