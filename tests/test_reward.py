"""reward.py: answer extraction as real model outputs write it, dispatch, custom reward files, and
DAPO's overlong penalty."""

import textwrap

import pytest

from reward import (
    BUILTIN_SOURCES,
    RewardError,
    compute_score,
    extract_gsm8k_answer,
    gsm8k_score,
    load_reward_fn,
    overlong_penalty,
    score_responses,
)

# ----------------------------------------------------------------------------------------------
# GSM8K


@pytest.mark.parametrize(
    "response,truth",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### $18", "18"),
        ("#### 18.00", "18"),
        ("So the answer is\n#### 18.", "18"),  # the full stop ends the sentence, not the number
        ("#### 3,000", "3000"),
        ("####3000", "3000"),
        ("#### -5", "-5"),
        ("#### 0.5", "0.50"),
        ("#### 1,234,567.5", "1234567.5"),
    ],
)
def test_strict_accepts_the_ways_models_write_numbers(response, truth):
    assert gsm8k_score(response, truth) == 1.0


def test_strict_takes_the_last_marker_and_needs_one():
    assert extract_gsm8k_answer("#### 5 wait, no: #### 7") == "7"
    assert gsm8k_score("#### 5 wait, no: #### 7", "7") == 1.0
    assert gsm8k_score("The answer is 18.", "18") == 0.0  # no "####": no answer in strict mode
    assert extract_gsm8k_answer("#### eighteen") is None


def test_flexible_takes_the_last_number():
    assert extract_gsm8k_answer("first 12, then 3,000 apples, so $18.", "flexible") == "$18"
    assert gsm8k_score("first 12, then 3,000 apples, so $18.", "18", method="flexible") == 1.0
    assert extract_gsm8k_answer("the digits 1,2,3", "flexible") == "3"  # not 123
    assert gsm8k_score("no numbers here", "18", method="flexible") == 0.0


def test_scores_for_right_wrong_and_missing_answers():
    assert gsm8k_score("#### 17", "18", format_score=0.1) == 0.1  # answered, wrong: the format score
    assert gsm8k_score("#### 18", "18", format_score=0.1, score=2.0) == 2.0
    assert gsm8k_score("nothing", "18", format_score=0.1) == 0.0  # no answer at all: 0
    assert gsm8k_score("#### 180", "18") == 0.0
    with pytest.raises(ValueError, match="flexible"):
        gsm8k_score("#### 18", "18", method="loose")


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


def test_digits_score_is_exact():
    assert compute_score("synthetic/digits", "7", "7") == 1.0
    assert compute_score("synthetic/digits", " 7 ", "7") == 1.0
    assert compute_score("synthetic/digits", "7 <pad>", "7") == 0.0  # junk after the answer
    assert compute_score("synthetic/digits", "7 7 7", "7") == 0.0  # never stopped
    assert compute_score("synthetic/digits", "3", "7") == 0.0
    assert compute_score("synthetic/digits", "", "7") == 0.0


def test_builtin_sources_are_exactly_what_compute_score_dispatches():
    # data_prep.load_dataset(path, known_sources=BUILTIN_SOURCES) rejects rows at load time by
    # this set, so it must agree with the dispatch that scores them during training
    for source in BUILTIN_SOURCES:
        assert compute_score(source, "1", "1") in (0.0, 1.0)  # scored, not raised
    with pytest.raises(ValueError, match="no built-in reward for data_source 'my/puzzles'.*--reward-fn"):
        compute_score("my/puzzles", "1", "1")


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
