"""tasks/: each task's rows in verl's schema (what `python data_prep.py TASK` writes) and its scorer:
GSM8K's answer extraction as real model outputs write it, MATH's rows and their ground truths, and
the synthetic digits and multiply tasks. (MATH's scorer has its own file, test_math_score.py.)"""

import json
import os

import pytest

import data_prep
from data_prep import load_dataset
from reward import compute_score
from tasks.digits import digits_rows, write_digits
from tasks.gsm8k import extract_gsm8k_answer, gsm8k_rows, gsm8k_score
from tasks.math import math_rows
from tasks.multiply import write_multiply

SHARED_GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")

# ----------------------------------------------------------------------------------------------
# GSM8K: the rows


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


def test_gsm8k_row_is_verls_schema(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", [{"question": "How many?", "answer": "2 + 2 = 4\n#### 1,004"}])
    (row,) = gsm8k_rows(src, "train")
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "user", "content": 'How many? Let\'s think step by step and output the final answer after "####".'}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1004"},
        "extra_info": {"split": "train", "index": 0, "answer": "2 + 2 = 4\n#### 1,004", "question": "How many?"},
    }


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "line 2: not valid JSON"),
        (json.dumps({"question": "q"}), "line 2: field 'answer'"),
        (json.dumps({"question": "q", "answer": "no final line"}), "line 2: field 'answer' has no final"),
    ],
)
def test_gsm8k_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        gsm8k_rows(str(path), "test")
    assert str(path) in str(err.value)


@pytest.mark.skipif(not os.path.isdir(SHARED_GSM8K), reason="the real GSM8K is not beside the repo")
def test_real_gsm8k_converts_cleanly(tmp_path):
    data_prep.main(["gsm8k", "--input", SHARED_GSM8K, "--out", str(tmp_path)])
    for split, n_rows in (("train", 7473), ("test", 1319)):
        rows = load_dataset(str(tmp_path / f"{split}.parquet"))
        assert len(rows) == n_rows
        assert [r["extra_info"]["index"] for r in rows] == list(range(n_rows))
        # every reference solution earns full reward against its own ground truth
        assert all(
            compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) == 1.0
            for r in rows
        )


def test_gsm8k_cli_names_a_missing_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        data_prep.main(["gsm8k", "--input", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "train.jsonl not found" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# GSM8K: the scorer


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


# ----------------------------------------------------------------------------------------------
# MATH: the rows (the scorer: test_math_score.py)

MATH_EXAMPLES = [
    {
        "problem": "What is $1 \\div 2$?",
        "solution": "Dividing, $1 \\div 2 = \\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Solve $x^2 = 4$.",
        "solution": "So $x = \\boxed{\\pm 2}$.",
        "level": 2,
    },  # MATH-500 writes levels as ints
    {"problem": "Which set?", "solution": "First $\\boxed{1}$, then finally $\\boxed{\\{1,2\\}}$"},
    {"problem": "How many?", "solution": "There are $\\boxed 5$ of them."},
]


def test_math_rows_are_verls_schema_with_the_last_boxed_answer(tmp_path):
    src = write_jsonl(tmp_path / "test.jsonl", MATH_EXAMPLES)
    rows = math_rows(src, "test")
    assert rows[0] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [
            {
                "role": "user",
                "content": "What is $1 \\div 2$? Let's think step by step and output the final answer within \\boxed{}.",
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},  # nested braces kept whole
        "extra_info": {
            "split": "test",
            "index": 0,
            "level": "Level 1",
            "type": "Prealgebra",
            "problem": MATH_EXAMPLES[0]["problem"],
            "solution": MATH_EXAMPLES[0]["solution"],
        },
    }
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "\\pm 2", "\\{1,2\\}", "5"]
    assert [r["extra_info"]["level"] for r in rows] == ["Level 1", "2", None, None]
    # every reference solution earns full reward against its own ground truth
    for row in rows:
        assert (
            compute_score(row["data_source"], row["extra_info"]["solution"], row["reward_model"]["ground_truth"])[
                "score"
            ]
            == 1.0
        )


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "line 3: not valid JSON"),
        (json.dumps(["a list"]), "line 3: expected a JSON object"),
        (json.dumps({"problem": "q"}), "line 3: field 'solution' missing"),
        (json.dumps({"problem": "q", "solution": "The answer is 4."}), "line 3: field 'solution' has no final answer"),
        (json.dumps({"problem": "q", "solution": "$\\boxed{}$"}), "line 3: field 'solution' has no final answer"),
        (json.dumps({"problem": "q", "solution": "$\\boxed{4$"}), "line 3: field 'solution' has no final answer"),
    ],
)
def test_math_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    good = json.dumps(MATH_EXAMPLES[0])
    path.write_text(good + "\n\n" + line + "\n")  # the blank line 2 is skipped, and still counted
    with pytest.raises(ValueError, match=message) as err:
        math_rows(str(path), "train")
    assert str(path) in str(err.value)


def test_math_cli_takes_a_file_or_a_directory(tmp_path, capsys):
    data_dir = tmp_path / "MATH"
    data_dir.mkdir()
    write_jsonl(data_dir / "train.jsonl", MATH_EXAMPLES[:3])
    write_jsonl(data_dir / "test.jsonl", MATH_EXAMPLES[3:])
    data_prep.main(["math", "--input", str(data_dir), "--out", str(tmp_path / "out")])
    train, test = (
        load_dataset(str(tmp_path / "out" / "train.parquet")),
        load_dataset(str(tmp_path / "out" / "test.parquet")),
    )
    assert (len(train), len(test)) == (3, 1) and test[0]["extra_info"]["split"] == "test"
    # one file: its name is the split; --data-source names the rows in validation metrics
    one = write_jsonl(tmp_path / "math500.jsonl", MATH_EXAMPLES)
    data_prep.main(["math", "--input", one, "--out", str(tmp_path / "m500"), "--data-source", "HuggingFaceH4/MATH-500"])
    (row, *_) = load_dataset(str(tmp_path / "m500" / "math500.parquet"))
    assert row["data_source"] == "HuggingFaceH4/MATH-500" and row["extra_info"]["split"] == "math500"
    with pytest.raises(SystemExit):
        data_prep.main(["math", "--input", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert "train.jsonl and/or test.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the command line's refusals, before anything is written


@pytest.mark.parametrize(
    "flags, message",
    [
        (["digits", "--train-size", "0"], "argument --train-size: expected a whole number >= 1, got 0"),
        (["digits", "--train-size", "-5"], "argument --train-size: expected a whole number >= 1, got -5"),
        (["digits", "--test-size", "-1"], "argument --test-size: expected a whole number >= 0, got -1"),
        (["digits", "--train-size", "ten"], "argument --train-size: expected a whole number >= 1, got ten"),
        (["multiply", "--digits", "3x2", "--train-size", "0"], "argument --train-size: expected a whole number >= 1"),
    ],
)
def test_a_size_that_writes_no_training_data_or_is_negative_is_refused_by_its_flag(tmp_path, capsys, flags, message):
    # --train-size 0 wrote an empty train.parquet, which the trainer then read as "missing column(s)"
    with pytest.raises(SystemExit):
        data_prep.main([*flags, "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_refused_in_one_line_naming_it(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    for out in (taken, taken / "data"):  # a file at --out, or on the way to it: was a FileExistsError's traceback
        with pytest.raises(SystemExit):
            data_prep.main(["digits", "--out", str(out), "--train-size", "4", "--test-size", "2"])
        err = capsys.readouterr().err
        said = f"error: --out {out}: {taken} is a file, not a directory; give a directory to write the parquet files to"
        assert err.splitlines()[-1].endswith(said) and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# the synthetic digits task


def test_digits_task_is_deterministic_disjoint_and_varied(tmp_path):
    data_prep.main(
        ["digits", "--out", str(tmp_path / "a"), "--seed", "3", "--train-size", "3000", "--test-size", "300"]
    )
    write_digits(str(tmp_path / "b"), seed=3, train_size=3000, test_size=300)
    train, test = (
        load_dataset(str(tmp_path / "a" / "train.parquet")),
        load_dataset(str(tmp_path / "a" / "test.parquet")),
    )
    assert train == load_dataset(str(tmp_path / "b" / "train.parquet"))  # the same seed, the same rows
    assert (len(train), len(test)) == (3000, 300)
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(prompts(train)) == 3000 and not prompts(train) & prompts(test)  # held-out means unseen
    answers = [r["reward_model"]["ground_truth"] for r in train]
    assert len(set(answers)) == 10 and max(answers.count(a) for a in set(answers)) / len(answers) < 0.2
    for row in train[:50]:  # the answer is the digit the prompt asks for
        words = row["prompt"][0]["content"].split()
        assert row["reward_model"]["ground_truth"] == (words[1] if words[-1] == "first" else words[-2])
        assert (
            compute_score(row["data_source"], row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"])
            == 1.0
        )
    other = digits_rows("test", 300, seed=4)
    assert prompts(other) != prompts(test)


def test_digits_score_is_exact():
    assert compute_score("synthetic/digits", "7", "7") == 1.0
    assert compute_score("synthetic/digits", " 7 ", "7") == 1.0
    assert compute_score("synthetic/digits", "7 <pad>", "7") == 0.0  # junk after the answer
    assert compute_score("synthetic/digits", "7 7 7", "7") == 0.0  # never stopped
    assert compute_score("synthetic/digits", "3", "7") == 0.0
    assert compute_score("synthetic/digits", "", "7") == 0.0


# ----------------------------------------------------------------------------------------------
# the times-table task


def test_multiply_task_holds_out_factor_pairs_in_both_orders_and_scores_the_last_number(tmp_path):
    data_prep.main(["multiply", "--out", str(tmp_path / "m"), "--seed", "0"])
    train, test = (
        load_dataset(str(tmp_path / "m" / "train.parquet")),
        load_dataset(str(tmp_path / "m" / "test.parquet")),
    )
    questions = lambda rows: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]  # noqa: E731
    factor_pairs = lambda rows: {(min(q), max(q)) for q in questions(rows)}  # noqa: E731
    assert len(set(questions(train))) == len(train) and len(set(questions(test))) == len(test)
    assert len(train) + len(test) == 121  # every a * b for a, b in 2..12
    assert len(factor_pairs(test)) == 25 and not factor_pairs(train) & factor_pairs(test)
    assert all((b, a) in questions(test) for a, b in questions(test))  # both orders held out
    row = test[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} * {b}?"}] and row["reward_model"][
        "ground_truth"
    ] == str(a * b)
    assert compute_score(row["data_source"], f"{a} * {b} = {a * b}.", row["reward_model"]["ground_truth"]) == 1.0
    assert (
        compute_score(
            row["data_source"], f"To calculate {a} * {b}, multiply {a} by {b}.", row["reward_model"]["ground_truth"]
        )
        == 0.0
    )
    with pytest.raises(ValueError, match="test_pairs must be between 1 and 65"):
        write_multiply(str(tmp_path / "x"), test_pairs=66)


def test_products_3x2_hold_out_their_pairs_and_score_the_product(tmp_path):
    """The calculator's task: a 3-digit times a 2-digit number, neither a multiple of 10, distinct
    pairs, none in both splits, the same for the same seed; the CLI writes it."""
    data_prep.main(
        ["multiply", "--digits", "3x2", "--train-size", "300", "--test-size", "50", "--out", str(tmp_path / "a")]
    )
    data_prep.main(
        ["multiply", "--digits", "3x2", "--train-size", "300", "--test-size", "50", "--out", str(tmp_path / "b")]
    )
    train, test = (load_dataset(str(tmp_path / "a" / f"{s}.parquet")) for s in ("train", "test"))
    pairs = {
        s: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]
        for s, rows in (("train", train), ("test", test))
    }
    assert (
        len(set(pairs["train"])) == 300
        and len(set(pairs["test"])) == 50
        and not set(pairs["train"]) & set(pairs["test"])
    )
    assert all(100 <= a <= 999 and 10 <= b <= 99 and a % 10 and b % 10 for a, b in pairs["train"] + pairs["test"])
    row = test[0]
    a, b = pairs["test"][0]
    assert row["prompt"][-1]["content"] == f"What is {a} * {b}?" and row["reward_model"]["ground_truth"] == str(a * b)
    assert compute_score(row["data_source"], f"{a} * {b} = {a * b}", str(a * b)) == 1.0
    assert load_dataset(str(tmp_path / "b" / "test.parquet")) == test  # seeded
    data_prep.main(["multiply", "--digits", "3x2", "--shots", "2", "--test-size", "5", "--out", str(tmp_path / "s")])
    shot = load_dataset(str(tmp_path / "s" / "test.parquet"))[0]["prompt"]  # two worked calculator calls first
    assert [m["role"] for m in shot] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert '"name": "calculator"' in shot[1]["content"] and shot[2]["content"] == str(806 * 17)
    with pytest.raises(ValueError, match="add up to at most"):
        data_prep.main(["multiply", "--digits", "3x2", "--train-size", "70000", "--out", str(tmp_path / "c")])
