"""Bad inputs fail when they are loaded, naming the file at fault, not at the training step or
engine load that first touches them: data rows with no reward, and model directories with a piece
missing or cut short (rollout.check_model_path). No engine is built here."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_prep import GOOD  # one valid row of verl's schema

from data_prep import DataError, load_dataset
from reward import BUILTIN_SOURCES
from rollout import check_model_path, make_engine


def write_rows(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


# ----------------------------------------------------------------------------------------------
# data_sources with no reward


def test_a_data_source_with_no_reward_fails_at_load_naming_file_rows_and_source(tmp_path):
    rows = [GOOD] * 3 + [dict(GOOD, data_source="my/puzzles")] * 12
    path = write_rows(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError) as err:
        load_dataset(path, known_sources=BUILTIN_SOURCES)  # what train_grpo.py and eval.py pass without --reward-fn
    message = str(err.value)
    assert path in message and "12 of 15 rows are invalid" in message
    assert "row 3, field data_source: no built-in reward for 'my/puzzles'" in message
    assert "row 12, field data_source" in message and "row 13," not in message  # the first 10 are listed
    assert "--reward-fn path/to/file.py:function_name" in message and "openai/gsm8k" in message


def test_with_a_custom_reward_any_data_source_loads(tmp_path):
    path = write_rows(tmp_path / "train.parquet", [GOOD, dict(GOOD, data_source="my/puzzles")])
    assert len(load_dataset(path, known_sources=None)) == 2  # --reward-fn: the custom function decides


def test_a_data_source_with_no_reward_in_a_shard_names_the_shard_and_its_row(tmp_path):
    write_rows(tmp_path / "data" / "train-00000-of-00002.parquet", [GOOD, GOOD])
    shard = write_rows(tmp_path / "data" / "train-00001-of-00002.parquet", [GOOD, dict(GOOD, data_source="my/puzzles")])
    with pytest.raises(DataError, match="1 of 4 rows") as err:
        load_dataset(str(tmp_path / "data"), known_sources=BUILTIN_SOURCES)
    assert f"{shard}, row 1, field data_source: no built-in reward for 'my/puzzles'" in str(err.value)


# ----------------------------------------------------------------------------------------------
# model directories


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from models import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")), ["1", "2"])


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    """A copy of the tiny model that a test may break."""
    return shutil.copytree(tiny_model, str(tmp_path / "model"))


def test_a_complete_model_directory_passes(tiny_model):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tiny_model))
    check_model_path(tiny_model)


def test_hub_ids_pass_and_missing_local_paths_do_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"):
        check_model_path(hub_id)  # downloaded and checked by transformers / vLLM, not here
    os.makedirs("runs")
    for local in (
        str(tmp_path / "no_such_model"),
        "./no_such_model",
        "../no_such_model",
        "~/no_such_model",
        "runs/grpo/final_model",
        "runs/final_model",
    ):
        with pytest.raises(FileNotFoundError, match="no such directory") as err:
            check_model_path(local)
        assert repr(local) in str(err.value)


def test_a_file_or_a_directory_without_config_json_is_not_a_model(model_copy):
    with pytest.raises(NotADirectoryError, match="a file, not a directory"):
        check_model_path(os.path.join(model_copy, "model.safetensors"))
    os.remove(os.path.join(model_copy, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_path(model_copy)


def test_missing_weights_are_named(model_copy):
    os.remove(os.path.join(model_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no weights"):
        check_model_path(model_copy)
    open(os.path.join(model_copy, "pytorch_model.bin"), "wb").close()  # the older format counts (not opened)
    check_model_path(model_copy)


def test_sharded_weights_need_every_shard_the_index_lists(model_copy):
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    os.rename(os.path.join(model_copy, "model.safetensors"), os.path.join(model_copy, shards[0]))
    with open(os.path.join(model_copy, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}, f)
    with pytest.raises(FileNotFoundError, match="1 of them missing") as err:
        check_model_path(model_copy)
    assert shards[1] in str(err.value) and "model.safetensors.index.json" in str(err.value)
    shutil.copy(os.path.join(model_copy, shards[0]), os.path.join(model_copy, shards[1]))
    check_model_path(model_copy)


def test_a_truncated_safetensors_file_is_named(model_copy):
    weights = os.path.join(model_copy, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 100)  # a download cut short inside the tensor data
    with pytest.raises(ValueError, match=f"truncated: {size - 100} bytes, but its header describes {size}") as err:
        check_model_path(model_copy)
    assert weights in str(err.value)
    with open(weights, "r+b") as f:
        f.truncate(50)  # cut inside the header
    with pytest.raises(ValueError, match="too short for the header it declares"):
        check_model_path(model_copy)
    with open(weights, "w") as f:  # what `git clone` without git-lfs leaves
        f.write("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 2106424\n")
    with pytest.raises(ValueError, match="Git LFS pointer"):
        check_model_path(model_copy)


def test_a_model_without_a_tokenizer_is_an_error_before_any_engine_loads(model_copy):
    os.remove(os.path.join(model_copy, "tokenizer.json"))  # tokenizer_config.json alone cannot build one
    with pytest.raises(FileNotFoundError, match="no tokenizer") as err:
        check_model_path(model_copy)
    assert repr(model_copy) in str(err.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        make_engine("hf", model_copy, max_model_len=32)
