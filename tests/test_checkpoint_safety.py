"""checkpoint.py against hostile and damaged checkpoints: loading one runs no code from it, a
corrupt one is skipped with a message naming the file (and if none is good the run refuses to
start), an async save is published as soon as every rank has written it, and an export is never
left half-written. One 2-rank run of checkpoint.py on a tiny model (seconds) makes the checkpoints;
everything else runs in this process."""

import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Saves and loads as train_grpo.py does, on 2 ranks: <root>/run has steps 1 and 2 (saved in the
# foreground), <root>/async has step 3 (saved in the background, published by poll()).
SAVE_AND_LOAD = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import checkpoint

    model_dir, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)

    def train_step(model, optimizer):
        ids = torch.randint(0, model.config.vocab_size, (2, 8))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    torch.manual_seed(0)
    model, optimizer = make()
    tokenizer, config = AutoTokenizer.from_pretrained(model_dir), {"model": model_dir}
    saver = checkpoint.Checkpointer(os.path.join(root, "run"))
    for step in (1, 2):
        train_step(model, optimizer)
        saver.save(step, model, optimizer, {"config": config}, tokenizer)

    # a fresh model and optimizer load step 2 exactly: weights, AdamW moments, param_groups
    model2, optimizer2 = make()
    checkpoint.load(checkpoint.step_dir(os.path.join(root, "run"), 2), model2, optimizer2, config)
    a, b = optimizer.state_dict(), optimizer2.state_dict()
    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])  # betas a tuple again
    assert all(torch.equal(local(a["state"][p][k]), local(b["state"][p][k])) for p in a["state"] for k in a["state"][p])
    assert all(torch.equal(local(p), local(q)) for p, q in zip(model.parameters(), model2.parameters()))

    # poll() publishes a background save only when every rank's write is done
    out = os.path.join(root, "async")
    saver = checkpoint.Checkpointer(out, async_save=True)
    train_step(model, optimizer)
    saver.save(3, model, optimizer, {"config": config}, tokenizer)
    future = saver.pending[0]
    while not future.done():
        time.sleep(0.01)

    class StillWriting:  # rank 1's write, as if it were still running
        def done(self):
            return False

        def result(self):
            return future.result()

    if rank == 1:
        saver.pending = (StillWriting(), 3)
    saver.poll()
    assert not os.path.exists(checkpoint.step_dir(out, 3)), "published while rank 1 was still writing"
    if rank == 1:
        saver.pending = (future, 3)
    saver.poll()
    assert saver.pending is None and open(os.path.join(out, checkpoint.TRACKER)).read() == "3"
    saver.poll()  # nothing pending: a no-op
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """<root>/run/global_step_{1,2} and <root>/async/global_step_3, saved by 2 ranks."""
    import data_prep
    from models import build_tiny_model

    root = tmp_path_factory.mktemp("saved")
    model_dir = build_tiny_model(str(root / "model"), data_prep.TASK_WORDS, hidden=64, intermediate=128)
    (root / "save_and_load.py").write_text(SAVE_AND_LOAD)
    cmd = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc_per_node=2".split(),
        str(root / "save_and_load.py"),
        model_dir,
        str(root),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO)
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return root


@pytest.fixture
def run(saved, tmp_path):
    """A copy of the 2-step run, ours to damage."""
    shutil.copytree(saved / "run", tmp_path / "run")
    return tmp_path / "run"


def test_two_ranks_save_load_exactly_and_poll_publishes_async_saves(saved):
    # the script asserted the exact round trip and poll()'s agreement; here, what it left on disk
    assert checkpoint.find_checkpoint(str(saved / "run"), "auto") == checkpoint.step_dir(str(saved / "run"), 2)
    assert checkpoint.problem_with(checkpoint.step_dir(saved / "async", 3)) is None
    assert not [d for d in os.listdir(saved / "async") if d.endswith(".tmp")]


def test_shards_hold_only_tensors_and_the_rest_is_json(saved):
    step = checkpoint.step_dir(saved / "run", 2)
    index = checkpoint.read_index(os.path.join(step, "shards", ".metadata"))
    assert {type(entry).__name__ for entry in index.state_dict_metadata.values()} == {"TensorStorageMetadata"}
    assert any(fqn.startswith("optim.state.") and fqn.endswith(".exp_avg_sq") for fqn in index.state_dict_metadata)
    with open(os.path.join(step, checkpoint.NON_TENSORS)) as f:
        (group,) = json.load(f)["optim"]["param_groups"]
    assert group["lr"] == 1e-3 and group["betas"] == [0.9, 0.99] and group["weight_decay"] == 0.1


# ----------------------------------------------------------------------------------------------
# No code runs from a checkpoint


def calls(module, name, arg):
    """A protocol-4 pickle that calls module.name(arg), found by STACK_GLOBAL from two strings."""

    def string(s):
        return pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()

    return (
        pickle.PROTO
        + b"\x04"
        + string(module)
        + string(name)
        + pickle.STACK_GLOBAL
        + string(arg)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def test_the_index_payload_runs_under_plain_pickle(tmp_path):
    # what the allow-list is for: the metadata module imports os, so this name reaches os.system
    pickle.loads(calls("torch.distributed.checkpoint.metadata", "os.system", f"touch {tmp_path / 'ran'}"))
    assert os.path.exists(tmp_path / "ran")


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("pathlib", "os.system"),
        ("torch", "os.system"),
        ("os", "system"),
        ("torch.distributed.checkpoint.metadata", "os"),
        ("torch", "load"),
        ("builtins", "eval"),
    ],
)
def test_an_index_that_names_anything_else_is_refused(run, tmp_path, module, name):
    marker = tmp_path / "ran"
    index = os.path.join(checkpoint.step_dir(run, 2), "shards", ".metadata")
    with open(index, "wb") as f:
        f.write(calls(module, name, f"touch {marker}"))
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{index} refers to ({module!r}, {name!r})")):
        checkpoint.read_index(index)
    assert f"refers to ({module!r}, {name!r})" in checkpoint.problem_with(checkpoint.step_dir(run, 2))
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    assert not os.path.exists(marker)


class Payload:
    """Pickles as a call to os.system: whoever unpickles it touches `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp in this one process: that is the intent
def test_a_shard_entry_that_is_a_pickle_is_refused(run, tmp_path):
    # torch's own reader unpickles a non-tensor entry with weights_only=False: the payload runs
    dcp.save({"w": Payload(tmp_path / "ran_torch")}, checkpoint_id=tmp_path / "torch", no_dist=True)
    dcp.load({"w": torch.zeros(1)}, checkpoint_id=tmp_path / "torch", no_dist=True)
    assert os.path.exists(tmp_path / "ran_torch")

    # ours refuses, naming the shard file
    marker, shards = tmp_path / "ran", os.path.join(checkpoint.step_dir(run, 2), "shards")
    shutil.rmtree(shards)
    dcp.save({"w": Payload(marker)}, checkpoint_id=shards, no_dist=True)
    with pytest.raises(
        dcp.CheckpointException,
        match=re.escape(os.path.join(shards, "__0_0.distcp") + ": w is stored as a pickled object"),
    ):
        dcp.load({"w": torch.zeros(1)}, storage_reader=checkpoint.SafeReader(shards), no_dist=True)
    # and a checkpoint holding one is skipped before anything reads it
    assert checkpoint.problem_with(checkpoint.step_dir(run, 2)).startswith(
        "the shards hold pickled objects (w), which we never load"
    )
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    with pytest.raises(SystemExit, match="cannot export: the shards hold pickled objects"):
        checkpoint.export(checkpoint.step_dir(run, 2), str(tmp_path / "exported"))
    assert not os.path.exists(marker)


# ----------------------------------------------------------------------------------------------
# A corrupt checkpoint is skipped, naming the file


def garbage_like(path):
    """Random bytes, as many as the file has."""
    return random.Random(0).randbytes(os.path.getsize(path))


@pytest.mark.parametrize(
    "name, damage, problem",
    [
        ("rng_rank0.json", lambda p: b"{}", "rng_rank0.json is unreadable (KeyError: 'python')"),
        (
            "rng_rank1.json",
            lambda p: b'{"python": [3, [1, 2], null], "numpy": [], "torch": []}',
            "rng_rank1.json is unreadable (ValueError",
        ),
        ("trainer_state.json", lambda p: b"[]", "trainer_state.json is unreadable (AttributeError"),
        (
            "trainer_state.json",
            lambda p: b'{"step": 2, "world_size": 2}',
            "trainer_state.json is unreadable (ValueError: expected a step, a world_size and a config)",
        ),
        (checkpoint.NON_TENSORS, lambda p: b'{"optim": ', f"{checkpoint.NON_TENSORS} is unreadable (JSONDecodeError"),
        ("hf/config.json", lambda p: b"\x00", "hf/config.json is unreadable (JSONDecodeError"),
        ("shards/__0_0.distcp", garbage_like, "shard __0_0.distcp is corrupt: "),
        ("shards/__1_0.distcp", lambda p: open(p, "rb").read()[:-1], "shard __1_0.distcp is missing or truncated"),
    ],
)
def test_a_corrupt_checkpoint_is_skipped_naming_the_file(run, capsys, name, damage, problem):
    path = os.path.join(checkpoint.step_dir(run, 2), name)
    content = damage(path)
    with open(path, "wb") as f:
        f.write(content)
    assert checkpoint.problem_with(checkpoint.step_dir(run, 2)).startswith(problem)
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    assert f"resume: skipping {checkpoint.step_dir(run, 2)}: {problem}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=re.escape(f"global_step_2: cannot resume from it: {problem}")):
        checkpoint.find_checkpoint(str(run), checkpoint.step_dir(str(run), 2))


def test_a_garbage_tracker_is_ignored_naming_the_file(run, capsys):
    tracker = run / checkpoint.TRACKER
    tracker.write_bytes(b"\xff\x00garbage")
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 2)  # the newest good one
    assert f"resume: ignoring {tracker}: it says" in capsys.readouterr().out
    tracker.write_text("1")  # a later run that started over: the tracker, not the largest number, says which
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)


def test_with_no_good_checkpoint_the_run_refuses_to_start_over(run, tmp_path):
    for step in (1, 2):
        (run / f"global_step_{step}" / "rng_rank0.json").write_text("{}")
    with pytest.raises(SystemExit) as error:
        checkpoint.find_checkpoint(str(run), "auto")
    message = str(error.value)
    assert f"{checkpoint.step_dir(run, 2)}: rng_rank0.json is unreadable" in message
    assert f"{checkpoint.step_dir(run, 1)}: rng_rank0.json is unreadable" in message
    assert "another --out-dir" in message
    assert checkpoint.find_checkpoint(str(tmp_path / "new_run"), "auto") is None  # no checkpoints at all: a fresh start


# ----------------------------------------------------------------------------------------------
# Exports are written aside and renamed into place


class BrokenTokenizer:
    """Fails while the export is being written, after the weights."""

    def save_pretrained(self, path):
        raise OSError("disk full")


def test_an_export_is_never_left_half_written(saved, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved / "model", dtype=torch.float32)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    second = {k: v + 1 for k, v in first.items()}
    out = tmp_path / "final_model"

    def weights():
        return load_file(out / "model.safetensors")["model.embed_tokens.weight"]

    checkpoint.write_hf(first, model.config, model.generation_config, None, str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"])
    with pytest.raises(OSError, match="disk full"):  # a crash mid-write: the previous model stays whole
        checkpoint.write_hf(second, model.config, model.generation_config, BrokenTokenizer(), str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"]) and os.path.isdir(f"{out}.tmp")
    os.rename(out, f"{out}.old")  # a crash between the two renames: the previous model is put back
    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_hf(second, model.config, model.generation_config, BrokenTokenizer(), str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"])
    checkpoint.write_hf(second, model.config, model.generation_config, None, f"{out}/")  # replaced only now
    assert torch.equal(weights(), second["model.embed_tokens.weight"])
    assert sorted(os.listdir(tmp_path)) == ["final_model"]  # no .tmp or .old left behind
    assert torch.equal(
        AutoModelForCausalLM.from_pretrained(out).state_dict()["lm_head.weight"], second["model.embed_tokens.weight"]
    )
