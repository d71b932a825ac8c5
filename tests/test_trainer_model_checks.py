"""train_grpo.py refuses a --model or --reward-model it cannot use before anything loads, with one
message that names the flag, the file and what to do, instead of a prompt or a traceback: a directory
that needs its own Python code (never run, even when the console answers "y"), a training checkpoint
instead of a model, a tokenizer without a chat template, and prompt + response lengths past the
model's positions (vLLM's error for that suggests an unsafe override)."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from test_inputs import with_its_own_code

from model_dir import check_model_path
from models import build_random_model, build_tiny_model
from tasks.digits import TASK_WORDS, write_digits

SMALL = (
    "--rollout hf --max-steps 1 --prompt-batch-size 4 --mini-batch-size 4 --group-size 2 "
    "--test-freq -1 --max-prompt-length 32 --max-response-length 4"
).split()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(the tiny model, its task's train and validation data) in a fresh directory."""
    root = tmp_path_factory.mktemp("inputs")
    write_digits(str(root / "data"), seed=0, train_size=16, test_size=4)
    data = ["--train-data", str(root / "data" / "train.parquet"), "--val-data", str(root / "data" / "test.parquet")]
    return build_tiny_model(str(root / "model"), TASK_WORDS), data


def train(*flags, stdin=""):
    """`python train_grpo.py` (a world of one), with `stdin` on its console; returns the process."""
    return subprocess.run(
        [sys.executable, "train_grpo.py", *flags], cwd=REPO, input=stdin, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_trainer_never_runs_a_model_directorys_code_even_when_the_console_says_yes(inputs, tmp_path):
    model, data = inputs
    marker = tmp_path / "code_ran"
    own = with_its_own_code(shutil.copytree(model, str(tmp_path / "own")), marker)
    proc = train(
        "--model", own, *data, "--out-dir", str(tmp_path / "run"), *SMALL, "--save-freq", "-1", stdin="y\n" * 20
    )
    assert not marker.exists(), "the model directory's code ran"
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--model: model directory {own!r}: config.json has an auto_map" in proc.stderr
    assert "model_type 'own_llama' is not one transformers implements" in proc.stderr


@pytest.mark.slow
def test_the_trainer_never_runs_a_reward_models_code_even_when_the_console_says_yes(inputs, tmp_path):
    model, data = inputs
    marker = tmp_path / "code_ran"
    rm = with_its_own_code(build_random_model(str(tmp_path / "rm"), model, seed=1, reward_model=True), marker)
    flags = ["--model", model, *data, "--out-dir", str(tmp_path / "run"), *SMALL, "--save-freq", "-1"]
    proc = train(*flags, "--reward-model", rm, stdin="y\n" * 20)
    assert not marker.exists(), "the reward model directory's code ran"
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--reward-model: model directory {rm!r}: config.json has an auto_map" in proc.stderr
    assert "rollout engine:" not in proc.stdout  # refused before anything loads


@pytest.mark.slow
def test_a_checkpoint_passed_as_the_model_says_how_to_export_it_and_that_works(inputs, tmp_path):
    model, data = inputs
    run = tmp_path / "run"
    first = train("--model", model, *data, "--out-dir", str(run), *SMALL, "--save-freq", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    step = str(run / "global_step_1")
    proc = train("--model", step, *data, "--out-dir", str(tmp_path / "again"), *SMALL)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = f"--model: {step!r} is a training checkpoint (trainer_state.json, shards/), not a Hugging Face model"
    assert message in proc.stderr
    command = f"python export.py {step} OUT_DIR"
    assert f"`{command}`" in proc.stderr
    out = str(tmp_path / "exported")  # the advice works: the export is a model the trainer takes
    export = subprocess.run(
        [sys.executable, *command.split()[1:-1], out], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert export.returncode == 0, export.stderr[-3000:]
    check_model_path(out)


@pytest.mark.slow
def test_prompt_and_response_lengths_past_the_models_positions_are_named(tmp_path):
    flags = ["--model", "tiny", "--out-dir", str(tmp_path / "run"), *SMALL, "--save-freq", "-1"]
    proc = train(*flags, "--max-prompt-length", "500", "--max-response-length", "100")  # the tiny model has 512
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in proc.stderr  # vLLM's advice, unsafe: never reached
    tiny = os.path.join(str(tmp_path / "run"), "tiny_model", "config.json")
    assert (
        "--max-prompt-length 500 + --max-response-length 100 = 600 tokens, more than the 512 positions of the model "
        f"(max_position_embeddings in {tiny}). Lower them to add up to at most 512: e.g. --max-response-length 12"
    ) in proc.stderr


@pytest.mark.slow
def test_a_tokenizer_without_a_chat_template_is_named(inputs, tmp_path):
    model, data = inputs
    plain = shutil.copytree(model, str(tmp_path / "plain"))
    os.remove(os.path.join(plain, "chat_template.jinja"))
    proc = train("--model", plain, *data, "--out-dir", str(tmp_path / "run"), *SMALL, "--save-freq", "-1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"model directory {plain!r}: the tokenizer has no chat_template" in proc.stderr
