"""Bad inputs fail when they are loaded, naming the file at fault, not at the training step or
engine load that first touches them: data rows with no reward, model directories with a piece
missing or cut short (model_dir.check_model_path), and chat templates that never finish rendering
(chat_template.bound_chat_template). No engine is built here."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_prep import GOOD, guard, looping_model  # noqa: F401 (guard: a fixture); GOOD: one valid row

from chat_template import ChatTemplateError
from data_prep import DataError, load_dataset
from model_dir import check_model_path
from reward import BUILTIN_SOURCES
from rollout import make_engine


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


# ----------------------------------------------------------------------------------------------
# model directories that bring their own code, that are not models, or that are too short


OWN_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("the model directory's code ran")
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
class OwnConfig(LlamaConfig):
    model_type = "own_llama"
class OwnModel(LlamaForCausalLM):
    config_class = OwnConfig
class OwnClassifier(LlamaForSequenceClassification):
    config_class = OwnConfig
"""


def with_its_own_code(model_dir, marker):
    """Make `model_dir` a model that only its own code loads: config.json's auto_map names classes in
    own_model.py (which writes the file `marker` when imported) and its model_type is one transformers
    does not know. transformers then asks "Do you wish to run the custom code? [y/N]" on the console."""
    with open(os.path.join(model_dir, "own_model.py"), "w") as f:
        f.write(OWN_CODE.format(marker=str(marker)))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "own_llama"
    config["auto_map"] = {
        "AutoConfig": "own_model.OwnConfig",
        "AutoModelForCausalLM": "own_model.OwnModel",
        "AutoModelForSequenceClassification": "own_model.OwnClassifier",
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return str(model_dir)


def edit_json(path, **fields):
    with open(path) as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f)


def test_a_model_that_needs_its_own_code_is_refused_naming_the_file_and_key(model_copy, tmp_path):
    marker = tmp_path / "code_ran"
    with_its_own_code(model_copy, marker)
    with pytest.raises(ValueError) as err:
        check_model_path(model_copy)
    message = str(err.value)
    assert repr(model_copy) in message and "config.json has an auto_map" in message
    assert "own_model.OwnModel" in message and "model_type 'own_llama' is not one transformers implements" in message
    with pytest.raises(ValueError, match="config.json has an auto_map"):  # the engines check first
        make_engine("hf", model_copy, max_model_len=32)
    assert not marker.exists()


def test_a_known_model_type_with_an_auto_map_is_told_to_drop_it(model_copy):
    edit_json(os.path.join(model_copy, "config.json"), auto_map={"AutoModelForCausalLM": "own_model.OwnModel"})
    with pytest.raises(ValueError, match="transformers implements model_type 'llama' itself: delete the auto_map key"):
        check_model_path(model_copy)


def test_an_auto_map_in_the_tokenizer_config_is_refused(model_copy):
    edit_json(os.path.join(model_copy, "tokenizer_config.json"), auto_map={"AutoTokenizer": ["own.Tok", None]})
    with pytest.raises(ValueError, match="tokenizer_config.json has an auto_map .*own.Tok"):
        check_model_path(model_copy)


def test_an_unknown_or_missing_model_type_is_refused(model_copy):
    edit_json(os.path.join(model_copy, "config.json"), model_type="llama_9000")
    with pytest.raises(ValueError, match="model_type 'llama_9000' is not a model transformers implements"):
        check_model_path(model_copy)
    with open(os.path.join(model_copy, "config.json")) as f:
        config = json.load(f)
    del config["model_type"]
    with open(os.path.join(model_copy, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="config.json has no model_type"):
        check_model_path(model_copy)


LOADERS = """
import sys
import engine, hf_engine, policy, reward_model, torch
path = sys.argv[1]
hf_engine.check_model_path = lambda p: None  # as if the check were missed: each loader must still refuse
reward_model.check_reward_model = lambda p: None
for name, load in [
    ("policy.load_model", lambda: policy.load_model(path, torch.float32, "cpu")),
    ("engine.stop_token_ids", lambda: engine.stop_token_ids(path)),
    ("hf_engine.HFEngine", lambda: hf_engine.HFEngine(path, max_model_len=32)),
    ("reward_model.load_reward_model", lambda: reward_model.load_reward_model(path, None, torch.device("cpu"))),
]:
    try:
        load()
        print(name, "loaded")
    except (ValueError, OSError, SystemExit) as e:
        print(name, "refused:", str(e)[:80])
"""


def test_no_loader_runs_the_model_directorys_code_even_when_the_console_says_yes(model_copy, tmp_path):
    """Every from_pretrained passes trust_remote_code=False: with the directory check bypassed,
    transformers still never asks, so a "y" on stdin (or `yes |`) cannot let the code run."""
    import subprocess
    import sys

    from conftest import REPO

    marker = tmp_path / "code_ran"
    with_its_own_code(model_copy, marker)
    proc = subprocess.run(
        [sys.executable, "-c", LOADERS, model_copy],
        cwd=REPO,
        input="y\n" * 20,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists(), proc.stdout
    for name in ("policy.load_model", "hf_engine.HFEngine", "reward_model.load_reward_model"):  # their model classes
        assert f"{name} refused:" in proc.stdout, proc.stdout
    assert "engine.stop_token_ids loaded" in proc.stdout  # the tokenizer is a built-in one: no code needed
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr


def test_a_training_checkpoint_run_directory_or_adapter_says_what_to_pass(tmp_path):
    run = tmp_path / "run"
    step = run / "global_step_3"
    os.makedirs(step / "shards")
    os.makedirs(step / "hf")
    (step / "trainer_state.json").write_text("{}")
    (step / "hf" / "config.json").write_text("{}")
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(FileNotFoundError) as err:
        check_model_path(str(step))
    assert "is a training checkpoint (trainer_state.json, shards/)" in str(err.value)
    assert f"`python export.py {step} OUT_DIR`" in str(err.value)
    with pytest.raises(FileNotFoundError, match="training run directory") as err:
        check_model_path(str(run))
    assert f"python export.py {step} OUT_DIR" in str(err.value) and "final_model/, once" in str(err.value)
    os.makedirs(run / "final_model")
    (run / "final_model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"Pass the model it saved \\({run / 'final_model'}\\)"):
        check_model_path(str(run))
    adapter = tmp_path / "final_adapter"
    os.makedirs(adapter)
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds a LoRA adapter"):
        check_model_path(str(adapter))


def test_a_run_directory_with_its_flags_in_config_json_points_to_its_final_model(tmp_path):
    """train_grpo.py's --out-dir holds config.json too (the run's flags, no model_type): passed as --teacher, --model
    or --reward-model it is a run directory, not a model whose config.json lacks a model_type."""
    run = tmp_path / "run"
    os.makedirs(run / "final_model")
    (run / "final_model" / "config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": "tiny", "lr": 5e-4}))
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="is a training run directory, not a model") as err:
        check_model_path(str(run))
    assert f"Pass the model it saved ({run / 'final_model'})" in str(err.value)
    assert "model_type" not in str(err.value)


def test_weights_that_lack_a_parameter_the_model_needs_are_refused_by_name(tmp_path):
    """A causal LM whose config.json says tie_word_embeddings false and whose weights hold no lm_head.weight:
    transformers would initialise a random head (a teacher trained toward noise). Refused, naming it."""
    from models import build_tiny_model
    from policy import load_model
    from tasks.digits import TASK_WORDS

    path = build_tiny_model(str(tmp_path / "m"), TASK_WORDS, hidden=64)
    load_model(path, torch.float32, "cpu")  # tied: nothing missing
    edit_json(os.path.join(path, "config.json"), tie_word_embeddings=False)
    with pytest.raises(
        SystemExit, match=r"its weights lack 1 parameter\(s\) the model needs \(lm_head.weight\)"
    ) as err:
        load_model(path, torch.float32, "cpu")
    assert "tie_word_embeddings false" in str(err.value)


def test_context_length_follows_vllms_rule(model_copy):
    from model_dir import check_context_length, context_length

    config, tokenizer_config = (os.path.join(model_copy, f) for f in ("config.json", "tokenizer_config.json"))
    assert context_length(model_copy) == (512, f"max_position_embeddings in {config}")  # the tiny model's
    assert context_length("Qwen/Qwen2.5-0.5B-Instruct") == (None, None)  # a hub id: not read here
    edit_json(tokenizer_config, model_max_length=256)  # vLLM takes the smaller
    assert context_length(model_copy) == (256, f"model_max_length in {tokenizer_config}")
    edit_json(config, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    assert context_length(model_copy)[0] == 1024
    edit_json(config, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    assert context_length(model_copy)[0] == 256  # yarn's max_position_embeddings is already the long one
    check_context_length(model_copy, 200, 56)
    with pytest.raises(ValueError) as err:
        check_context_length(model_copy, 200, 100)
    assert str(err.value) == (
        f"--max-prompt-length 200 + --max-response-length 100 = 300 tokens, more than the 256 positions of the model "
        f"(model_max_length in {tokenizer_config}). Lower them to add up to at most 256: e.g. --max-response-length 56"
    )
    with pytest.raises(ValueError, match="e.g. --max-prompt-length 128 --max-response-length 128"):
        check_context_length(model_copy, 300, 1)


# ----------------------------------------------------------------------------------------------
# chat templates that loop: code from the model directory, stopped past chat_template.CHAT_TEMPLATE_SECONDS


@pytest.mark.usefixtures("guard")  # the limit at 0.25 s; a render never stopped fails the test
def test_a_reward_models_looping_chat_template_is_stopped_naming_its_file(tmp_path, monkeypatch):
    import torch

    import reward_model
    from models import build_random_model

    rm = build_random_model(str(tmp_path / "rm"), looping_model(tmp_path / "tiny"), reward_model=True)
    monkeypatch.setattr(reward_model, "shard", lambda model, mesh, dtype: model)  # one process, no FSDP2 here
    _, tokenizer = reward_model.load_reward_model(rm, None, torch.device("cpu"))  # its own tokenizer, bounded
    with pytest.raises(ChatTemplateError) as err:
        reward_model.render(tokenizer, [GOOD] * 4, ["2"] * 4)
    assert str(err.value).startswith(f"{rm}/chat_template.jinja: the chat template rendered for more than 0.25 s")


@pytest.mark.slow
def test_eval_on_a_model_whose_chat_template_loops_ends_naming_the_file(tmp_path):
    """eval.py as run, with the limit at 1 s instead of 30 (train_grpo.py loads its prompts the same way,
    startup.load_data). Before the limit, such a model hung both until killed, saying nothing."""
    import subprocess
    import sys

    from conftest import REPO

    from tasks.digits import write_digits

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=5)
    model = looping_model(tmp_path / "model")
    run = "import chat_template, eval; chat_template.CHAT_TEMPLATE_SECONDS = 1; eval.main()"
    flags = ["--model", model, "--data", str(tmp_path / "data" / "test.parquet"), "--rollout", "hf"]
    proc = subprocess.run([sys.executable, "-c", run, *flags], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{model}/chat_template.jinja: the chat template rendered for more than 1 s and was stopped" in proc.stderr
