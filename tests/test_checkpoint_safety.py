"""checkpoint.py, integrity.py and export.py against hostile and damaged checkpoints: loading one
runs no code from it, a corrupt one is skipped with a message naming the file (and if none is good
the run refuses to start), an async save is published as soon as every rank has written it, and an
export is never left half-written. One 2-rank run of checkpoint.py on a tiny model (seconds) makes the checkpoints;
everything else runs in this process."""

import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
import export
import integrity
import run_dir
import safe_write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Saves and loads as train_grpo.py does, on 2 ranks: <root>/run has steps 1 and 2 (saved in the
# foreground), <root>/async has step 3 (saved in the background, published by poll()), <root>/lora
# step 1 of LoRA adapters (rank 8 on q_proj and v_proj). Then saves that must fail on every rank: of
# weights holding inf (<root>/nonfinite, <root>/nonfinite_model), and onto /dev/full (<root>/devfull).
# Each rank's error messages go to <root>/messages_rank{r}.json.
SAVE_AND_LOAD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import checkpoint, policy, safe_write

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

    # inf in rank 1's shard of one parameter: every rank refuses, naming it, and nothing is written
    messages = {}
    param = dict(model.named_parameters())["model.norm.weight"]
    kept = param.to_local().clone()
    with torch.no_grad():
        if rank == 1:
            param.to_local()[3] = float("inf")
    saver = checkpoint.Checkpointer(os.path.join(root, "nonfinite"))
    for name, write in (
        ("save", lambda: saver.save(4, model, optimizer, {"config": config}, tokenizer)),
        ("save_hf", lambda: policy.save_hf(model, tokenizer, os.path.join(root, "nonfinite_model"), rank, step=4)),
    ):
        try:
            write()
        except safe_write.NonFiniteError as e:
            messages[name] = str(e)
    with torch.no_grad():
        param.to_local().copy_(kept)

    # a file the save writes points at /dev/full: every rank fails, naming it and the full disk
    full = os.path.join(root, "devfull")
    saver = checkpoint.Checkpointer(full)
    saver.save(1, model, optimizer, {"config": config}, tokenizer)
    if rank == 0:
        os.symlink("/dev/full", os.path.join(full, checkpoint.TRACKER + ".tmp"))
    dist.barrier()
    try:
        saver.save(2, model, optimizer, {"config": config}, tokenizer)
    except safe_write.WriteError as e:
        messages["devfull"] = str(e)

    # a LoRA checkpoint: rank 8 on q_proj and v_proj
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    fully_shard(adapted)
    lora_optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-3)
    train_step(adapted, lora_optimizer)
    checkpoint.Checkpointer(os.path.join(root, "lora")).save(1, adapted, lora_optimizer, {"config": config}, tokenizer)
    with open(os.path.join(root, f"messages_rank{rank}.json"), "w") as f:
        json.dump(messages, f)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The directories SAVE_AND_LOAD leaves under <root>, saved by 2 ranks."""
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    root = tmp_path_factory.mktemp("saved")
    model_dir = build_tiny_model(str(root / "model"), TASK_WORDS, hidden=64, intermediate=128)
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
    assert integrity.problem_with(checkpoint.step_dir(saved / "async", 3)) is None
    assert not [d for d in os.listdir(saved / "async") if d.endswith(".tmp")]


def test_shards_hold_only_tensors_and_the_rest_is_json(saved):
    step = checkpoint.step_dir(saved / "run", 2)
    index = integrity.read_index(os.path.join(step, "shards", ".metadata"))
    assert {type(entry).__name__ for entry in index.state_dict_metadata.values()} == {"TensorStorageMetadata"}
    assert any(fqn.startswith("optim.state.") and fqn.endswith(".exp_avg_sq") for fqn in index.state_dict_metadata)
    with open(os.path.join(step, integrity.NON_TENSORS)) as f:
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
        integrity.read_index(index)
    assert f"refers to ({module!r}, {name!r})" in integrity.problem_with(checkpoint.step_dir(run, 2))
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
        dcp.load({"w": torch.zeros(1)}, storage_reader=integrity.SafeReader(shards), no_dist=True)
    # and a checkpoint holding one is skipped before anything reads it
    assert integrity.problem_with(checkpoint.step_dir(run, 2)).startswith(
        "the shards hold pickled objects (w), which we never load"
    )
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    with pytest.raises(SystemExit, match="cannot export: the shards hold pickled objects"):
        export.export(checkpoint.step_dir(run, 2), str(tmp_path / "exported"))
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
        (integrity.NON_TENSORS, lambda p: b'{"optim": ', f"{integrity.NON_TENSORS} is unreadable (JSONDecodeError"),
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
    assert integrity.problem_with(checkpoint.step_dir(run, 2)).startswith(problem)
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

    export.write_hf(first, model.config, model.generation_config, None, str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"])
    # a write that fails: the previous model stays whole, and the unfinished copy is removed
    with pytest.raises(
        safe_write.WriteError, match=f"writing the model {out}: writing {out}.tmp failed: OSError: disk full"
    ):
        export.write_hf(second, model.config, model.generation_config, BrokenTokenizer(), str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"]) and not os.path.exists(f"{out}.tmp")
    os.rename(out, f"{out}.old")  # a crash between the two renames: the previous model is put back
    with pytest.raises(OSError, match="disk full"):
        export.write_hf(second, model.config, model.generation_config, BrokenTokenizer(), str(out))
    assert torch.equal(weights(), first["model.embed_tokens.weight"])
    export.write_hf(second, model.config, model.generation_config, None, f"{out}/")  # replaced only now
    assert torch.equal(weights(), second["model.embed_tokens.weight"])
    assert sorted(os.listdir(tmp_path)) == ["final_model"]  # no .tmp or .old left behind
    assert torch.equal(
        AutoModelForCausalLM.from_pretrained(out).state_dict()["lm_head.weight"], second["model.embed_tokens.weight"]
    )


# ----------------------------------------------------------------------------------------------
# Checksums: a changed or foreign file is found, naming it


def reseal(step_path):
    """Write checksums.json again, as if the edited checkpoint had been saved that way: for tests
    that change a checkpoint on purpose and want another check to catch it."""
    with open(os.path.join(step_path, "trainer_state.json")) as f:
        integrity.write_checksums(step_path, json.load(f)["step"])


def test_every_file_of_a_checkpoint_has_a_checksum_and_the_step(saved):
    for step_path, step in ((checkpoint.step_dir(saved / "run", 2), 2), (checkpoint.step_dir(saved / "async", 3), 3)):
        with open(os.path.join(step_path, integrity.CHECKSUMS)) as f:
            checksums = json.load(f)
        on_disk = {
            os.path.relpath(os.path.join(root, name), step_path)
            for root, _, names in os.walk(step_path)
            for name in names
        }
        assert checksums["step"] == step and set(checksums["files"]) == on_disk - {integrity.CHECKSUMS}
        shards = {rel for rel in on_disk if rel.endswith(".distcp")}
        assert shards == {
            "shards/__0_0.distcp",
            "shards/__1_0.distcp",
        }  # both ranks' shards, saved in the background too
        assert all("records_blake2b" in checksums["files"][rel] for rel in shards)


def flip(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def tensor_bytes(step_path, fqn):
    """(shard file, offset) of the middle byte of the tensor `fqn`'s data in rank 0's shard."""
    index = integrity.read_index(os.path.join(step_path, "shards", ".metadata"))
    info = min((info for key, info in index.storage_data.items() if key.fqn == fqn), key=lambda i: i.relative_path)
    shard = os.path.join(step_path, "shards", info.relative_path)
    with open(shard, "rb") as f:
        f.seek(info.offset)
        entry = f.read(info.length)
    with zipfile.ZipFile(io.BytesIO(entry)) as z:
        (data,) = [i for i in z.infolist() if "/data/" in i.filename]
    # the record's bytes follow its local header: 30 bytes, the name, the extra field (torch's alignment)
    header = entry[data.header_offset : data.header_offset + 30]
    start = data.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return shard, info.offset + start + data.file_size // 2


@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_flipped_bytes_inside_a_shard_are_found(run, capsys, mask):
    # before: the shard kept its length and every entry still loaded as a tensor, so the run resumed
    # from it with other weights
    step_path = checkpoint.step_dir(run, 2)
    shard, offset = tensor_bytes(step_path, "model.model.embed_tokens.weight")
    size = os.path.getsize(shard)
    flip(shard, offset, mask)
    flip(shard, offset + 64, mask)
    assert os.path.getsize(shard) == size
    problem = integrity.problem_with(step_path)
    name = os.path.basename(shard)
    assert problem.startswith(f"shard {name} is corrupt: model.model.embed_tokens.weight at byte ")
    assert problem.endswith("does not match its CRC-32"), problem
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    assert f"resume: skipping {step_path}: shard {name} is corrupt" in capsys.readouterr().out


def test_a_number_changed_in_a_json_file_is_found(run):
    step_path = checkpoint.step_dir(run, 2)
    state_file = os.path.join(step_path, integrity.NON_TENSORS)
    text = open(state_file).read()
    open(state_file, "w").write(text.replace('"lr": 0.001', '"lr": 0.002'))  # still valid JSON, same length
    assert integrity.problem_with(step_path) == (
        f"{integrity.NON_TENSORS} does not match its checksum in {integrity.CHECKSUMS}: it changed after the save"
    )


@pytest.mark.parametrize(
    "copied, problem",
    [
        (
            ["shards/__1_0.distcp"],
            "shard __1_0.distcp does not match its checksum in checksums.json: it was written by another save",
        ),
        (
            ["shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata"],
            "shards/.metadata does not match its checksum",
        ),
        (
            ["shards", "checksums.json"],
            "checksums.json is unreadable (ValueError: it is for step 1, and trainer_state.json for step 2)",
        ),
        (
            ["trainer_state.json", "checksums.json"],
            "trainer_state.json is unreadable (ValueError: it is for step 1, not 2)",
        ),
    ],
)
def test_files_copied_from_another_step_are_found(run, capsys, copied, problem):
    # before: step 1's shards (the same sizes) in step 2's directory resumed "from global_step_2"
    for rel in copied:
        src, dst = checkpoint.step_dir(run, 1) + "/" + rel, checkpoint.step_dir(run, 2) + "/" + rel
        if os.path.isdir(src):
            shutil.rmtree(dst)
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
    assert integrity.problem_with(checkpoint.step_dir(run, 2)).startswith(problem)
    assert checkpoint.find_checkpoint(str(run), "auto") == checkpoint.step_dir(str(run), 1)
    assert f"resume: skipping {checkpoint.step_dir(run, 2)}: {problem}" in capsys.readouterr().out


def test_a_checkpoint_from_before_checksums_is_accepted_with_a_warning(run, capsys):
    step_path = checkpoint.step_dir(run, 2)
    os.remove(os.path.join(step_path, integrity.CHECKSUMS))
    assert integrity.problem_with(step_path) == "checksums.json is missing"  # this save promised one
    state_file = os.path.join(step_path, "trainer_state.json")
    state = json.load(open(state_file))
    del state["checksums"]
    json.dump(state, open(state_file, "w"))
    assert integrity.problem_with(step_path) is None
    assert f"{step_path}: no checksums.json (saved before checkpoints had checksums)" in capsys.readouterr().out
    shard, offset = tensor_bytes(step_path, "model.model.embed_tokens.weight")
    flip(shard, offset)  # its records' CRC-32s still catch a flipped byte
    assert integrity.problem_with(step_path).endswith("does not match its CRC-32")


# ----------------------------------------------------------------------------------------------
# What is never saved, and saves that fail


def messages(saved):
    return [json.load(open(saved / f"messages_rank{r}.json")) for r in (0, 1)]


def test_inf_in_one_ranks_shard_is_refused_on_every_rank_and_nothing_is_written(saved):
    # before: the save wrote the inf into global_step_4, and save_hf into a model that loaded
    for m in messages(saved):
        assert m["save"].startswith(
            f"not saving {checkpoint.step_dir(saved / 'nonfinite', 4)}: model.model.norm.weight holds inf or NaN values"
        )
        assert "Nothing was written" in m["save"] and "smaller --lr" in m["save"]
        assert m["save_hf"].startswith(f"not saving {saved / 'nonfinite_model'}: model.norm.weight holds inf or NaN")
    assert not os.path.exists(saved / "nonfinite")  # not even its directory
    assert not [d for d in os.listdir(saved) if d.startswith("nonfinite_model")]


def test_write_hf_refuses_a_nan(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved / "model", dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    with pytest.raises(safe_write.NonFiniteError, match=r"model.layers.1.mlp.up_proj.weight holds inf or NaN"):
        export.write_hf(state, model.config, model.generation_config, None, str(tmp_path / "model"))
    assert os.listdir(tmp_path) == []


def test_a_save_onto_a_full_disk_names_the_file_and_the_previous_checkpoint_stays(saved):
    # before: the error was torch's "[enforce fail at inline_container.cc:672] unexpected pos" or a
    # bare "[Errno 28]", with the checkpoint's .tmp left behind
    full = saved / "devfull"
    tracker = os.path.join(full, checkpoint.TRACKER)
    for m in messages(saved):
        assert m["devfull"].startswith(
            f"saving {checkpoint.step_dir(full, 2)}: writing {tracker}.tmp failed: no space left on device"
        )
        assert "Free some space on that disk" in m["devfull"] and "run the same command again" in m["devfull"]
        assert f"(this save's unfinished {checkpoint.step_dir(full, 2)}.tmp is removed)" in m["devfull"]
    assert sorted(os.listdir(full)) == ["global_step_1", checkpoint.TRACKER, checkpoint.TRACKER + ".tmp"]
    assert open(tracker).read() == "1" and checkpoint.find_checkpoint(str(full), "auto") == checkpoint.step_dir(full, 1)


# ----------------------------------------------------------------------------------------------
# A full disk, for real: a small tmpfs in a mount namespace of its own (skipped where none can be made)

FILL_THE_DISK = textwrap.dedent(
    """
    import json, os, shutil, subprocess, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import checkpoint, integrity, policy, safe_write

    model_dir, disk, results = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    tokenizer, config = AutoTokenizer.from_pretrained(model_dir), {"model": model_dir}
    run = os.path.join(disk, "run")
    saver = checkpoint.Checkpointer(run)
    saver.save(1, model, optimizer, {"config": config}, tokenizer)
    background = checkpoint.Checkpointer(os.path.join(disk, "async"), async_save=True)
    filler = os.path.join(disk, "filler")
    if rank == 0:  # leave 250 kB: room for a checkpoint's JSON files (110 kB), not its shards or a model
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(disk).free - 250_000)
    dist.barrier()
    out = {}
    for name, write in (
        ("save", lambda: saver.save(2, model, optimizer, {"config": config}, tokenizer)),
        ("save_hf", lambda: policy.save_hf(model, tokenizer, os.path.join(disk, "final_model"), rank, step=1)),
        ("async", lambda: background.save(2, model, optimizer, {"config": config}, tokenizer)),
        ("async_wait", lambda: background.wait()),  # a background save fails when it is completed
    ):
        try:
            write()
        except safe_write.WriteError as e:
            out[name] = str(e)
    if rank == 0:
        cmd = [sys.executable, "export.py", checkpoint.step_dir(run, 1), os.path.join(disk, "exported")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        out["export"] = [proc.returncode, proc.stderr]
        tracker = open(os.path.join(run, checkpoint.TRACKER)).read()
        out["listing"] = [sorted(os.listdir(disk)), sorted(os.listdir(run)), tracker]
        out["resume"] = checkpoint.find_checkpoint(run, "auto")
        os.remove(filler)  # space again: the same save works
    dist.barrier()
    saver.save(2, model, optimizer, {"config": config}, tokenizer)
    policy.save_hf(model, tokenizer, os.path.join(disk, "final_model"), rank, step=2)
    out["after"] = [sorted(os.listdir(disk)), integrity.problem_with(checkpoint.step_dir(run, 2))]
    with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    """
)


def small_disk_command(mount_point, size):
    """A command prefix that runs what follows with a `size` tmpfs at mount_point, in a mount namespace
    of its own (it disappears with the command), or None where this machine cannot make one."""
    if shutil.which("unshare") is None:
        return None
    prefix = ["unshare", "--mount", "--map-root-user"] if os.geteuid() != 0 else ["unshare", "--mount"]
    probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mount_point}"])
    if probe.returncode != 0:
        return None
    return [*prefix, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs {mount_point} && exec "$@"', "sh"]


@pytest.mark.slow
def test_saves_and_exports_onto_a_really_full_disk_say_so_and_leave_nothing_half_written(saved, tmp_path):
    disk, results = tmp_path / "disk", tmp_path / "results"
    disk.mkdir()
    results.mkdir()
    prefix = small_disk_command(disk, "8m")
    if prefix is None:
        pytest.skip("cannot mount a tmpfs in a mount namespace here (unshare or mount refused)")
    (tmp_path / "fill.py").write_text(FILL_THE_DISK)
    cmd = [
        *prefix,
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc_per_node=2".split(),
        str(tmp_path / "fill.py"),
        str(saved / "model"),
        str(disk),
        str(results),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO)
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = [json.load(open(results / f"rank{r}.json")) for r in (0, 1)]
    run = disk / "run"
    for o in out:  # every rank says what happened, where, and what to do
        # torch's zip writer says only "unexpected pos" here
        shards = os.path.join(checkpoint.step_dir(run, 2) + ".tmp", "shards")
        assert o["save"].startswith(f"saving {checkpoint.step_dir(run, 2)}: writing {shards} failed")
        assert "failed: no space left on device" in o["save"] and "Free some space" in o["save"]
        assert f"resumes from the newest complete checkpoint in {run}" in o["save"]
        assert o["save_hf"].startswith(f"writing the model {disk / 'final_model'}: writing {disk / 'final_model'}.tmp")
        assert "failed: no space left on device" in o["save_hf"] and "python export.py" in o["save_hf"]
        assert "async" not in o, o["async"]  # the background save fails in the background...
        shards = os.path.join(checkpoint.step_dir(disk / "async", 2) + ".tmp", "shards")
        assert o["async_wait"].startswith(f"saving {checkpoint.step_dir(disk / 'async', 2)}: writing {shards} failed")
        assert "no space left on device" in o["async_wait"]  # ...and says so when it is completed
    rc, stderr = out[0]["export"]
    last = stderr.strip().splitlines()[-1]  # after transformers' progress bars
    assert rc == 1 and last.startswith(f"writing the model {disk / 'exported'}: writing {disk / 'exported'}.tmp")
    assert "no space left on device" in last and "Traceback" not in stderr
    # nothing half-written is left, and step 1 is still the checkpoint to resume from
    assert out[0]["listing"] == [["async", "filler", "run"], ["global_step_1", checkpoint.TRACKER], "1"]
    assert out[0]["resume"] == checkpoint.step_dir(str(run), 1)
    assert out[0]["after"] == [["async", "final_model", "run"], None]


# ----------------------------------------------------------------------------------------------
# A final model is complete, or a finished run can tell it is not


KILL_DURING_EXPORT = textwrap.dedent(
    """
    import os, signal, sys
    import export

    class KilledWhileWriting:  # the weights are written; the process dies writing the tokenizer
        def save_pretrained(self, path):
            os.kill(os.getpid(), signal.SIGKILL)

    from transformers import AutoConfig, GenerationConfig
    from safetensors.torch import load_file

    model_dir, out = sys.argv[1], sys.argv[2]
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    config, generation = AutoConfig.from_pretrained(model_dir), GenerationConfig.from_pretrained(model_dir)
    export.write_hf(state, config, generation, KilledWhileWriting(), out, step=2)
    """
)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export() runs dcp in this one process
def test_a_kill_during_the_final_export_is_told_and_repaired(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved / "run", run)
    newest = checkpoint.step_dir(str(run), 2)
    assert export.final_model_problem(str(run), newest) == f"{run / 'final_model'} is missing"
    (tmp_path / "kill.py").write_text(KILL_DURING_EXPORT)
    for attempt in range(2):  # killed with no final model, then with an older one in place
        cmd = [sys.executable, str(tmp_path / "kill.py"), str(saved / "model"), str(run / "final_model")]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
        assert proc.returncode == -9, proc.stderr[-3000:]
        assert os.path.isdir(run / "final_model.tmp") and os.path.isfile(run / "final_model.tmp" / "model.safetensors")
        assert export.final_model_problem(str(run), newest) == (
            f"{run / 'final_model'}.tmp is a final model whose writing was interrupted"
        )
        if attempt == 0:
            assert not os.path.exists(run / "final_model")
            export.export(checkpoint.step_dir(str(run), 1), str(run / "final_model"))  # an earlier end of the run
            assert export.final_model_problem(str(run), newest) == (
                f"{run / 'final_model'} holds step 1, and the newest checkpoint, {newest}, step 2"
            )
    export.export(newest, str(run / "final_model"))  # what a finished run does about it
    assert export.final_model_problem(str(run), newest) is None
    assert sorted(d for d in os.listdir(run) if d.startswith("final_model")) == ["final_model"]
    assert json.load(open(run / "final_model" / export.MODEL_STEP)) == {"step": 2}


# ----------------------------------------------------------------------------------------------
# LoRA: a checkpoint continues only with the rank and target modules it was saved with


def test_a_lora_checkpoint_of_another_rank_is_refused_before_loading(saved):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint.step_dir(str(saved / "lora"), 1)
    assert integrity.problem_with(path) is None
    for r, targets in ((16, ["q_proj", "v_proj"]), (8, ["q_proj", "k_proj", "v_proj"])):
        model = AutoModelForCausalLM.from_pretrained(saved / "model", dtype=torch.float32)
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=targets))
        tensors = {"model": {n: p for n, p in model.named_parameters() if p.requires_grad}}
        with pytest.raises(SystemExit) as error:
            checkpoint.check_shapes(path, tensors, model)
        message = str(error.value)
        assert message.startswith(f"{path} does not fit this model: ")
        assert (
            f"It holds LoRA adapters of rank 8 on ['q_proj', 'v_proj'], and this run makes rank {r} on {sorted(targets)}"
            in message
        )
        assert "resume with --lora-rank 8 and the same --lora-target-modules" in message
        if r == 16:
            assert (
                "tensors differ in shape, e.g. model.base_model.model.model.layers.0.self_attn.q_proj.lora_A" in message
            )
        else:
            assert (
                "it lacks 4 of this run's tensors, e.g. model.base_model.model.model.layers.0.self_attn.k_proj"
                in message
            )


@pytest.mark.parametrize("flag, then, now", [("lora_rank", 8, 16), ("lora_target_modules", "all-linear", "q_proj")])
def test_check_run_dir_refuses_other_lora_shapes_even_when_allowed(run, tmp_path, flag, then, now):
    step_path = checkpoint.step_dir(str(run), 2)
    state_file = os.path.join(step_path, "trainer_state.json")
    state = json.load(open(state_file))
    saved_config = dict(state["config"], lora_rank=8, lora_target_modules="all-linear")
    json.dump(dict(state, config=saved_config), open(state_file, "w"))
    reseal(step_path)
    config = dict(saved_config, **{flag: now})
    for out_dir, resume in ((str(run), "auto"), (str(tmp_path / "new_run"), step_path)):
        with pytest.raises(SystemExit) as error:
            run_dir.check_run_dir(out_dir, resume, config, allow_changed={flag})
        message = str(error.value)
        assert message.startswith(f"{step_path} cannot continue with other LoRA shapes:")
        assert f"--{flag.replace('_', '-')}: {then!r} there, {now!r} now" in message
        assert "not even --allow-changed" in message and f"--{flag.replace('_', '-')} {then}" in message
    assert run_dir.check_run_dir(str(run), "auto", saved_config) == step_path  # the same shapes continue


# ----------------------------------------------------------------------------------------------
# Export runs no code from the checkpoint

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "evil"
"""


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_export_refuses_a_config_that_names_code_even_when_told_yes(run, tmp_path, file):
    # before: AutoConfig.from_pretrained asked "Do you wish to run the custom code? [y/N]", and ran it on "y"
    step_path = checkpoint.step_dir(str(run), 2)
    marker, hf = tmp_path / "ran", os.path.join(step_path, "hf")
    with open(os.path.join(hf, "evil.py"), "w") as f:
        f.write(EVIL.format(marker=str(marker)))
    config = json.load(open(os.path.join(hf, file)))
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilConfig", None]}
    if file == "config.json":
        config["model_type"] = "evil"
    json.dump(config, open(os.path.join(hf, file), "w"))
    reseal(step_path)  # so that only the code check stands in the way
    assert integrity.problem_with(step_path) is None
    cmd = [sys.executable, "export.py", step_path, str(tmp_path / "exported")]
    proc = subprocess.run(cmd, cwd=REPO, input="y\ny\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and not os.path.exists(marker)
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"{os.path.join(hf, file)} names custom code to run (auto_map: ")
    )
    assert "never runs code from a model or checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "exported")
