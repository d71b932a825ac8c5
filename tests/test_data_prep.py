"""data_prep.py: the loader that names the file, row and field at fault, and prompts through the
tokenizer. (Each task's rows, and the CLI that writes them: test_tasks.py.)"""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep
from data_prep import DataError, load_dataset
from tasks.digits import TASK_WORDS, write_digits

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
# Prompts through the tokenizer: its chat template, and words it does not know


def test_a_tokenizer_without_a_chat_template_is_named_before_the_data_is_read(tmp_path):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), TASK_WORDS)
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

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
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
    task_words = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "t"), TASK_WORDS))
    capsys.readouterr()
    data_prep.load_prompts(test, task_words)
    assert "unknown token" not in capsys.readouterr().out
