"""What a TRL user's copy of open-r1's reward functions asks of us (tests/openr1_style_rewards.py, written here in
their patterns): completion[0]["content"], a `solution` column, None for an unparseable gold, factories whose inner
function's __name__ is logged, partials, len_reward's batch-wide min/max, **kwargs; and a function that needs a
column the dataset lacks, or takes no **kwargs, named before anything loads."""

import os
import types

import pytest
import torch

import trl_rewards
from reward import load_reward_fns
from rollout import score_samples
from run_log import rollout_metrics
from trl_rewards import check_data, score_rows
from user_errors import RewardError

FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openr1_style_rewards.py")


def chat(question, gold):
    prompt = [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": question}]
    return {"prompt": prompt, "solution": gold}


ROWS = [chat("1/3?", r"\frac{1}{3}"), chat("3+4?", "7"), chat("?", "no gold here")]
SAMPLES = [r for r in ROWS for _ in range(2)]  # 2 samples a prompt, prompt-major, as the rollout holds them
TEXTS = [
    "<think>\nStep 1: add.\n</think>\n<answer>\n\\boxed{\\frac{1}{3}}\n</answer>",
    "\\boxed{\\frac{1}{2}}",
    "<think>\nFirst, 3+4.\nNext, done.\n</think>\n<answer>\n\\boxed{7}\n</answer>",
    "the the the the",
    "\\boxed{1}",
    "<think>\nx\n</think>",
]


def worker(*names, weights=None):
    return load_reward_fns([f"{FILE}:{n}" for n in names], weights, timeout=60.0)


def test_open_r1s_format_and_accuracy_rewards_score_as_written():
    names = ("accuracy_reward", "format_reward", "tag_count_reward", "reasoning_steps_reward", "repetition")
    fn = worker(*names, weights=[1.0, 1.0, 0.5, 0.3, 1.0])
    try:
        scores, extras = score_rows(fn, SAMPLES, TEXTS, response_ids=[[1]] * 6, where="step 1")
        logged = fn.info["names"]
    finally:
        fn.close()
    assert logged == [*names[:-1], "repetition_penalty_reward"]  # the factory's inner function's name
    assert extras["rewards/accuracy_reward"] == [1.0, 0.0, 1.0, 0.0, None, None]  # the gold does not parse: None
    assert extras["rewards/format_reward"] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert extras["rewards/tag_count_reward"] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.25]  # "<think>\n" alone: one tag of 4
    steps = extras["rewards/reasoning_steps_reward"]
    assert steps[1:] == [0.0, pytest.approx(2 / 3), 0.0, 0.0, 0.0] and steps[0] == pytest.approx(1 / 3)
    assert extras["rewards/repetition_penalty_reward"][3] == pytest.approx(-2 / 3)  # 3 bigrams, 1 distinct
    expected = [1 + 1 + 0.5 + 0.3 / 3, 0.0, 1 + 1 + 0.5 + 0.3 * 2 / 3, -2 / 3, 0.0, 0.5 * 0.25]  # None: left out
    assert scores == pytest.approx(expected)
    assert extras["reward_unscored"] == [0.0] * 6  # the other functions applied where accuracy_reward did not


def test_len_reward_and_the_cosine_factory_see_the_ranks_whole_batch_in_one_call():
    """The rollout scores this rank's whole batch (every group) with one call per function, as TRL does, so
    len_reward's shortest and longest are the batch's: 10 and 40 characters here, not each group's."""
    rows = [chat("?", "7"), chat("?", "8")]
    texts = ["\\boxed{7}" + "." * 1, "\\boxed{8}" + "." * 11, "\\boxed{8}" + "." * 21, "\\boxed{7}" + "." * 31]
    assert [len(t) for t in texts] == [10, 20, 30, 40]
    samples = [r for r in rows for _ in range(2)]
    out = types.SimpleNamespace(response_ids=[[3, 2]] * 4, truncated=[False] * 4, turns=None)
    args = types.SimpleNamespace(reward_errors="raise", overlong_buffer_len=0)
    fn = worker("len_reward", "cosine")
    try:
        scores, extras = score_samples((fn, None), samples, texts, out, first=0, args=args, device=None, step=3)
    finally:
        fn.close()
    # right, wrong, right, wrong: 0.5 - (len - 10) / 30, and min(0, that) when wrong. Per group it would be
    # [0.5, -0.5, 0.5, -0.5]
    assert extras["rewards/len_reward"] == pytest.approx([0.5, 0.0, 0.5 - 20 / 30, -0.5])
    # max_len 20: cos(pi/2) = 0 at 10 characters, cos(pi) = -1 from 20 on
    assert extras["rewards/cosine_scaled_reward"] == pytest.approx([0.75, -0.5, 0.5, -0.5])
    assert scores == pytest.approx([1.25, -0.5, 0.5 - 20 / 30 + 0.5, -1.0])


def test_the_names_logged_for_factories_partials_and_repeats_are_trls():
    fn = worker("cosine", "half_bonus", "wrapped_bonus", "nested_bonus", "format_reward", "judge_by_length")
    try:
        scores, extras = score_rows(fn, SAMPLES[:2], TEXTS[:2], response_ids=[[1], [1]])
        names = fn.info["names"]
    finally:
        fn.close()
    # TRL's get_callable_name: the inner function's __name__; a partial's function's; an instance's class name
    assert names == [
        "cosine_scaled_reward",
        "bonus_reward",
        "bonus_reward_2",
        "bonus_reward_3",
        "format_reward",
        "LengthJudge",
    ]
    assert extras["rewards/bonus_reward"] == [0.5, 0.5] and extras["rewards/bonus_reward_3"] == [1.0, 1.0]
    metrics = rollout_metrics(scores, torch.zeros(2), [1, 1], [5, 5], [False] * 2, extras, 2)
    assert metrics["rewards/bonus_reward_2/mean"] == 2.0 and "rewards/cosine_scaled_reward/std" in metrics


def test_a_function_needing_a_column_the_data_lacks_is_named_at_start_up_and_at_the_call():
    fn = worker("format_reward", "code_reward")
    try:
        with pytest.raises(RewardError) as e:  # at start-up: the spec (file and function) and the column
            check_data(fn, ROWS, "data/train.jsonl")
        said = str(e.value)
        assert said.startswith(f"--reward-fn {FILE}:code_reward: this function needs the keyword argument(s) ")
        assert "['verification_info'], which data/train.jsonl has no column for (its columns: ['solution']" in said
        with pytest.raises(RewardError) as e:  # and at the call, where no start-up check ran
            score_rows(fn, SAMPLES, TEXTS, response_ids=[[1]] * 6, where="step 2")
        said = str(e.value)
        assert "reward function code_reward, step 2, samples 0-5 of the batch: needs the keyword argument(s) " in said
        assert "['verification_info'], which this batch's rows has no column for" in said and "TypeError" not in said
        check_data(fn, [{**r, "verification_info": {}} for r in ROWS], "data/train.jsonl")  # with it: fine
    finally:
        fn.close()


def test_a_function_without_kwargs_is_named_at_start_up():
    fn = worker("strict_reward")
    try:
        with pytest.raises(RewardError, match=r"strict_reward: this function has no \*\*kwargs, and is called with "):
            check_data(fn, ROWS, "data/train.jsonl")
        with pytest.raises(RewardError, match=r"strict_reward, samples 0-1: has no \*\*kwargs.*'prompts'"):
            score_rows(fn, SAMPLES[:2], TEXTS[:2])
    finally:
        fn.close()


def test_argument_problem_says_nothing_of_a_function_that_fits():
    assert trl_rewards.argument_problem(["completions", "solution"], None, ["solution"], "d") is None
    takes = ["completions", "solution", *trl_rewards.PASSED]
    assert trl_rewards.argument_problem(["completions"], takes, ["solution"], "d") is None
    assert "['level']" in trl_rewards.argument_problem(["completions"], takes, ["solution", "level"], "d")
