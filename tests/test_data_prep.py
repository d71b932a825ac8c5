"""data_prep.py: GSM8K and MATH in verl's schema, and a loader that names the file, row and field at fault."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep
from data_prep import DataError, load_dataset
from reward import compute_score

SHARED_GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")

# ----------------------------------------------------------------------------------------------
# GSM8K


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


def test_gsm8k_row_is_verls_schema(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", [{"question": "How many?", "answer": "2 + 2 = 4\n#### 1,004"}])
    (row,) = data_prep.gsm8k_rows(src, "train")
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
        data_prep.gsm8k_rows(str(path), "test")
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
# MATH

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
    rows = data_prep.math_rows(src, "test")
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
        data_prep.math_rows(str(path), "train")
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
# the loader

GOOD = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "1 + 1?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"split": "test", "index": 0},
}


def write_rows(tmp_path, rows, name="data.parquet"):
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_loader_reads_good_rows(tmp_path):
    assert load_dataset(write_rows(tmp_path, [GOOD, GOOD])) == [GOOD, GOOD]


def test_loader_reads_a_file_written_the_way_verl_writes_it(tmp_path):
    # verl's scripts go through HF `datasets`: struct fields in another order, the raw
    # columns kept beside the new ones, and datasets' own schema metadata.
    schema = pa.schema(
        [
            ("question", pa.string()),
            ("answer", pa.string()),
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
                ),
            ),
        ],
        metadata={b"huggingface": b'{"info": {"features": {}}}'},
    )
    row = dict(
        GOOD,
        question="1 + 1?",
        answer="#### 2",
        extra_info={"answer": "#### 2", "index": 0, "question": "1 + 1?", "split": "test"},
    )
    path = str(tmp_path / "verl.parquet")
    pq.write_table(pa.Table.from_pylist([row], schema=schema), path)
    (loaded,) = load_dataset(path)
    assert loaded["prompt"] == [{"content": "1 + 1?", "role": "user"}]
    assert loaded["reward_model"]["ground_truth"] == "2"
    assert loaded["question"] == "1 + 1?"  # extra columns are kept


def test_loader_missing_file_and_not_parquet(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        load_dataset(str(tmp_path / "missing.parquet"))
    junk = tmp_path / "junk.parquet"
    junk.write_text("this is not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_dataset(str(junk))


def test_loader_missing_column_and_empty_file(tmp_path):
    no_reward = {k: v for k, v in GOOD.items() if k != "reward_model"}
    with pytest.raises(DataError, match=r"missing column\(s\) \['reward_model'\]"):
        load_dataset(write_rows(tmp_path, [no_reward]))
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([GOOD]).slice(0, 0), empty)
    with pytest.raises(DataError, match="has no rows"):
        load_dataset(empty)


def test_loader_names_row_and_field_of_each_bad_row(tmp_path):
    rows = [
        GOOD,
        dict(GOOD, prompt=[]),
        dict(GOOD, reward_model={"style": "rule", "ground_truth": None}),
        dict(GOOD, prompt=[{"role": "user", "content": None}]),
        dict(GOOD, data_source=""),
    ]
    path = write_rows(tmp_path, rows)
    with pytest.raises(DataError) as err:
        load_dataset(path)
    message = str(err.value)
    assert path in message and "4 of 5 rows are invalid" in message
    for expected in (
        "row 1, field prompt",
        "row 2, field reward_model.ground_truth",
        "row 3, field prompt[0]",
        "row 4, field data_source",
    ):
        assert expected in message


def test_loader_can_skip_bad_rows_with_a_count(tmp_path, capsys):
    path = write_rows(tmp_path, [GOOD, dict(GOOD, prompt=[]), GOOD])
    assert load_dataset(path, skip_invalid=True) == [GOOD, GOOD]
    assert "1 of 3 rows are invalid" in capsys.readouterr().out
    with pytest.raises(DataError, match="no valid rows"):
        load_dataset(write_rows(tmp_path, [dict(GOOD, prompt=[])], "bad.parquet"), skip_invalid=True)


def test_loader_reads_a_directory_of_shards_in_name_order(tmp_path):
    # how verl and HF datasets store a large split; written out of order to show the sort
    second = [dict(GOOD, extra_info={"split": "train", "index": i}) for i in (2, 3)]
    write_rows(tmp_path, second, "train-00001-of-00002.parquet")
    first = [dict(GOOD, extra_info={"split": "train", "index": i}) for i in (0, 1)]
    write_rows(tmp_path, first, "train-00000-of-00002.parquet")
    (tmp_path / "README.md").write_text("not a shard")
    assert load_dataset(str(tmp_path)) == first + second


def test_loader_names_the_shard_and_row_of_a_bad_row(tmp_path):
    write_rows(tmp_path, [GOOD, GOOD], "part-0.parquet")
    shard = write_rows(tmp_path, [GOOD, GOOD, dict(GOOD, prompt=[])], "part-1.parquet")
    with pytest.raises(DataError) as err:
        load_dataset(str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"{tmp_path}: 1 of 5 rows are invalid") and f"{shard}, row 2, field prompt" in message
    write_rows(tmp_path, [{"data_source": "x"}], "part-2.parquet")  # a shard without verl's columns is named too
    with pytest.raises(DataError, match=r"part-2.parquet: missing column\(s\)"):
        load_dataset(str(tmp_path))


def test_loader_directory_without_parquet_or_with_several_splits(tmp_path):
    with pytest.raises(DataError, match=r"a directory with no \*.parquet files"):
        load_dataset(str(tmp_path))
    # verl's layout: reading both files as one dataset would train on the test set
    write_rows(tmp_path, [GOOD], "train.parquet")
    write_rows(tmp_path, [GOOD], "test.parquet")
    with pytest.raises(DataError, match=r"several splits \['test', 'train'\]"):
        load_dataset(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# the synthetic digits task


def test_digits_task_is_deterministic_disjoint_and_varied(tmp_path):
    data_prep.main(
        ["digits", "--out", str(tmp_path / "a"), "--seed", "3", "--train-size", "3000", "--test-size", "300"]
    )
    data_prep.write_task(str(tmp_path / "b"), seed=3, train_size=3000, test_size=300)
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
    other = data_prep.task_rows("test", 300, seed=4)
    assert prompts(other) != prompts(test)


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
        data_prep.write_multiply(str(tmp_path / "x"), test_pairs=66)


# ----------------------------------------------------------------------------------------------
# Prompts through the tokenizer: its chat template, and words it does not know


def test_a_tokenizer_without_a_chat_template_is_named_before_the_data_is_read(tmp_path):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), data_prep.TASK_WORDS)
    os.remove(os.path.join(model, "chat_template.jinja"))  # where transformers 5 keeps it
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert not tokenizer.chat_template
    with pytest.raises(DataError) as err:
        data_prep.load_prompts(str(tmp_path / "not_read.parquet"), tokenizer)  # the template is checked first
    message = str(err.value)
    assert f"model directory {model!r}: the tokenizer has no chat_template" in message
    assert (
        "chat (instruct) model" in message and "chat_template.jinja" in message and "tokenizer_config.json" in message
    )


def test_prompts_with_words_the_tokenizer_lacks_are_counted_and_the_first_shown(tmp_path, capsys):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    data_prep.write_task(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
    test = str(tmp_path / "data" / "test.parquet")
    digits_only = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "d"), [str(d) for d in range(10)]))
    capsys.readouterr()
    rows, _ = data_prep.load_prompts(test, digits_only)
    out = capsys.readouterr().out
    first = rows[0]["prompt"][0]["content"]  # "list 2 9 1 4 1 7 last": list and first/last are unknown
    words = sorted({"list", first.split()[-1]})
    assert f"warning: {test}: 5 of 5 prompts contain the tokenizer's unknown token '<unk>'" in out
    assert f"the first is row 0, which has {words} as <unk>: {first!r}" in out
    assert all(digits_only.unk_token_id in r["prompt_ids"] for r in rows)  # reported, not dropped
    task_words = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "t"), data_prep.TASK_WORDS))
    capsys.readouterr()
    data_prep.load_prompts(test, task_words)
    assert "unknown token" not in capsys.readouterr().out
