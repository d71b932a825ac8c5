"""data_prep.py: the loader that names the file, row and field at fault, and prompts through the
tokenizer. (Each task's rows, and the CLI that writes them: test_tasks.py.)"""

import json
import os
import signal
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import chat_template
import data_prep
import startup
from chat_template import ChatTemplateError
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


def test_a_file_of_no_rows_says_so_though_it_has_no_columns_either(tmp_path):
    # what data_prep.py reasoning-gym --size 0 wrote: no rows, so no columns; the loader said "missing column(s)"
    empty = write_rows(tmp_path, [], "empty.parquet")
    with pytest.raises(DataError, match="empty.parquet: has no rows, so nothing to train or validate on; write it"):
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


@pytest.fixture
def tiny_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "model"), TASK_WORDS))


def test_a_prompt_that_cannot_fit_is_dropped_before_any_template_renders_it(tmp_path, tiny_tokenizer, monkeypatch):
    # --shots 100000 wrote prompts of 23 MB, and the trainer blamed the chat template ("does it loop?")
    rendered = []
    render = data_prep.render_chats
    monkeypatch.setattr(data_prep, "render_chats", lambda rows, tok: (rendered.extend(rows), render(rows, tok)))
    short = dict(GOOD, prompt=[{"role": "user", "content": "list 2 9 1 4 1 7 last"}])
    huge = dict(GOOD, prompt=[{"role": "system", "content": "list 2 9 1 4 1 7 last " * 100_000}, *short["prompt"]])
    rows, dropped = data_prep.load_prompts(write_rows(tmp_path, [short, huge, short]), tiny_tokenizer, None, 32)
    assert (len(rows), dropped) == (2, 1) and len(rendered) == 2  # counted with the other prompts too long
    longest = max(map(len, tiny_tokenizer.get_vocab()))  # "<|assistant|>"
    path = write_rows(tmp_path, [huge, huge], "huge.parquet")
    with pytest.raises(DataError) as err:
        data_prep.load_prompts(path, tiny_tokenizer, None, 32)
    assert str(err.value) == (
        f"{path}: every prompt is longer than max_prompt_length=32 tokens; row 0's prompt has 1,400,014 characters "
        f"(whitespace aside), more than max_prompt_length=32 tokens of at most {longest} characters (the tokenizer's "
        f"longest token) can hold, {32 * longest:,}: shorten the prompts, or raise --max-prompt-length"
    )
    assert len(rendered) == 2  # neither was rendered


def test_val_max_prompts_keeps_each_data_source_in_proportion_and_names_one_it_drops(tmp_path, tiny_tokenizer, capsys):
    import argparse

    # a file written task by task: its first 5 rows are all of "a"
    rows = [dict(GOOD, data_source=s, extra_info={"index": i}) for i, s in enumerate("aaaaaabbbc")]
    path = write_rows(tmp_path, rows)
    args = argparse.Namespace(  # what train_grpo.py passes (--reward-fn: any data_source)
        reward_fn="f.py:f",
        train_data=path,
        val_data=path,
        max_prompt_length=64,
        val_max_prompts=5,
        prompt_batch_size=1,
        prompt_column="prompt",
        system_prompt="",
    )
    train, val = startup.load_data(args, tiny_tokenizer)
    assert len(train) == 10 and [(r["data_source"], r["extra_info"]["index"]) for r in val] == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 6), ("b", 7)]  # fmt: skip
    assert (
        "validation data: --val-max-prompts 5: 5 of 10 prompts, the first of each data_source in proportion: a 3, b 2; "
        "none of c, too small a share for one (raise --val-max-prompts to validate it)"
    ) in capsys.readouterr().out
    args.val_max_prompts = 3
    assert [r["data_source"] for r in startup.load_data(args, tiny_tokenizer)[1]] == ["a", "a", "b"]
    one = write_rows(tmp_path, [dict(GOOD, extra_info={"index": i}) for i in range(6)], "one.parquet")
    args.val_data, args.val_max_prompts = one, 4
    capsys.readouterr()
    assert [r["extra_info"]["index"] for r in startup.load_data(args, tiny_tokenizer)[1]] == [0, 1, 2, 3]
    assert "--val-max-prompts" not in capsys.readouterr().out  # one data_source: its first rows, as before
    trl = tmp_path / "trl.jsonl"  # TRL's prompt-only rows name no data_source: one source, its first rows
    trl.write_text("".join(json.dumps({"prompt": f"list {i} first", "solution": str(i)}) + "\n" for i in range(4)))
    args.val_data, args.val_max_prompts = str(trl), 2
    assert [r["solution"] for r in startup.load_data(args, tiny_tokenizer)[1]] == ["0", "1"]


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


# ----------------------------------------------------------------------------------------------
# A chat template that loops: code from the model directory, stopped past CHAT_TEMPLATE_SECONDS

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps: hours


def looping_model(folder, in_config=False):
    """The tiny model with LOOP before its chat template: in chat_template.jinja, or (in_config) in
    tokenizer_config.json's "chat_template" instead (the older place, which transformers still reads)."""
    from models import build_tiny_model

    model = build_tiny_model(str(folder), TASK_WORDS)
    jinja = os.path.join(model, "chat_template.jinja")
    with open(jinja) as f:
        template = LOOP + f.read()
    if in_config:
        os.remove(jinja)
        config_path = os.path.join(model, "tokenizer_config.json")
        with open(config_path) as f:
            config = dict(json.load(f), chat_template=template)
        jinja, template = config_path, json.dumps(config)
    with open(jinja, "w") as f:
        f.write(template)
    return model


def fail_the_test(signum, frame):
    raise AssertionError("the chat template was not stopped")


@pytest.fixture
def guard(monkeypatch):
    """A short CHAT_TEMPLATE_SECONDS (30 s in a run), and a timer of our own running meanwhile: it fails
    a test whose render is never stopped, and the bounded renders must leave it, and its handler, as they
    were (a render saves and restores them)."""
    monkeypatch.setattr(chat_template, "CHAT_TEMPLATE_SECONDS", 0.25)
    before = signal.signal(signal.SIGALRM, fail_the_test)
    signal.setitimer(signal.ITIMER_REAL, 120)
    try:
        yield
        assert signal.getsignal(signal.SIGALRM) is fail_the_test and 0 < signal.getitimer(signal.ITIMER_REAL)[0] < 120
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_chat_template_that_loops_is_stopped_at_every_render_naming_its_file(tmp_path, guard):
    from transformers import AutoTokenizer

    import reward_model
    import tools

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
    model = looping_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stopped = f"{model}/chat_template.jinja: the chat template rendered for more than 0.25 s and was stopped"
    renders = [  # load_prompts bounds the tokenizer for the rest of the run: every later render, whoever calls it
        lambda: data_prep.load_prompts(str(tmp_path / "data" / "test.parquet"), tokenizer),
        lambda: tokenizer.apply_chat_template(GOOD["prompt"], add_generation_prompt=True),
        lambda: tools.render_prompt(tokenizer, GOOD["prompt"], []),  # prompts with --tools, and token deltas
        lambda: reward_model.render(tokenizer, [GOOD] * 4, ["2"] * 4),
    ]
    for render in renders:
        start = time.monotonic()
        with pytest.raises(ChatTemplateError) as err:
            render()
        assert time.monotonic() - start < 10
        assert stopped in str(err.value) and "(the limit: chat_template.CHAT_TEMPLATE_SECONDS)" in str(err.value)


def test_a_looping_template_in_tokenizer_config_json_is_named_there_and_ends_the_trainer(tmp_path, guard):
    import argparse

    from transformers import AutoTokenizer

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
    model = looping_model(tmp_path / "model", in_config=True)
    test = str(tmp_path / "data" / "test.parquet")
    args = argparse.Namespace(  # what train_grpo.py passes: its data, as the trainer loads it
        reward_fn="",
        train_data=test,
        val_data=test,
        max_prompt_length=64,
        val_max_prompts=-1,
        prompt_batch_size=1,
        prompt_column="prompt",
        system_prompt="",
    )
    with pytest.raises(SystemExit) as end:
        startup.load_data(args, AutoTokenizer.from_pretrained(model))
    where = f'{model}/tokenizer_config.json\'s "chat_template"'
    assert str(end.value).startswith(f"{where}: the chat template rendered for more than 0.25 s and was stopped")


def test_a_bounded_template_renders_as_before_and_off_the_main_thread_says_it_is_not_bounded(
    tmp_path, guard, monkeypatch
):
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from models import build_tiny_model

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
    test = str(tmp_path / "data" / "test.parquet")
    model = build_tiny_model(str(tmp_path / "model"), TASK_WORDS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    unbounded = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for row in load_dataset(test)
    ]
    for batch in (data_prep.RENDER_BATCH, 2):  # the training data, then the validation data: bounded once
        monkeypatch.setattr(data_prep, "RENDER_BATCH", batch)  # 2: the 5 prompts render in batches of 2, 2 and 1
        rows, _ = data_prep.load_prompts(test, tokenizer)
        assert [row["prompt_ids"] for row in rows] == unbounded
    bounded = tokenizer.apply_chat_template
    assert bounded.func is chat_template.bounded_render and bounded.args == (tokenizer, f"{model}/chat_template.jinja")
    # signals reach the main thread only: a render on another thread (none of ours) is not stopped, and says so
    with pytest.warns(UserWarning, match="chat_template.jinja: a chat template rendered off the main thread is not"):
        with ThreadPoolExecutor(1) as pool:
            text = pool.submit(tokenizer.apply_chat_template, GOOD["prompt"], tokenize=False).result()
    assert text == "<bos><|user|> 1 + 1? "


# ----------------------------------------------------------------------------------------------
# extra_info.tools_kwargs: checked against the loaded tools (--tools) when the data loads


def check(answer: str, ground_truth: str) -> str:
    """Check an answer.

    Args:
        answer: The model's answer.
        ground_truth: The right answer, which the row passes itself.
    """
    return "right" if answer == ground_truth else "wrong"


def with_tools_kwargs(tmp_path, tools_kwargs, name="tools.parquet"):
    return write_rows(tmp_path, [dict(GOOD, extra_info={"index": 0, "tools_kwargs": tools_kwargs})], name)


def test_tools_kwargs_must_name_a_loaded_tool_and_its_arguments(tmp_path):
    import tools

    schemas = [tools.tool_schema("tests/test_data_prep.py", "check", check)]
    for good in ({"check": {"ground_truth": "2"}}, {"check": {"create_kwargs": {"ground_truth": "2"}}}):  # verl's too
        path = with_tools_kwargs(tmp_path, good)
        (row,) = load_dataset(path, schemas=schemas)
        (shown,) = tools.row_schemas(schemas, row["extra_info"]["tools_kwargs"])
        assert list(shown["function"]["parameters"]["properties"]) == ["answer"]  # the row passes the rest
    at = "extra_info.tools_kwargs"
    bad = [  # (tools_kwargs, the field named, what was expected)
        ({"calc": {"expression": "1+1"}}, f"{at}.calc", "no tool 'calc' is loaded; --tools gives ['check']"),
        (
            {"check": {"truth": "2"}},
            f"{at}.check.truth",
            "no argument 'truth'; its arguments: ['answer', 'ground_truth']",
        ),
        ({"check": {"create_kwargs": {"truth": "2"}}}, f"{at}.check.create_kwargs.truth", "no argument 'truth'"),
        ({"check": "2"}, f"{at}.check", "expected a dict of argument -> value, got '2'"),
        ({"check": {"create_kwargs": "2"}}, f"{at}.check.create_kwargs", "expected a dict of argument -> value"),
        ({"check": {"release_kwargs": {"ground_truth": "2"}}}, f"{at}.check.release_kwargs", "nothing would use it"),
        ("check", at, "expected a dict of tool name -> {argument: value}, got 'check'"),
    ]
    for i, (tools_kwargs, field, expected) in enumerate(bad):
        path = with_tools_kwargs(tmp_path, tools_kwargs, f"bad{i}.parquet")
        with pytest.raises(DataError) as err:
            load_dataset(path, schemas=schemas)
        assert f"{path}: 1 of 1 rows are invalid:\n  row 0, field {field}: " in str(err.value)
        assert expected in str(err.value)
    # a bad row is a row error like the others: skip_invalid drops it
    mixed = write_rows(
        tmp_path, [dict(GOOD, extra_info={"tools_kwargs": {"check": {"truth": "2"}}}), GOOD], "mixed.parquet"
    )
    assert len(load_dataset(mixed, skip_invalid=True, schemas=schemas)) == 1


def test_prompts_check_tools_kwargs_against_the_tools_or_their_absence(tmp_path):
    from transformers import AutoTokenizer

    from models import build_tiny_model

    path = with_tools_kwargs(tmp_path, {"check": {"ground_truth": "2"}})
    assert len(load_dataset(path)) == 1  # schemas=None: not checked (reading the data, not training on it)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "model"), TASK_WORDS))
    with pytest.raises(DataError) as err:
        data_prep.load_prompts(path, tokenizer)  # what the trainer and eval.py do without --tools
    assert f"{path}: 1 of 1 rows are invalid:\n  row 0, field extra_info.tools_kwargs: " in str(err.value)
    assert "passes arguments to the tools ['check'], but --tools is not set" in str(err.value)
    assert len(data_prep.load_prompts(write_rows(tmp_path, [GOOD], "plain.parquet"), tokenizer)[0]) == 1
    import tools

    schemas = [tools.tool_schema("tests/test_data_prep.py", "check", check)]
    with pytest.raises(DataError, match=r"row 0, field extra_info.tools_kwargs.calc: no tool 'calc' is loaded"):
        data_prep.load_prompts(
            with_tools_kwargs(tmp_path, {"calc": {"x": "1"}}, "calc.parquet"), tokenizer, schemas=schemas
        )
