"""trl_rewards.py: TRL-style batched reward functions, found by their parameters, called TRL's way in the
reward worker: one call per function and batch, None = "does not apply", errors named as verl's are."""

import math
import os
import textwrap

import pytest

import flag_rules
import trl_rewards
from reward import load_reward_fn, load_reward_fns
from run_log import rollout_metrics, sample_records
from trl_rewards import is_batched, score_rows
from user_errors import RewardError

REWARDS = textwrap.dedent(
    """
    import asyncio, time

    def accuracy_reward(completions, solution, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        kwargs["log_extra"]("golden", list(solution))
        kwargs["log_metric"]("my/answers", float(len(texts)))
        return [1.0 if s in t else 0.0 for t, s in zip(texts, solution)]

    def seen(prompts, completions, completion_ids, trainer_state, solution, level, **kwargs):
        assert trainer_state.global_step == 7, trainer_state
        assert all(isinstance(i, int) for ids in completion_ids for i in ids), completion_ids
        return [float(len(ids)) for ids in completion_ids]

    def only_hard(completions, level, **kwargs):
        return [1.0 if lv == "hard" else None for lv in level]

    def never(completions, **kwargs):
        return [None] * len(completions)

    def raises(completions, **kwargs):
        raise KeyError("solution")

    def hangs(completions, **kwargs):
        time.sleep(60)

    def too_short(completions, **kwargs):
        return [1.0]

    def text_score(completions, **kwargs):
        return ["1.0"] + [0.0] * (len(completions) - 1)

    async def judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5 for _ in completions]

    class Length:
        __name__ = "length_score"

        def __call__(self, completion_ids, **kwargs):
            return [float(len(ids)) for ids in completion_ids]

    length_score = Length()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 2.0

    def one_huge(completions, **kwargs):
        return [0.5] * 3 + [10**400] + [0.5] * (len(completions) - 4)

    def huge_float(completions, **kwargs):
        return [1e308] * len(completions)

    def ok(completions, **kwargs):
        return [1e308] * len(completions)

    def rewrites(completions, solution, completion_ids, **kwargs):
        completions[0], solution[0] = "rewritten", "rewritten"
        completion_ids[0].clear()
        return [0.0] * len(completions)

    def reads(completions, solution, completion_ids, **kwargs):
        return [float("rewritten" in (c, s) or not ids) for c, s, ids in zip(completions, solution, completion_ids)]
    """
)

TEXT_ROWS = [
    {"prompt": "Q: 1+1? A:", "solution": "2", "level": "easy", "prompt_ids": [1, 2]},
    {"prompt": "Q: 2+3? A:", "solution": "5", "level": "hard", "prompt_ids": [1, 3]},
]
CHAT_ROWS = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in TEXT_ROWS]
TEXTS = ["it is 2", "it is 6"]
IDS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def worker(rewards_file, *names, weights=None, timeout=30.0):
    return load_reward_fns([f"{rewards_file}:{n}" for n in names], weights, timeout)


def test_each_kind_is_found_by_its_parameters(rewards_file):
    kinds = {n: is_batched(load_reward_fn(f"{rewards_file}:{n}")) for n in ("accuracy_reward", "judge", "length_score")}
    assert kinds == {"accuracy_reward": True, "judge": True, "length_score": True}
    assert not is_batched(load_reward_fn(f"{rewards_file}:compute_score"))
    assert not is_batched(lambda **kwargs: 0.0)  # verl calls it by keyword, as before


def test_a_text_prompt_gets_text_completions_columns_logs_and_trainer_state(rewards_file):
    fn = worker(rewards_file, "accuracy_reward", "seen")
    try:
        scores, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, step=7, where="step 7")
    finally:
        fn.close()
    assert scores == [1.0 + 3.0, 0.0 + 2.0]
    assert extras["rewards/accuracy_reward"] == [1.0, 0.0] and extras["rewards/seen"] == [3.0, 2.0]
    assert extras["log_extra/golden"] == ["2", "5"] and extras["log_metric/my/answers"] == [2.0, 2.0]
    metrics = rollout_metrics(scores, __import__("torch").zeros(2), [3, 2], [2, 2], [False] * 2, extras, 2)
    assert metrics["rewards/accuracy_reward/mean"] == 0.5
    assert math.isclose(metrics["rewards/accuracy_reward/std"], math.sqrt(0.5))  # unbiased, as TRL's nanstd
    assert metrics["my/answers"] == 2.0 and metrics["reward_extra/reward_unscored/mean"] == 0.0
    assert not any(k.startswith("reward_extra/log_extra") for k in metrics)

    class Tok:
        def decode(self, ids):
            return str(ids)

    records = sample_records(Tok(), TEXT_ROWS, TEXTS, scores, extras)
    assert records[1]["golden"] == "5" and records[1]["rewards/accuracy_reward"] == 0.0
    assert records[0]["ground_truth"] is None  # a prompt-only row has none


def test_a_chat_prompt_gets_assistant_messages(rewards_file):
    fn = worker(rewards_file, "accuracy_reward")
    try:
        scores, _ = score_rows(fn, CHAT_ROWS, TEXTS, response_ids=IDS)
    finally:
        fn.close()
    assert scores == [1.0, 0.0]  # accuracy_reward read c[0]["content"]: a str completion would fail there


def test_none_leaves_a_function_out_of_the_weighted_sum_and_all_none_is_a_counted_skip(rewards_file, capsys):
    fn = worker(rewards_file, "only_hard", "length_score", "never", weights=[2.0, 0.5, 3.0])
    try:
        scores, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS)
    finally:
        fn.close()
    assert scores == [0.5 * 3, 2.0 * 1.0 + 0.5 * 2]
    assert extras["rewards/only_hard"] == [None, 1.0] and extras["rewards/never"] == [None, None]
    fn = worker(rewards_file, "only_hard", "never")
    try:
        scores, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, where="step 2")
    finally:
        fn.close()
    assert scores == [0.0, 1.0] and extras["reward_unscored"] == [1.0, 0.0]
    err = capsys.readouterr().err
    assert "1 of 2 samples at step 2 got None from every reward function (only_hard, never)" in err
    assert "step 2, sample 0 of the batch" in err


@pytest.mark.parametrize(
    "name, said",
    [
        ("raises", "reward function raises, step 3, samples 4-5 of the batch: raised KeyError: 'solution'"),
        (
            "too_short",
            "reward function too_short, step 3, samples 4-5 of the batch: returned 1 rewards for 2 completions",
        ),
        ("text_score", "reward function text_score, step 3, sample 4 of the batch: returned '1.0' (a str) for it"),
    ],
)
def test_a_failing_function_stops_the_run_naming_it_or_is_skipped_and_counted(rewards_file, name, said, capsys):
    fn = worker(rewards_file, "length_score", name)
    try:
        with pytest.raises(RewardError) as e:
            score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, first=4, where="step 3")
        assert said in str(e.value) and "--reward-errors skip" in str(e.value)
        scores, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, first=4, where="step 3", errors="skip")
    finally:
        fn.close()
    wrong = [1.0, 0.0] if name == "text_score" else [1.0, 1.0]
    assert extras["reward_error"] == wrong
    assert scores == [0.0 if w else 2.0 for w in wrong]
    assert said in capsys.readouterr().err


def test_a_hanging_function_times_out_naming_it(rewards_file):
    fn = worker(rewards_file, "length_score", "hangs", timeout=1.0)
    try:
        with pytest.raises(
            RewardError, match=r"reward function hangs, step 1, samples 0-1 of the batch: did not return within 1 s"
        ):
            score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, where="step 1")
        scores, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, errors="skip")
    finally:
        fn.close()
    assert scores == [0.0, 0.0] and extras["reward_error"] == [1.0, 1.0]


def test_async_functions_and_callable_instances(rewards_file):
    fn = worker(rewards_file, "judge", "length_score")
    try:
        scores, extras = score_rows(fn, CHAT_ROWS, TEXTS, response_ids=IDS)
    finally:
        fn.close()
    assert scores == [3.5, 2.5] and extras["rewards/judge"] == [0.5, 0.5]
    assert extras["rewards/length_score"] == [3.0, 2.0]


def test_verl_functions_beside_trl_ones_and_alone(rewards_file):
    fn = worker(rewards_file, "compute_score", "judge", weights=[1.0, 2.0])
    try:
        scores, extras = score_rows(fn, CHAT_ROWS, TEXTS, response_ids=IDS)
    finally:
        fn.close()
    assert scores == [3.0, 3.0] and extras["rewards/compute_score"] == [2.0, 2.0]
    fn = worker(rewards_file, "compute_score")
    try:
        assert fn.info is None  # verl's worker, as before
        with pytest.raises(RewardError, match="this is a prompt-only dataset .* write it TRL's way"):
            score_rows(fn, CHAT_ROWS, TEXTS)
    finally:
        fn.close()


def test_an_installed_module_is_a_reward_spec(tmp_path, monkeypatch):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "rewards.py").write_text(
        "def think(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker process imports it too
    args = type("A", (), {"reward_fn": "mypkg.rewards:think", "reward_weights": ""})()
    assert all(ok for ok, _ in flag_rules.reward_rules(args))
    args.reward_fn = "no/such.py:f"
    assert not all(ok for ok, _ in flag_rules.reward_rules(args))
    fn = load_reward_fns(["mypkg.rewards:think"])
    try:
        assert score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS)[0] == [1.0, 1.0]
        assert fn.info["names"] == ["think"]
    finally:
        fn.close()
    with pytest.raises(ImportError, match="cannot import module 'mypkg.nothing'"):
        load_reward_fn("mypkg.nothing:f")
    assert trl_rewards.function_names([len, len, abs]) == ["len", "len_2", "abs"]


# ----------------------------------------------------------------------------------------------
# TRL 1.16.0's own trl.rewards, from .trl_ref/ (bash install.sh --dev): it imports with math-verify alone

TRL_REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".trl_ref")


@pytest.fixture
def trl_ref(monkeypatch):
    if not os.path.isdir(os.path.join(TRL_REF, "trl", "rewards")):
        pytest.skip(f"TRL's code is not in {TRL_REF} (bash install.sh --dev puts it there)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TRL_REF, os.environ.get("PYTHONPATH", "")]))  # the worker's


def test_trls_own_reward_functions_and_a_factory_made_in_a_users_file(trl_ref, tmp_path):
    mine = tmp_path / "my_rewards.py"
    mine.write_text(
        "from trl.rewards import get_soft_overlong_punishment\n"
        "overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)\n"
    )
    specs = ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward", f"{mine}:overlong"]
    rows = [{**CHAT_ROWS[0], "solution": gold} for gold in (r"\frac{1}{3}", r"\frac{1}{3}", "no gold here")]
    texts = [
        "<think>\nI divide.\n</think>\nSo \\boxed{\\frac{1}{3}}",
        "<think>\nno closing tag, \\boxed{\\frac{1}{2}}",
        "<think>\nx\n</think>\n\\boxed{1}",
    ]
    fn = load_reward_fns(specs, [1.0, 2.0, 0.5], 60.0)
    try:
        scores, extras = score_rows(fn, rows, texts, response_ids=[[1] * 6, [1] * 8, [1] * 12], where="step 1")
        names = fn.info["names"]
    finally:
        fn.close()
    assert names == ["think_format_reward", "accuracy_reward", "soft_overlong_punishment_reward"]
    assert extras["rewards/think_format_reward"] == [1.0, 0.0, 1.0]
    assert extras["rewards/accuracy_reward"] == [1.0, 0.0, None]  # an unparseable gold: None, left out
    # DAPO's: 0 up to 10 - 4 = 6 tokens, then (6 - length) / 4, and -1 past 10
    assert extras["rewards/soft_overlong_punishment_reward"] == [0.0, -0.5, -1.0]
    assert scores == [1.0 + 2.0, -0.25, 1.0 - 0.5]
    assert extras["log_extra/solution"] == [r["solution"] for r in rows]  # accuracy_reward's log_extra columns
    assert extras["log_extra/answer_parsed"][2] == "[skipped]"


def test_a_factory_given_itself_is_refused_when_the_worker_loads_it(trl_ref):
    with pytest.raises(RuntimeError) as e:
        load_reward_fns(["trl.rewards:get_soft_overlong_punishment"])
    said = str(e.value)
    assert "--reward-fn trl.rewards:get_soft_overlong_punishment: this function takes ['max_completion_len', " in said
    assert "call it in a file of yours" in said


# ----------------------------------------------------------------------------------------------
# Start-up: verl's functions on a prompt-only dataset; validation's rewards/<name>


def test_a_verl_function_on_a_prompt_only_dataset_is_refused_at_start_up(rewards_file):
    fn = worker(rewards_file, "compute_score")
    try:
        with pytest.raises(RewardError) as e:
            trl_rewards.check_data(fn, CHAT_ROWS, "data/train.jsonl")
        verl_rows = [{**r, "data_source": "x", "reward_model": {"ground_truth": "2"}} for r in CHAT_ROWS]
        trl_rewards.check_data(fn, verl_rows, "data/train.parquet")  # verl's rows: nothing to say
    finally:
        fn.close()
    said = str(e.value)
    assert said.startswith(f"--reward-fn {rewards_file}:compute_score: this function has verl's signature")
    assert "and data/train.jsonl is a prompt-only dataset (no data_source and no reward_model column; its " in said
    assert "columns: ['level', 'solution']), so there is no ground_truth to pass: write it TRL's way" in said


def test_the_trainer_refuses_a_verl_function_on_a_prompt_only_dataset_before_anything_loads(rewards_file):
    """startup.reward_fn, which train_grpo.main and a rollout rank call before the engine and the policy load."""
    import types

    import startup

    args = types.SimpleNamespace(reward_fn=f"{rewards_file}:compute_score", reward_weights="", reward_timeout=30.0)
    args.train_data, args.val_data = "data/train.jsonl", "data/test.parquet"
    verl_rows = [{**r, "data_source": "x", "reward_model": {"ground_truth": "2"}} for r in CHAT_ROWS]
    with pytest.raises(SystemExit) as e:
        startup.reward_fn(args, verl_rows, CHAT_ROWS)  # the validation set is the prompt-only one
    assert f"--reward-fn {rewards_file}:compute_score: this function has verl's signature" in str(e.value)
    assert "and data/test.parquet is a prompt-only dataset" in str(e.value)
    startup.reward_fn(args, verl_rows, verl_rows).close()  # verl's rows on both sides: accepted


@pytest.mark.slow
def test_eval_refuses_a_verl_function_on_a_prompt_only_dataset_before_its_engine_loads(rewards_file, tmp_path):
    import json

    import eval as evaluation
    import rollout
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = build_tiny_model(str(tmp_path / "model"), TASK_WORDS)
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "prompt_ids"}) + "\n" for r in CHAT_ROWS))

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine loaded")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "make_engine", no_engine)
        with pytest.raises(SystemExit) as e:
            evaluation.main(["--model", model, "--data", str(data), "--reward-fn", f"{rewards_file}:compute_score"])
    assert f"--reward-fn {rewards_file}:compute_score: this function has verl's signature" in str(e.value)
    assert f"and {data} is a prompt-only dataset" in str(e.value)


def test_validation_logs_each_functions_values_as_val_aux_rewards(rewards_file):
    from engine import Rollout
    from eval import validate

    class Tok:
        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    class Scripted:
        def generate(self, prompts, *, n, **kwargs):
            return Rollout(
                response_ids=[[5, 6, 7], [8], [9, 9], [4, 4, 4, 4]][: len(prompts) * n], truncated=[False] * 4
            )

    fn = worker(rewards_file, "only_hard", "length_score", "never")
    try:
        metrics, _ = validate(Scripted(), TEXT_ROWS, Tok(), fn, {0}, n=2, temperature=1.0, max_new_tokens=4, seed=0)
    finally:
        fn.close()
    assert metrics["val-aux/rewards/length_score/mean"] == 2.5  # lengths 3, 1, 2, 4
    assert math.isclose(metrics["val-aux/rewards/length_score/std"], math.sqrt(5 / 3))  # unbiased, as training's
    assert metrics["val-aux/rewards/only_hard/mean"] == 1.0  # over the hard prompt's 2 samples only
    assert not any("rewards/never" in k for k in metrics)  # applied nowhere: not logged, as in training
    assert metrics["val-core/prompt_only/reward/mean@2"] == (3 + 1 + (1 + 2) + (1 + 4)) / 4


# ----------------------------------------------------------------------------------------------
# What one value, one sum or one function can do to the others


def test_one_huge_value_is_its_samples_error_not_the_batchs(rewards_file):
    fn = worker(rewards_file, "one_huge")
    try:
        with pytest.raises(RewardError) as e:
            score_rows(fn, TEXT_ROWS * 4, TEXTS * 4, response_ids=IDS * 4, where="step 2")
        scores, extras = score_rows(fn, TEXT_ROWS * 4, TEXTS * 4, response_ids=IDS * 4, errors="skip")
    finally:
        fn.close()
    said = str(e.value)
    assert (
        said.startswith("reward function one_huge, step 2, sample 3 of the batch: returned 1000000")
        and "(a int)" in said
    )
    assert "OverflowError" not in said and "answer_batch" not in said  # the function raised nothing: we did
    assert scores == [0.5] * 3 + [0.0] + [0.5] * 4 and extras["reward_error"] == [0.0] * 3 + [1.0] + [0.0] * 4


def test_a_weighted_sum_that_overflows_names_the_functions_and_weights(rewards_file):
    fn = worker(rewards_file, "huge_float", "ok", weights=[10.0, 1.0])
    try:
        with pytest.raises(RewardError) as e:
            score_rows(fn, TEXT_ROWS, TEXTS, response_ids=IDS, where="step 1")
    finally:
        fn.close()
    said = str(e.value)
    assert said.startswith("reward functions huge_float, ok, step 1, sample 0 of the batch: the weighted sum ")
    assert "10 * huge_float (1e+308) + 1 * ok (1e+308) is inf" in said and "--reward-weights" in said


def test_each_function_gets_its_own_lists(rewards_file):
    """TRL builds each function's arguments anew: one that edits them in place changes nothing for the next."""
    for order in (("rewrites", "reads"), ("reads", "rewrites")):
        fn = worker(rewards_file, *order)
        try:
            _, extras = score_rows(fn, TEXT_ROWS, TEXTS, response_ids=[list(ids) for ids in IDS])
        finally:
            fn.close()
        assert extras["rewards/reads"] == [0.0, 0.0], order


def test_a_column_named_as_one_of_trls_arguments_is_refused_at_start_up(rewards_file):
    fn = worker(rewards_file, "accuracy_reward")
    try:
        for column in trl_rewards.PASSED:
            rows = [{**r, column: "the dataset's"} for r in TEXT_ROWS]
            with pytest.raises(RewardError) as e:
                trl_rewards.check_data(fn, rows, "data/train.jsonl")
            assert f"data/train.jsonl has a column named {column!r}, as TRL's own arguments" in str(e.value)
            with pytest.raises(RewardError, match=f"has a column named {column!r}"):  # and at the call, not replaced
                score_rows(fn, rows, TEXTS, response_ids=IDS)
    finally:
        fn.close()
