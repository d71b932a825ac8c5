"""reward.py: dispatch by data_source, custom reward files, several weighted rewards, --reward-errors,
what a reward sees in extra_info, and DAPO's overlong penalty. (The tasks' own scorers: test_tasks.py
and test_math_score.py.)"""

import os
import textwrap

import pytest

from reward import (
    BUILTIN_SOURCES,
    RewardError,
    compute_score,
    load_reward_fn,
    load_reward_fns,
    overlong_penalty,
    read_score,
    reward_names,
    score_responses,
    score_rows,
    weighted_reward,
)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "rewards")

# ----------------------------------------------------------------------------------------------
# dispatch by data_source


def test_compute_score_dispatch():
    assert compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert (
        compute_score("synthetic/multiply", "7 * 8 = 56\n\nIn mathematics, multiplication is repeated addition.", "56")
        == 1.0
    )
    assert compute_score("synthetic/multiply", "7 * 8 = 56, or 7 times 8", "56") == 0.0  # the last number counts
    with pytest.raises(ValueError, match="openai/gsm8k") as err:
        compute_score("my/dataset", "#### 72", "72")
    assert "--reward-fn" in str(err.value)


# ----------------------------------------------------------------------------------------------
# custom reward files


def write(tmp_path, source):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_verl_style_reward_file_works_unchanged(tmp_path):
    path = write(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

        def other(data_source, solution_str, ground_truth, **kwargs):
            return 0.5
        """,
    )
    fn = load_reward_fn(path)  # no ':name' means compute_score, as in verl
    scores, extras = score_responses(fn, ["x", "x"], ["a", "bb"], ["a", "a"], [{"i": 0}, {"i": 1}])
    assert scores == [1.0, 0.0]
    assert extras == {"length": [1, 2]}
    assert score_responses(load_reward_fn(path + ":other"), ["x"], ["a"], ["a"])[0] == [0.5]


def test_extras_stay_aligned_when_some_samples_lack_a_key(tmp_path):
    path = write(
        tmp_path,
        """
        def f(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 1.0, "pred": solution_str} if solution_str != "b" else 0.0
        """,
    )
    _, extras = score_responses(load_reward_fn(path + ":f"), ["x"] * 3, ["a", "b", "c"], ["a"] * 3)
    assert extras == {"pred": ["a", None, "c"]}


def test_a_raising_reward_names_sample_source_and_exception(tmp_path):
    path = write(
        tmp_path,
        """
        def f(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "boom":
                raise KeyError("missing_field")
            return 1.0
        """,
    )
    with pytest.raises(RewardError) as err:
        score_responses(load_reward_fn(path + ":f"), ["ds/a", "ds/b"], ["ok", "boom"], ["1", "2"], indices=[40, 41])
    message = str(err.value)
    assert "sample 41" in message and "ds/b" in message and "KeyError" in message and "missing_field" in message


@pytest.mark.parametrize("returned", ["None", "float('nan')", "'high'", "{'value': 1.0}"])
def test_a_non_score_return_is_an_error(tmp_path, returned):
    path = write(tmp_path, f"def f(data_source, solution_str, ground_truth, extra_info=None):\n    return {returned}\n")
    with pytest.raises(RewardError, match="sample 0"):
        score_responses(load_reward_fn(path + ":f"), ["ds"], ["r"], ["g"])


def test_loading_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_fn(str(tmp_path / "nope.py:f"))
    path = write(tmp_path, "def score_it(**kw):\n    return 1.0\n")
    with pytest.raises(AttributeError, match="score_it"):  # lists the functions that do exist
        load_reward_fn(path + ":compute_score")


def test_builtin_sources_are_exactly_what_compute_score_dispatches():
    # data_prep.load_dataset(path, known_sources=BUILTIN_SOURCES) rejects rows at load time by
    # this set, so it must agree with the dispatch that scores them during training
    for source in BUILTIN_SOURCES:
        score, _ = read_score(compute_score(source, "1", "1"))  # a float, or MATH's {"score", "pred"}
        assert score in (0.0, 1.0)  # scored, not raised
    with pytest.raises(ValueError, match="no built-in reward for data_source 'my/puzzles'.*--reward-fn"):
        compute_score("my/puzzles", "1", "1")


# ----------------------------------------------------------------------------------------------
# several reward functions with weights


def correct(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "pred": solution_str}


def short(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if len(solution_str) <= 2 else 0.0


def test_weighted_reward_sums_and_logs_each_function():
    fn = weighted_reward([correct, short], [1.0, 0.5], ["correct", "short"])
    out = fn(data_source="x", solution_str="7", ground_truth="7", extra_info=None)
    assert out == {"score": 1.5, "correct": 1.0, "correct/pred": "7", "short": 1.0}  # 1 * 1 + 0.5 * 1
    scores, extras = score_responses(fn, ["x"] * 3, ["7", "8", "777"], ["7"] * 3)
    assert scores == [1.5, 0.5, 0.0]
    # the trainer logs each numeric key as reward_extra/<key>/mean: reward_extra/correct/mean, ...
    assert extras == {"correct": [1.0, 0.0, 0.0], "correct/pred": ["7", "8", "777"], "short": [1.0, 1.0, 0.0]}
    assert weighted_reward([correct, short])(data_source="x", solution_str="7", ground_truth="7")["score"] == 2.0


def test_weighted_reward_checks_weights_and_names():
    with pytest.raises(ValueError, match=r"1 reward weights \[1.0\] for 2 reward functions \['correct', 'short'\]"):
        weighted_reward([correct, short], [1.0])
    with pytest.raises(ValueError, match="distinct"):
        weighted_reward([correct, correct])  # both named "correct"
    with pytest.raises(ValueError, match="at least one"):
        weighted_reward([])


def test_weighted_reward_names_the_function_that_failed():
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        return None

    fn = weighted_reward([correct, broken], names=["correct", "broken"])
    with pytest.raises(RewardError, match=r"1 \* correct \+ 1 \* broken, sample 0 .*: broken returned None"):
        score_responses(fn, ["x"], ["7"], ["7"])


def test_a_weighted_sum_that_overflows_names_the_functions_and_weights():
    def huge_float(data_source, solution_str, ground_truth, extra_info=None):
        return 1e308  # finite, and so is each function's score: the sum below is not

    fn = weighted_reward([huge_float, short], [10.0, 1.0], ["f.huge_float", "f.short"])
    with pytest.raises(RewardError) as e:
        score_responses(fn, ["x"], ["7"], ["7"], where="step 1")
    said = str(e.value)
    assert "10 * f.huge_float + 1 * f.short, step 1, sample 0 of the batch (data_source='x'): the weighted sum " in said
    assert "10 * f.huge_float (1e+308) + 1 * f.short (1) is inf" in said and "--reward-weights" in said


def rewrites(data_source, solution_str, ground_truth, extra_info=None):
    extra_info["response_ids"].clear()
    extra_info["split"] = ground_truth["answers"][0] = "rewritten"
    return 0.0


def reads(data_source, solution_str, ground_truth, extra_info=None):
    return float("rewritten" in (extra_info["split"], ground_truth["answers"][0]) or not extra_info["response_ids"])


def test_each_weighted_function_gets_its_own_arguments():
    """One that edits extra_info or ground_truth in place changes nothing for the next, in either order."""
    for order in ((rewrites, reads), (reads, rewrites)):
        fn = weighted_reward(list(order), names=[f.__name__ for f in order])
        row = {"data_source": "x", "reward_model": {"ground_truth": {"answers": ["1"]}}, "extra_info": {"split": "a"}}
        _, extras = score_rows(fn, [row, row], ["1", "2"], response_ids=[[5, 2], [6, 2]], truncated=[False] * 2)
        assert extras["reads"] == [0.0, 0.0], order
        assert row["reward_model"]["ground_truth"] == {"answers": ["1"]} and row["extra_info"] == {"split": "a"}


def test_reward_names_from_specs_are_unique():
    specs = ["a/format.py:f", "b/format.py:f", "length.py", "reward.py:compute_score"]
    assert reward_names(specs) == ["format.f", "format.f_2", "length.compute_score", "reward.compute_score"]


def test_load_reward_fns_one_spec_is_unchanged_several_are_weighted():
    # load_reward_fns runs them in a worker process (test_reward_safety.py); what they return is the same
    bonus = os.path.join(EXAMPLES, "format_bonus.py")
    length = os.path.join(EXAMPLES, "length_aware.py") + ":compute_score"
    info = {"response_length": 3, "truncated": False}
    one = load_reward_fns([bonus])
    assert one.__name__ == "format_bonus.compute_score"  # how error messages name it
    assert score_responses(one, ["x"], [r"\boxed{5}"], ["5"], [info]) == ([1.0], {})
    fn = load_reward_fns([bonus, length], [1.0, 0.5])
    assert fn.__name__ == "1 * format_bonus.compute_score + 0.5 * length_aware.compute_score"
    scores, extras = score_responses(fn, ["x"], [r"\boxed{5}"], ["5"], [info])
    assert scores == [1.5] and extras == {"format_bonus.compute_score": [1.0], "length_aware.compute_score": [1.0]}
    with pytest.raises(RuntimeError, match="give one weight per --reward-fn"):  # the worker's error, passed on
        load_reward_fns([bonus, length], [1.0])


# ----------------------------------------------------------------------------------------------
# the example reward files (examples/rewards/)


def test_example_format_bonus():
    fn = load_reward_fn(os.path.join(EXAMPLES, "format_bonus.py"))
    assert fn("x", r"so \boxed{\frac{1}{\sqrt{2}}}.", "1") == 1.0
    assert fn("x", r"\boxed{}", "1") == 0.0
    assert fn("x", r"\boxed{1} and \boxed{2", "1") == 0.0  # cut off in its last box
    assert fn("x", "the answer is 1", "1") == 0.0


def test_example_length_aware_reads_length_and_truncation():
    fn = load_reward_fn(os.path.join(EXAMPLES, "length_aware.py"))
    score = lambda n, cut=False: fn("x", "...", "1", {"response_length": n, "truncated": cut})  # noqa: E731
    assert [score(100), score(256), score(384), score(512), score(900)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert score(100, cut=True) == 0.0
    with pytest.raises(KeyError, match="response_length"):
        fn("x", "...", "1", {"split": "train"})


# ----------------------------------------------------------------------------------------------
# --reward-errors


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise KeyError("missing_field")
    if solution_str == "nan":
        return float("nan")
    if solution_str == "nodict":
        return {"value": 1.0}
    return {"score": 1.0, "acc": 1.0}


def test_reward_errors_skip_scores_zero_marks_and_reports_once(capsys):
    responses = ["ok", "boom", "nan", "nodict", "ok"]
    scores, extras = score_responses(
        flaky, ["ds/a"] * 4 + ["ds/b"], responses, ["1"] * 5, indices=range(10, 15), errors="skip"
    )
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert extras["reward_error"] == [0.0, 1.0, 1.0, 1.0, 0.0]  # mean: the error fraction; sum: the count
    assert extras["acc"] == [1.0, None, None, None, 1.0]  # a skipped sample reports no extra keys
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # one line per batch, not one per sample
    assert "3 of 5 samples scored 0" in err[0] and "sample 11 (data_source='ds/a')" in err[0]
    assert "KeyError" in err[0] and "missing_field" in err[0]


def test_reward_errors_raise_is_the_default_and_skip_without_errors_is_quiet(capsys):
    with pytest.raises(RewardError, match="sample 1"):
        score_responses(flaky, ["ds"] * 2, ["ok", "boom"], ["1"] * 2)
    scores, extras = score_responses(flaky, ["ds"] * 2, ["ok", "ok"], ["1"] * 2, errors="skip")
    assert scores == [1.0, 1.0] and extras["reward_error"] == [0.0, 0.0]
    assert capsys.readouterr().err == ""
    assert "reward_error" not in score_responses(flaky, ["ds"], ["ok"], ["1"])[1]  # raise: no such column
    with pytest.raises(ValueError, match="'raise' or 'skip'"):
        score_responses(flaky, ["ds"], ["ok"], ["1"], errors="ignore")


# ----------------------------------------------------------------------------------------------
# what a reward sees in extra_info


def seen(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.0, "info": extra_info}


@pytest.mark.filterwarnings("ignore:reward function seen returns dict values")  # the extra here is a dict on purpose
def test_score_rows_adds_response_fields_to_a_copy_of_extra_info():
    row = {"data_source": "x", "reward_model": {"ground_truth": "1"}, "extra_info": {"split": "train", "index": 3}}
    bare = {"data_source": "x", "reward_model": {"ground_truth": "1"}}  # no extra_info at all
    rows = [row, row, bare]  # a prompt's samples share one row dict, as in the trainer
    ids = [[5, 6, 2], [7], []]
    _, extras = score_rows(seen, rows, ["a", "b", "c"], response_ids=ids, truncated=[False, True, False])
    infos = extras["info"]
    assert infos[0] == {
        "split": "train",
        "index": 3,
        "response_ids": [5, 6, 2],
        "response_length": 3,
        "truncated": False,
    }
    assert infos[1] == {"split": "train", "index": 3, "response_ids": [7], "response_length": 1, "truncated": True}
    assert infos[2] == {"response_ids": [], "response_length": 0, "truncated": False}
    assert row["extra_info"] == {"split": "train", "index": 3} and "extra_info" not in bare  # rows unchanged
    # without them, the reward gets the row's own extra_info, as before
    _, extras = score_rows(seen, [row, bare], ["a", "b"])
    assert extras["info"][0] is row["extra_info"] and extras["info"][1] is None


# ----------------------------------------------------------------------------------------------
# DAPO's overlong penalty


def test_overlong_penalty_hand_values():
    # max 20 tokens, the last 4 are the buffer: no penalty up to 16, then -1/4 per token
    lengths = [10, 16, 17, 18, 20, 22]
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.5]  # 22 > max: verl does not bound it below
    assert overlong_penalty(lengths, 20, 4, 1.0) == pytest.approx(expected)
    assert overlong_penalty([18], 20, 4, 0.5) == pytest.approx([-0.25])  # (18 - 16) / 4 * 0.5
    assert overlong_penalty([4096], 4096, 4096, 1.0) == pytest.approx([-1.0])  # buffer = whole budget
    assert all(p <= 0 for p in overlong_penalty(range(30), 20, 4, 1.0))


@pytest.mark.parametrize("buffer_len", [0, 21])
def test_overlong_penalty_bad_buffer(buffer_len):
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty([10], 20, buffer_len, 1.0)


# ----------------------------------------------------------------------------------------------
# the documented commands (docs/rewards.md, examples/rewards/), run as written, end to end

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = open(os.path.join(REPO, "docs", "rewards.md")).read()
TINY = "--rollout hf --max-steps 1 --prompt-batch-size 16 --mini-batch-size 16 --group-size 4 --val-max-prompts 8"


@pytest.mark.slow
def test_the_documented_reward_commands_run_as_written_with_validation(tmp_path):
    """Each weighted command of docs/rewards.md (the one in its example file's docstring) trains the demo and
    validates it at step 0 and after the step, as the demo does; eval.py takes the same flags; the reward-model
    commands run on the demo's model. At a tiny size: 1 step of 16 prompts, 8 validation prompts, the transformers
    engine. Validation once stopped length_aware.py's command at step 0: it saw no response_length."""
    import subprocess
    import sys

    from conftest import metrics, run_script

    commands = [line for line in DOCS.splitlines() if line.startswith("--reward-fn reward.py:compute_score ")]
    assert len(commands) == 2
    for command in commands:
        example = command.split()[3]  # examples/rewards/<name>.py
        assert command in open(os.path.join(REPO, example)).read()  # the docstring's command is the docs' one
        out = tmp_path / os.path.basename(example)
        run_script("--out-dir", str(out), *TINY.split(), *command.split())
        rows = metrics(out)
        assert [r["step"] for r in rows] == [0, 1] and all("val-core/synthetic/digits/reward/mean@1" in r for r in rows)
        name = os.path.splitext(os.path.basename(example))[0]
        assert {"reward_extra/reward.compute_score/mean", f"reward_extra/{name}.compute_score/mean"} <= set(rows[1])
    run = tmp_path / "length_aware.py"
    flags = ["--model", str(run / "final_model"), "--data", str(run / "data" / "test.parquet"), *commands[1].split()]
    flags += ["--max-prompts", "8", "--max-new-tokens", "4", "--rollout", "hf", "--out", str(tmp_path / "eval.json")]
    proc = subprocess.run([sys.executable, "eval.py", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "val-core/synthetic/digits/reward/mean@1" in proc.stdout, proc.stderr[-3000:]

    make = "python models.py random --like runs/grpo/tiny_model --out models/tiny-rm --reward-model"
    train = "torchrun --nproc_per_node=1 train_grpo.py --reward-model models/tiny-rm --reward-model-weight 0.1"
    assert make in DOCS and train in DOCS
    rm = str(tmp_path / "tiny-rm")
    make = make.replace("runs/grpo/tiny_model", str(run / "tiny_model")).replace("models/tiny-rm", rm)
    proc = subprocess.run([sys.executable, *make.split()[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_script("--out-dir", str(tmp_path / "rm_run"), *TINY.split(), *train.replace("models/tiny-rm", rm).split()[3:])
    rows = metrics(tmp_path / "rm_run")
    assert "reward_extra/reward_model/mean" in rows[1] and "val-core/synthetic/digits/reward/mean@1" in rows[1]
