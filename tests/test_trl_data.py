"""prompt_data.py through data_prep.load_prompts: TRL's prompt-only datasets (text or chat-message prompts)
stored as jsonl, parquet or a `datasets` save_to_disk directory (written here with pyarrow, as `datasets`
writes it), every bad row named, and verl's files still told apart by their columns."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep
from prompt_data import DataError, load_prompt_only, read_rows
from tasks.digits import TASK_WORDS

TEXT = [{"prompt": "list 1 2 first", "solution": "1"}, {"prompt": "list 3 4 last", "solution": "4"}]
CHAT = [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["solution"]} for r in TEXT]


def write(tmp_path, rows, storage):
    """`rows` stored as TRL users store them: jsonl, parquet, or a save_to_disk directory (Arrow IPC stream files
    with dataset_info.json and state.json)."""
    if storage == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif storage == "parquet":
        path = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "saved"
        path.mkdir()
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
        (path / "dataset_info.json").write_text("{}")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path_factory.mktemp("tiny")), TASK_WORDS))


@pytest.mark.parametrize("storage", ["jsonl", "parquet", "arrow"])
def test_text_and_chat_prompt_only_datasets_in_each_storage(tmp_path, tokenizer, storage):
    for kind, rows in (("text", TEXT), ("chat", CHAT)):
        os.makedirs(tmp_path / kind)
        path = write(tmp_path / kind, rows, storage)
        loaded, dropped = data_prep.load_prompts(path, tokenizer, known_sources=None, max_prompt_length=100)
        assert dropped == 0 and [r["solution"] for r in loaded] == ["1", "4"]  # the columns, for the rewards
        assert loaded[0]["prompt"] == rows[0]["prompt"]
        if kind == "text":  # as it stands, as TRL tokenizes it: no chat template
            assert loaded[0]["prompt_ids"] == tokenizer("list 1 2 first")["input_ids"]
        else:
            expected = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, return_dict=False)
            assert loaded[0]["prompt_ids"] == expected


def test_without_reward_functions_a_prompt_only_dataset_is_refused(tmp_path, tokenizer):
    path = write(tmp_path, CHAT, "jsonl")
    with pytest.raises(DataError, match="a prompt-only dataset .* no built-in reward can score it; pass your reward"):
        data_prep.load_prompts(path, tokenizer, known_sources={"openai/gsm8k"})


@pytest.mark.parametrize("storage", ["jsonl", "parquet", "arrow"])
def test_every_bad_row_is_named_with_its_field_and_what_was_expected(tmp_path, storage):
    rows = [CHAT[0], {"prompt": [{"role": "user", "content": None}], "solution": "2"}, {"prompt": [], "solution": "3"}]
    if storage == "jsonl":  # a typed column (parquet, Arrow) cannot hold these
        rows += [{"prompt": "text among chat prompts", "solution": "1"}, {"solution": "4"}]
    path = write(tmp_path, rows, storage)
    with pytest.raises(DataError) as e:
        load_prompt_only(path)
    message = str(e.value)
    assert f"{path}: {len(rows) - 1} of {len(rows)} rows of this prompt-only dataset are invalid" in message
    assert "row 1, field prompt: message 0: expected {'role': str, 'content': str}" in message
    assert "row 2, field prompt: expected a non-empty list of chat messages, as row 0's prompt is" in message
    if storage == "jsonl":
        assert "row 3, field prompt: expected a non-empty list of chat messages" in message
        assert "row 4, field prompt: missing" in message


def test_a_text_dataset_wants_text_in_every_row(tmp_path):
    path = write(tmp_path, [TEXT[0], {"prompt": ["x"], "solution": "1"}, {"prompt": "", "solution": "2"}], "jsonl")
    with pytest.raises(DataError, match="row 1, field prompt: expected non-empty text, as row 0's prompt is"):
        load_prompt_only(path)


def test_bad_json_a_datasetdict_and_verl_columns_outside_parquet(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataError, match=f"{bad}: line 2 is not JSON"):
        data_prep.load_prompts(str(bad), tokenizer)
    splits = tmp_path / "dict"
    (splits / "train").mkdir(parents=True)
    (splits / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match=r"a DatasetDict of the splits \['train'\]; pass one split's directory"):
        read_rows(str(splits))
    verl = {"data_source": "x", "prompt": CHAT[0]["prompt"], "reward_model": {"ground_truth": "1"}}
    with pytest.raises(
        DataError, match=r"has verl's column\(s\) \['data_source', 'reward_model'\] \(first in row 0\), and verl's"
    ):
        data_prep.load_prompts(write(tmp_path, [verl], "jsonl"), tokenizer)


def test_verl_parquet_is_told_apart_by_its_columns_and_keeps_its_checks(tmp_path, tokenizer):
    # a data_source column makes it verl's: its missing reward_model is today's error, not a prompt-only dataset
    path = write(tmp_path, [{"data_source": "openai/gsm8k", "prompt": CHAT[0]["prompt"]}], "parquet")
    with pytest.raises(DataError, match=r"missing column\(s\) \['reward_model'\]"):
        data_prep.load_prompts(path, tokenizer)


def test_a_whitespace_only_prompt_is_refused_at_load(tmp_path, tokenizer):
    """ " " is 0 tokens here: the engines would fail at step 1 without naming the row (vLLM: "The decoder prompt
    cannot be empty"; transformers: a reshape error)."""
    path = write(tmp_path, [TEXT[0], {"prompt": " \n", "solution": "2"}], "jsonl")
    with pytest.raises(
        DataError, match=r"row 1, field prompt: expected non-empty text, as row 0's prompt is, got ' \\n'"
    ):
        data_prep.load_prompts(path, tokenizer)


def test_a_prompt_that_renders_to_no_tokens_is_refused_naming_its_file_and_row(tmp_path, tokenizer):
    """Empty messages under a template that adds nothing around them: in a prompt-only dataset's second shard,
    and in verl's schema."""
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, rows in enumerate([CHAT, [CHAT[0], {"prompt": empty, "solution": "3"}]]):
        pq.write_table(pa.Table.from_pylist(rows), shards / f"train-0000{i}-of-00002.parquet")
    second = shards / "train-00001-of-00002.parquet"
    with pytest.raises(
        DataError, match=rf"{shards}: 1 of 4 prompts render to no tokens .*\n  {second}, row 1, field prompt"
    ):
        data_prep.load_prompts(str(shards), bare)
    verl = [
        {"data_source": "openai/gsm8k", "prompt": p, "reward_model": {"ground_truth": "1"}}
        for p in (empty, CHAT[0]["prompt"])
    ]
    path = write(tmp_path, verl, "parquet")
    with pytest.raises(DataError, match=r"1 of 2 prompts render to no tokens .*\n  row 0, field prompt"):
        data_prep.load_prompts(path, bare)


def test_verl_columns_on_any_row_of_a_jsonl_make_it_verls(tmp_path, tokenizer):
    """Not only row 0's: a jsonl with verl's columns in row 5 alone is refused, naming that row."""
    verl = {"data_source": "openai/gsm8k", "prompt": "list 1 2 first", "reward_model": {"ground_truth": "1"}}
    path = write(tmp_path, [TEXT[0]] * 5 + [verl], "jsonl")
    with pytest.raises(DataError, match=r"has verl's column\(s\) \['data_source', 'reward_model'\] \(first in row 5\)"):
        data_prep.load_prompts(path, tokenizer)


@pytest.mark.parametrize("storage", ["jsonl", "parquet", "arrow"])
def test_open_r1s_prompt_is_built_from_its_column_and_system_prompt(tmp_path, tokenizer, storage):
    """--prompt-column and --system-prompt (open-r1's dataset_prompt_column and system_prompt): a dataset with no
    prompt column, as OpenR1-Math-220k is, gets prompt = [system, user: the row's problem], rendered as chat; the
    row keeps its columns for the rewards. Without the flags a parquet file of those columns is not TRL's."""
    rows = [{"problem": r["prompt"], "solution": r["solution"]} for r in TEXT]
    path = write(tmp_path, rows, storage)
    system = "Think, then answer."
    loaded, _ = data_prep.load_prompts(path, tokenizer, max_prompt_length=100, prompt_column="problem",
                                       system_prompt=system)  # fmt: skip
    want = [{"role": "system", "content": system}, {"role": "user", "content": "list 1 2 first"}]
    assert loaded[0]["prompt"] == want and loaded[0]["problem"] == "list 1 2 first" and loaded[0]["solution"] == "1"
    assert loaded[0]["prompt_ids"] == tokenizer.apply_chat_template(want, add_generation_prompt=True, return_dict=False)
    one, _ = data_prep.load_prompts(path, tokenizer, max_prompt_length=100, prompt_column="problem")
    assert one[1]["prompt"] == [{"role": "user", "content": "list 3 4 last"}]
    for name in ("chat", "missing"):
        os.makedirs(tmp_path / name)
    sys_first, _ = data_prep.load_prompts(write(tmp_path / "chat", CHAT, storage), tokenizer, max_prompt_length=100,
                                          system_prompt=system)  # fmt: skip
    assert sys_first[0]["prompt"] == [{"role": "system", "content": system}] + CHAT[0]["prompt"]
    with pytest.raises(DataError, match=r"row 1, field problem: missing; a prompt-only dataset needs a 'problem'"):
        load_prompt_only(write(tmp_path / "missing", [rows[0], {"solution": "4"}], "jsonl"), "problem")


def test_the_prompt_flags_are_refused_on_verls_data(tmp_path, tokenizer):
    data_prep.write_digits(str(tmp_path), seed=0, quiet=True)
    with pytest.raises(DataError, match="verl's schema; --prompt-column and --system-prompt are for TRL's"):
        data_prep.load_prompts(str(tmp_path / "test.parquet"), tokenizer, system_prompt="Be brief.")
