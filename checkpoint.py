"""Checkpoints: exact resume after a crash, atomic sharded saves, retention, and export.

    <out-dir>/global_step_N/                  one complete checkpoint
        shards/                               the tensors of policy + optimizer, torch.distributed.checkpoint:
                                              every rank writes its own shards, none gathers them
        non_tensor_state.json                 the rest of that state, as JSON: AdamW's param_groups (lr, betas, ...)
        rng_rank{r}.json                      every random generator of rank r
        trainer_state.json                    step, LR scheduler, config, metric history
        hf/                                   model config and tokenizer, for export
        checksums.json                        the step, and the size and checksum of every file above
    <out-dir>/latest_checkpointed_iteration.txt    the newest complete step (verl's tracker name)
    <out-dir>/run.lock                        held (flock) by the run writing here: one writer at a time
    <out-dir>/final_model/, best_model/       Hugging Face format (write_hf), with grpo_step.json: the step

A run directory holds one run: check_run_dir refuses a resume with other training flags (unless
--allow-changed, and never for the flags that shape the tensors: SHAPES), and --resume never over an
existing run, before anything in it is written.

A checkpoint is written as global_step_N.tmp/ and renamed only when every rank has finished, then
the tracker is replaced atomically: a crash mid-save leaves the previous checkpoint in charge. So
does a save that fails: a full disk raises WriteError on every rank ("no space left on device", the
path, what to do) and the partial .tmp is removed. A model or optimizer state holding inf or NaN is
never saved (NonFiniteError), nor exported. The data loader needs no state of its own: the order of
prompts is a function of (seed, epoch) and the step says where in it we are. The rollout's sampling
seeds are a function of (seed, step).

    python checkpoint.py export runs/grpo/global_step_200 my_model   # -> Hugging Face format

An exported model (final_model too) is written aside and renamed into place when complete; its
grpo_step.json says which step it holds, so a run that finished can tell a final model that its
last save did not complete (final_model_problem).

With LoRA (lora.py) a checkpoint holds only what trains: the adapters and their optimizer state,
plus hf/adapter_config.json and the base weights' fingerprint; the base comes from --model again.

Loading a checkpoint runs no code from it. Reading a pickle can call any function the pickle names,
so: everything but tensors is JSON; the shards hold only tensors, read with
torch.load(weights_only=True), and a shard entry that is a pickled object is refused, not loaded;
torch's index file (shards/.metadata, a pickle) goes through an unpickler that admits an exact list
of torch's checkpoint classes; export passes trust_remote_code=False to transformers and refuses a
config that names code (auto_map). Before resuming we read every file of the checkpoint and check it
against checksums.json: a partial, corrupt or foreign one (a shard copied from another step) is
skipped with a message naming the file, and if none is good the run refuses to start rather than
silently starting over.
"""

import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import zipfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

import lora

TRACKER = "latest_checkpointed_iteration.txt"
NON_TENSORS = "non_tensor_state.json"
CHECKSUMS = "checksums.json"
MODEL_STEP = "grpo_step.json"  # in an exported model: the step its weights are from


def step_dir(out_dir, step):
    return os.path.join(out_dir, f"global_step_{step}")


def crash_point(where, step):
    """For the crash tests: GRPO_CRASH_AT=where:step makes this process kill itself (SIGKILL) there."""
    if os.environ.get("GRPO_CRASH_AT") == f"{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# Random generators: plain JSON, one file per rank


def rng_state():
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state):
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def check_rng_state(state):
    """Raise if `state` cannot be restored. The generators themselves are the best judges of what a
    valid state is, so we try it on them and put ours back."""
    ours = rng_state()
    try:
        set_rng_state(state)
    finally:
        set_rng_state(ours)


# ----------------------------------------------------------------------------------------------
# Tensors go to the shards, everything else to JSON


def split_tensors(tree):
    """Nested dicts -> (tensors, everything else), both keeping the nesting. torch.distributed.checkpoint
    would pickle a non-tensor (the optimizer's param_groups) into the shards, and reading a pickle can
    run code; JSON cannot."""
    tensors, plain = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value_tensors, value_plain = split_tensors(value)
            if value_tensors:
                tensors[key] = value_tensors
            if value_plain:
                plain[key] = value_plain
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def join_tensors(tensors, plain):
    """split_tensors undone."""
    joined = dict(tensors)
    for key, value in plain.items():
        joined[key] = join_tensors(joined.get(key, {}), value) if isinstance(value, dict) else value
    return joined


def restore_tuples(value, live):
    """JSON has no tuples: make `value` a tuple wherever `live` (the state we load into) has one, so
    AdamW's betas come back as the tuple they were."""
    if isinstance(live, tuple):
        return tuple(value)
    if isinstance(value, list) and isinstance(live, list) and len(value) == len(live):
        return [restore_tuples(v, w) for v, w in zip(value, live)]
    if isinstance(value, dict) and isinstance(live, dict):
        return {k: restore_tuples(v, live.get(k)) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------
# What is never saved, and a failed write that says why


class NonFiniteError(ValueError):
    """A tensor to be saved holds an inf or a NaN: the training has diverged, and a checkpoint or a
    model of it would only carry the damage on."""


class WriteError(OSError):
    """A checkpoint or a model could not be written. The message names the path, the cause ("no
    space left on device" when the disk is full) and what to do."""


def flat_items(tree, prefix=""):
    """(dotted name, leaf) of nested dicts, in order: the names torch.distributed.checkpoint gives them."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def first_nonfinite(named):
    """The name of the first of `named` ((name, tensor) pairs) that holds an inf or a NaN, else None.
    One reduction per tensor and no copy: torch.aminmax, whose min and max are both finite only if
    every element is (a NaN propagates through both). A DTensor (FSDP2) is checked on this rank's
    shard: check_finite agrees over ranks."""
    names, extremes = [], []
    for name, t in named:
        t = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            names.append(name)
            extremes.append(torch.stack(torch.aminmax(t.detach())).float())
    if not extremes:
        return None
    finite = torch.empty(len(extremes), dtype=torch.bool)  # [tensors]
    on = {}  # device -> indices: with --offload the optimizer's states are in CPU memory, the weights on the GPU
    for i, e in enumerate(extremes):
        on.setdefault(e.device, []).append(i)
    for idx in on.values():  # one device sync per device
        finite[idx] = torch.stack([extremes[i] for i in idx]).isfinite().all(dim=1).cpu()
    return None if finite.all() else names[int((~finite).nonzero()[0])]


def nonfinite_error(name, what, todo):
    return NonFiniteError(
        f"not saving {what}: {name} holds inf or NaN values (the first tensor that does), so the training "
        f"has diverged. Nothing was written. {todo}"
    )


def check_finite(named, what, todo):
    """Raise NonFiniteError naming the first tensor that holds an inf or a NaN. With a process group
    it is a collective: each rank checks its own shards and every rank raises, so that none is left
    waiting in the save's next collective. `named` lists the same names in the same order on every
    rank (a state dict's keys and named_parameters do)."""
    named = list(named)
    bad = first_nonfinite(named)
    if dist.is_initialized() and dist.get_world_size() > 1:
        order = {name: i for i, (name, _) in enumerate(named)}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)
        bad = min((b for b in everyone if b is not None), key=lambda b: order.get(b, len(order)), default=None)
    if bad is not None:
        raise nonfinite_error(bad, what, todo)


def free_bytes(path):
    """Bytes free for us on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return float("inf")


def causes(error):
    """`error` and every exception inside it: its causes and contexts, and the per-rank failures that
    torch.distributed.checkpoint's CheckpointException carries."""
    stack, seen = [error], []
    while stack:
        e = stack.pop()
        if isinstance(e, BaseException) and all(e is not s for s in seen):
            seen.append(e)
            failures = getattr(e, "failures", None) if isinstance(e, dcp.CheckpointException) else None
            stack += [e.__cause__, e.__context__, *(f[0] for f in (failures or {}).values())]
    return seen


def out_of_space(error, path):
    """Whether `error`, raised while writing `path`, means the disk (or a quota) is full: an ENOSPC or
    EDQUOT anywhere in it, or else less than 1 MiB left on path's filesystem. The last test is needed
    because torch's zip writer reports a failed write as "unexpected pos", without the errno."""
    for e in causes(error):
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            return True
    return free_bytes(path) < 2**20


def write_error(error, path, what, todo):
    """A WriteError for `error`, raised while `what` was writing `path`: names the path, says "no
    space left on device" when that is the cause, and what to do (`todo`, a sentence that can follow
    "then")."""
    if out_of_space(error, path):
        cause = f"no space left on device ({free_bytes(path) / 2**20:.0f} MiB free there)"
        todo = f"Free some space on that disk (or write to another one), then {todo}"
    else:
        inner = next((e for e in causes(error) if not isinstance(e, dcp.CheckpointException)), error)
        cause = f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0]}"  # torch adds C++ frames
        todo = f"Fix that, then {todo}"
    return WriteError(f"{what}: writing {path} failed: {cause}. {todo}")


def first_failure(error):
    """Collective: the first rank's failure, as an exception every rank can raise (this rank's own
    `error` if it failed), or None if every rank succeeded. Also a barrier. Without a process group
    of several ranks, `error` itself."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if error is None else (type(error).__name__, str(error)))
    failed = [e for e in everyone if e is not None]
    if error is not None or not failed:
        return error
    kind, message = failed[0]
    return (NonFiniteError if kind == NonFiniteError.__name__ else WriteError)(message)


# ----------------------------------------------------------------------------------------------
# Checksums: <checkpoint>/checksums.json holds the step and a checksum of every file
#
# torch.distributed.checkpoint writes each tensor with torch.save, a zip archive, and torch's zip
# writer computes a CRC-32 of every record as it writes (its reader never checks them). A shard
# file's checksum is built from those: the blake2b of every record's (name, size, CRC-32), read off
# the archives' directories at the end of each entry. That costs milliseconds, where hashing the
# shards again would cost about a fifth of the save (benchmarks/checkpoint_checksum.py).
# problem_with checks every record's bytes against its CRC-32 and the shard against checksums.json,
# which catches flipped bytes and a shard copied from another checkpoint. Any other file's checksum
# is the blake2b of its bytes.


def file_digest(path):
    """blake2b of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def entry_records(archive):
    """[name, size, CRC-32] of every record of one shard entry (a torch.save zip archive), as its
    directory lists them. `archive` is the whole entry, or an end of it that holds the directory."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return [[i.filename, i.file_size, i.CRC] for i in z.infolist()]


def records_digest(records):
    """A shard file's checksum: the blake2b of its entries' records (entry_records, in file order)."""
    return hashlib.blake2b(json.dumps(records).encode(), digest_size=16).hexdigest()


def entries_by_file(index):
    """{shard file: [(MetadataIndex, _StorageInfo) of each entry in it, in file order]} from the shards' index."""
    files = {}
    for key, info in index.storage_data.items():
        files.setdefault(str(info.relative_path), []).append((key, info))
    return {name: sorted(entries, key=lambda e: e[1].offset) for name, entries in sorted(files.items())}


def shard_checksum(path, entries):
    """records_digest of a shard file, read from the end of each entry only (its zip directory)."""
    records = []
    with open(path, "rb") as f:
        for _, info in entries:
            tail = min(info.length, 1 << 16)
            f.seek(info.offset + info.length - tail)
            try:
                records.append(entry_records(f.read(tail)))
            except zipfile.BadZipFile:  # a directory longer than the tail: read the whole entry
                f.seek(info.offset)
                records.append(entry_records(f.read(info.length)))
    return records_digest(records)


def write_checksums(ckpt, step):
    """Write <ckpt>/checksums.json: {"step": step, "files": {path: {"bytes", "blake2b" or
    "records_blake2b"}}} for every file of the checkpoint. One process calls it, once every rank's
    files are written and before the checkpoint is published."""
    shards = entries_by_file(read_index(os.path.join(ckpt, "shards", ".metadata")))
    files = {}
    for root, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, ckpt)
            if rel == CHECKSUMS:
                continue
            files[rel] = {"bytes": os.path.getsize(path)}
            if os.path.dirname(rel) == "shards" and name in shards:
                files[rel]["records_blake2b"] = shard_checksum(path, shards[name])
            else:
                files[rel]["blake2b"] = file_digest(path)
    with open(os.path.join(ckpt, CHECKSUMS), "w") as f:  # not fsync'ed, as the other JSON files: a lost one is
        json.dump({"step": step, "files": dict(sorted(files.items()))}, f, indent=1)  # found at resume


def read_checksums(path, step):
    """checksums.json of the checkpoint at `path`, checked to be for `step`: its "files" dict.
    Raises ValueError if it is not what write_checksums writes."""
    with open(os.path.join(path, CHECKSUMS)) as f:
        checksums = json.load(f)
    if not (isinstance(checksums, dict) and isinstance(checksums.get("files"), dict)):
        raise ValueError("expected a step and a dict of files")
    if checksums.get("step") != step:
        raise ValueError(f"it is for step {checksums.get('step')!r}, and trainer_state.json for step {step}")
    for rel, entry in checksums["files"].items():
        if (
            not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int))
            or os.path.isabs(rel)
            or ".." in rel.split(os.sep)
        ):
            raise ValueError(f"bad entry for {rel!r}")
    return checksums["files"]


# ----------------------------------------------------------------------------------------------
# Saving


def frozen_names(model):
    """Names of the parameters that do not train (every name of a shared tensor: a tied LM head)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state(model):
    """The model's sharded state dict without its frozen parameters: with LoRA, the adapters only
    (the base comes from --model, and would make the checkpoint 30x larger); the whole model otherwise.
    (torch's ignore_frozen_params keeps a tied LM head whose embedding is frozen, so we filter here.)"""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = frozen_names(model)
    return {k: v for k, v in get_model_state_dict(model).items() if k not in frozen}


class Checkpointer:
    """Saves every rank's shards of the policy and optimizer, plus the trainer state, atomically.

    With async_save the shards are copied to CPU memory and written in the background while
    training goes on. poll(), called once per step, publishes the checkpoint as soon as every rank's
    write is done; the next save (or wait(), at the end of training) completes it at the latest.

    A save never leaves a bad checkpoint in charge. A model or optimizer state that holds an inf or
    a NaN is refused before anything is written (NonFiniteError). A write that fails, on any rank,
    raises WriteError on every rank, naming the path, the cause ("no space left on device" when the
    disk is full) and what to do; the partial global_step_N.tmp is removed, and the previous
    checkpoint stays the newest.
    """

    def __init__(self, out_dir, keep=-1, async_save=False):
        self.out_dir, self.keep, self.async_save = out_dir, keep, async_save
        self.pending = None  # (future, step) of a background save
        # background writes run their collectives on a group of their own, not the training one.
        # poll() asks on a third: on the writers' group, its question from the main thread could be
        # paired with a writer thread's collective on another rank.
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.poll_group = dist.new_group(backend="gloo") if async_save else None
        if dist.get_rank() == 0 and os.path.isdir(out_dir):  # partial saves left by a crash
            for name in sorted(os.listdir(out_dir)):
                if name.startswith("global_step_") and name.endswith(".tmp"):
                    print(f"removing {os.path.join(out_dir, name)}, a checkpoint a crash left unfinished", flush=True)
                    shutil.rmtree(os.path.join(out_dir, name))
        dist.barrier()

    def save(self, step, model, optimizer, trainer_state, tokenizer=None):
        """Write checkpoint `step` of the (sharded) model and optimizer, with trainer_state: a
        collective. Without async_save it is published (renamed into place, the tracker updated)
        before this returns; with it, by poll() or wait(), where a failed background write raises."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self.wait()
        if not torch.serialization.get_crc32_options():
            raise RuntimeError(
                "torch.serialization.set_crc32_options(False) is in effect, but checkpoints need the CRC-32 "
                "torch.save stores for every record (checksums.json is built on them): remove that call"
            )
        rank, tmp = dist.get_rank(), step_dir(self.out_dir, step) + ".tmp"
        state = {"model": trainable_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
        tensors, plain = split_tensors(state)
        check_finite(
            flat_items(tensors), step_dir(self.out_dir, step), "Resume from the newest checkpoint with a smaller --lr."
        )
        error = None
        if rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash
                os.makedirs(tmp)
                with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                    # checksums: problem_with refuses this checkpoint without its checksums.json
                    json.dump(dict(trainer_state, step=step, world_size=dist.get_world_size(), checksums=True), f)
                model.config.save_pretrained(os.path.join(tmp, "hf"))
                model.generation_config.save_pretrained(os.path.join(tmp, "hf"))
                if lora.is_lora(model):  # what the adapters are; the base is --model
                    model.peft_config[lora.ADAPTER].save_pretrained(os.path.join(tmp, "hf"))
                if tokenizer is not None:
                    tokenizer.save_pretrained(os.path.join(tmp, "hf"))
                with open(os.path.join(tmp, NON_TENSORS), "w") as f:  # param_groups are the same on every rank
                    json.dump(plain, f)
            except Exception as e:
                error = e
        self._check(error, step, tmp)  # and a barrier: tmp exists
        try:
            with open(os.path.join(tmp, f"rng_rank{rank}.json"), "w") as f:
                json.dump(rng_state(), f)
        except Exception as e:
            error = e
        self._check(error, step, os.path.join(tmp, f"rng_rank{rank}.json"))
        shards = os.path.join(tmp, "shards")
        if self.async_save:
            self.pending = (dcp.async_save(tensors, checkpoint_id=shards, process_group=self.group), step)
            return
        try:
            dcp.save(tensors, checkpoint_id=shards)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
        self._check(error, step, shards)
        self._finish(step)

    def poll(self):
        """Publish a background save as soon as every rank has written its shards. Call it once per
        training step on every rank: it is a collective (a one-number all_reduce) while a save runs,
        and free otherwise. Without it, a crash before the next save would throw away a complete
        checkpoint as unfinished."""
        if self.pending is None:
            return
        done = torch.tensor([int(self.pending[0].done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.poll_group)  # 1 only if done on all ranks
        if done.item():
            self.wait()

    def wait(self):
        """Complete a background save, if one is running."""
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            error = None
            try:
                future.result()
            except (Exception, dcp.CheckpointException) as e:
                error = e
            self._check(error, step, os.path.join(step_dir(self.out_dir, step) + ".tmp", "shards"))
            self._finish(step)

    def _check(self, error, step, path):
        """Collective: if a write of checkpoint `step` failed on any rank (`error` here, at `path`),
        remove the partial directory and raise WriteError on every rank. Otherwise a barrier."""
        tmp, final = step_dir(self.out_dir, step) + ".tmp", step_dir(self.out_dir, step)
        original = error
        if error is not None:
            todo = (
                f"run the same command again: it resumes from the newest complete checkpoint in {self.out_dir} "
                f"(this save's unfinished {tmp} is removed)"
            )
            error = write_error(error, getattr(error, "filename", None) or path, f"saving {final}", todo)
        failure = first_failure(error)
        if failure is not None:
            if dist.get_rank() == 0:  # every rank has stopped writing into it
                shutil.rmtree(tmp, ignore_errors=True)
            raise WriteError(str(failure)) from original

    def _finish(self, step):
        crash_point("save", step)  # all shards written, not yet visible: the worst moment to die
        dist.barrier()  # every rank's shards are on disk
        final, tracker = step_dir(self.out_dir, step), os.path.join(self.out_dir, TRACKER)
        tmp, error, path = final + ".tmp", None, final + ".tmp"
        if dist.get_rank() == 0:
            try:  # everything that may fail to write, before the checkpoint is published
                write_checksums(tmp, step)
                path = tracker + ".tmp"
                with open(path, "w") as f:
                    f.write(str(step))
                    f.flush()
                    os.fsync(f.fileno())
                path = final
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                os.replace(tracker + ".tmp", tracker)
            except Exception as e:
                error = e
        self._check(error, step, path)
        if dist.get_rank() == 0 and self.keep > 0:  # older checkpoints go only now that a newer one is complete
            for old in sorted(saved_steps(self.out_dir))[: -self.keep]:
                shutil.rmtree(step_dir(self.out_dir, old), ignore_errors=True)
        dist.barrier()


def saved_steps(out_dir):
    """Steps of the global_step_N directories in out_dir (complete or not; .tmp ones excluded)."""
    if not os.path.isdir(out_dir):
        return []
    return [
        int(d.rsplit("_", 1)[1])
        for d in os.listdir(out_dir)
        if d.startswith("global_step_") and d.rsplit("_", 1)[1].isdigit()
    ]


# ----------------------------------------------------------------------------------------------
# Loading


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint stores its index (shards/.metadata) as a pickle, and a pickle can
    call any function it names. We admit exactly the names torch 2.13 writes there (read off a real
    .metadata with pickletools) and torch's dtypes. A dotted name is refused outright: protocol 4
    resolves ('torch.distributed.checkpoint.metadata', 'os.system') to os.system. A torch that writes
    a new class fails here, naming it; add it to ALLOWED if it is plain data."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),  # problem_with reports these
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # "torch.strided" -> torch.strided
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # the checkpoint's path when it was saved
    }

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." not in name and ((module, name) in self.ALLOWED or is_dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{self.path} refers to ({module!r}, {name!r}), which a checkpoint index never contains; not loading it"
        )


def read_index(path):
    """torch.distributed.checkpoint's index file, through the allow-list unpickler."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, path).load()


class SafeReader(FileSystemReader):
    """A FileSystemReader that unpickles nothing it does not know: the index goes through the
    allow-list, and shard entries are read only as tensors (torch.load(weights_only=True)). An entry
    stored as a pickled object, which torch's reader would torch.load with weights_only=False, is
    refused."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_index(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                shard = os.path.join(self.path, self.storage_data[item.storage_index].relative_path)
                raise pickle.UnpicklingError(
                    f"{shard}: {item.dest_index.fqn} is stored as a pickled object, not a tensor; not loading it"
                )
        return super().read_data(plan, planner)


def problem_with(path):
    """Why the checkpoint at `path` cannot be loaded, or None if it is complete and sound.

    We read every file a resume would read, shards included, so that a garbled file is found here,
    and skipped, rather than halfway through loading: each JSON file must parse, each shard entry
    must be a torch.save archive whose every record matches its CRC-32 and that loads as a tensor,
    and every file must match its size and checksum in checksums.json, which must be for this step.
    That reads the whole checkpoint once more on every rank, at resume only (about a second per GB on CPU).

    A checkpoint written before checkpoints had checksums.json is accepted with a warning: its
    shards are still checked against the CRC-32s torch stored in them, which catches flipped bytes,
    only a shard copied from another checkpoint goes unnoticed. Refusing it would strand every run
    that was saved before, with nothing to resume from but its own checkpoints. A checkpoint whose
    trainer_state.json says it has checksums and that lacks checksums.json is refused.
    """
    for name in (
        "trainer_state.json",
        NON_TENSORS,
        os.path.join("shards", ".metadata"),
        os.path.join("hf", "config.json"),
    ):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    name = "trainer_state.json"  # the file being read, for the message
    try:
        with open(os.path.join(path, name)) as f:
            state = json.load(f)
        if not (
            isinstance(state.get("step"), int)
            and isinstance(state.get("world_size"), int)
            and isinstance(state.get("config"), dict)
        ):
            raise ValueError("expected a step, a world_size and a config")
        named = re.fullmatch(r"global_step_(\d+)", os.path.basename(os.path.normpath(path)))
        if named and int(named[1]) != state["step"]:
            raise ValueError(f"it is for step {state['step']}, not {named[1]}")
        for name in (NON_TENSORS, os.path.join("hf", "config.json")):
            with open(os.path.join(path, name)) as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("expected a JSON object")
        name = os.path.join("shards", ".metadata")
        metadata = read_index(os.path.join(path, name))
        for r in range(state["world_size"]):
            name = f"rng_rank{r}.json"
            if not os.path.isfile(os.path.join(path, name)):
                return f"{name} is missing"
            with open(os.path.join(path, name)) as f:
                check_rng_state(json.load(f))
        name, checksums = CHECKSUMS, None
        if os.path.isfile(os.path.join(path, CHECKSUMS)):
            checksums = read_checksums(path, state["step"])
        elif state.get("checksums"):
            return f"{CHECKSUMS} is missing"
        else:
            print(
                f"{path}: no {CHECKSUMS} (saved before checkpoints had checksums): its shards are checked against "
                "torch's CRC-32s of their records, but nothing ties them to this checkpoint",
                flush=True,
            )
    except Exception as e:
        return f"{name} is unreadable ({type(e).__name__}: {e})"
    pickled = [fqn for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)]
    if pickled:
        return (
            f"the shards hold pickled objects ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}), which we never load"
            " (checkpoint.py used to write the optimizer's param_groups that way)"
        )
    shards = entries_by_file(metadata)
    for shard, entries in shards.items():  # every shard file long enough for what it should hold
        file = os.path.join(path, "shards", shard)
        if not os.path.isfile(file) or os.path.getsize(file) < max(i.offset + i.length for _, i in entries):
            return f"shard {shard} is missing or truncated"
    if checksums is not None:  # every file as it was written; the shards' records are checked below
        for shard in shards:
            if os.path.join("shards", shard) not in checksums:
                return f"shard {shard} is not in {CHECKSUMS}: it was not written by this checkpoint's save"
        for rel, entry in checksums.items():
            file = os.path.join(path, rel)
            if not os.path.isfile(file):
                return f"{rel} is missing"
            if os.path.getsize(file) != entry["bytes"]:
                return f"{rel} has {os.path.getsize(file)} bytes, {CHECKSUMS} says {entry['bytes']}"
            if "records_blake2b" not in entry and file_digest(file) != entry.get("blake2b"):
                return f"{rel} does not match its checksum in {CHECKSUMS}: it changed after the save"
    for shard, entries in shards.items():  # each entry a tensor whose records match their CRC-32s
        records = []
        with open(os.path.join(path, "shards", shard), "rb") as f:
            for index, info in entries:
                f.seek(info.offset)
                entry = f.read(info.length)
                where = f"shard {shard} is corrupt: {index.fqn} at byte {info.offset}"
                try:
                    records.append(entry_records(entry))
                    with zipfile.ZipFile(io.BytesIO(entry)) as z:
                        bad = z.testzip()
                except Exception as e:
                    return f"{where} is not a torch.save archive ({type(e).__name__}: {e})"
                if bad is not None:
                    return f"{where}: its record {bad} does not match its CRC-32"
                try:
                    tensor = torch.load(io.BytesIO(entry), map_location="cpu", weights_only=True)
                except Exception as e:
                    tensor = e
                if not isinstance(tensor, torch.Tensor):
                    return f"{where} is not a tensor ({type(tensor).__name__})"
        expected = None if checksums is None else checksums[os.path.join("shards", shard)].get("records_blake2b")
        if checksums is not None and records_digest(records) != expected:
            return (
                f"shard {shard} does not match its checksum in {CHECKSUMS}: it was written by another save "
                "(copied from another checkpoint?)"
            )
    return None


def find_checkpoint(out_dir, resume):
    """The checkpoint to resume from: None for a fresh start.

    resume="never": None. resume=PATH: that checkpoint, or an error saying what is wrong with it.
    resume="auto": the tracker's checkpoint; if it is partial or corrupt, say so and fall back to
    the newest good one. None if out_dir has no checkpoints; an error if it has some but none is
    good: starting over silently would overwrite the run.
    """
    if resume == "never":
        return None
    if resume != "auto":
        problem = problem_with(resume) if os.path.isdir(resume) else "no such directory"
        if problem:
            raise SystemExit(f"--resume {resume}: cannot resume from it: {problem}")
        return resume
    candidates = sorted(saved_steps(out_dir), reverse=True)
    if not candidates:
        return None
    tracker = os.path.join(out_dir, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, errors="replace") as f:
            text = f.read().strip()
        if text.isdigit() and int(text) in candidates:  # the newest complete step, unless a later run started over
            candidates = [int(text)] + [s for s in candidates if s != int(text)]
        else:
            print(
                f"resume: ignoring {tracker}: it says {text[:40]!r}, not the step of a checkpoint in {out_dir}",
                flush=True,
            )
    problems = []
    for step in candidates:
        problem = problem_with(step_dir(out_dir, step))
        if problem is None:
            return step_dir(out_dir, step)
        print(f"resume: skipping {step_dir(out_dir, step)}: {problem}", flush=True)
        problems.append(f"    {step_dir(out_dir, step)}: {problem}")
    raise SystemExit(
        f"--resume auto: {out_dir} has checkpoints, but none can be loaded:\n"
        + "\n".join(problems)
        + "\nRepair or remove them, pick one with --resume PATH, or start a new run with another --out-dir."
    )


# model config fields that decide the shapes of the weights and the optimizer state
MODEL_SHAPE = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def lora_targets(lora_config):
    """A LoraConfig's target modules, for a message: "all-linear", or their sorted names."""
    targets = lora_config.target_modules
    return sorted(targets) if isinstance(targets, (set, list, tuple)) else targets


def check_shapes(path, tensors, model):
    """Refuse, before loading, a checkpoint whose tensors do not fit the live ones (nested dicts of
    tensors, named as in the shards): one that lacks some, or holds them in other shapes. With LoRA
    that is another --lora-rank or --lora-target-modules, and the message names both sides'."""
    saved = read_index(os.path.join(path, "shards", ".metadata")).state_dict_metadata
    missing, reshaped = [], []
    for name, t in flat_items(tensors):
        if name not in saved:
            missing.append(name)
        elif tuple(getattr(saved[name], "size", ())) != tuple(t.shape):
            reshaped.append(f"{name}: {list(saved[name].size)} there, {list(t.shape)} now")
    if not (missing or reshaped):
        return
    problems = []
    if reshaped:
        problems.append(f"{len(reshaped)} tensors differ in shape, e.g. {reshaped[0]}")
    if missing:
        problems.append(f"it lacks {len(missing)} of this run's tensors, e.g. {missing[0]}")
    todo = "Resume with the flags it was saved with, or pass a new --out-dir for a new run."
    saved_lora = lora.read_config(os.path.join(path, "hf"))
    if saved_lora is not None and lora.is_lora(model):
        now = model.peft_config[lora.ADAPTER]
        todo = (
            f"It holds LoRA adapters of rank {saved_lora.r} on {lora_targets(saved_lora)}, and this run makes rank "
            f"{now.r} on {lora_targets(now)}: resume with --lora-rank {saved_lora.r} and the same "
            "--lora-target-modules, or pass a new --out-dir for a new run."
        )
    raise SystemExit(f"{path} does not fit this model: {'; '.join(problems)}. {todo}")


def load(path, model, optimizer, config):
    """Load a checkpoint into the (sharded) model and optimizer; returns its trainer state.

    Model and optimizer reshard to any number of ranks. A model of different shape is an error
    naming the fields that differ, and so, before anything is loaded, is a checkpoint whose tensors
    do not fit the live ones (check_shapes: LoRA adapters of another rank or target modules); other
    config changes are allowed and listed.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    with open(os.path.join(path, "hf", "config.json")) as f:
        saved_model = json.load(f)
    # a different model means different shapes; a moved directory or a renamed hub id does not
    now_model = model.config.to_dict()
    incompatible = {
        k: (saved_model.get(k), now_model.get(k)) for k in MODEL_SHAPE if saved_model.get(k) != now_model.get(k)
    }
    if incompatible:
        raise SystemExit(
            f"{path} was saved by an incompatible run: the model differs in "
            + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in incompatible.items())
            + f" (saved with --model {state['config']['model']}, now {config['model']})"
        )
    changed = sorted(k for k, v in config.items() if state["config"].get(k) != v)
    if changed:
        print(f"resume: config differs from the checkpoint's in {changed}; the new values apply", flush=True)
    saved_lora = os.path.isfile(os.path.join(path, "hf", "adapter_config.json"))
    if saved_lora != lora.is_lora(model):
        raise SystemExit(
            f"{path} holds {'LoRA adapters' if saved_lora else 'a fully fine-tuned model'}, and this run "
            f"{'trains LoRA adapters' if lora.is_lora(model) else 'fine-tunes the whole model'}"
        )
    live = {"model": trainable_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tensors, _ = split_tensors(live)  # filled in place from the shards
    check_shapes(path, tensors, model)
    dcp.load(tensors, storage_reader=SafeReader(os.path.join(path, "shards")))
    with open(os.path.join(path, NON_TENSORS)) as f:
        saved = join_tensors(tensors, restore_tuples(json.load(f), live))
    missing, _ = set_model_state_dict(model, saved["model"], options=StateDictOptions(strict=False))
    missing = set(missing) - frozen_names(model)  # the frozen base of LoRA comes from --model, not from here
    if missing:
        raise SystemExit(
            f"{path}: the checkpoint lacks {len(missing)} of the model's tensors, e.g. {sorted(missing)[:3]}"
        )
    set_optimizer_state_dict(model, optimizer, saved["optim"])
    rank_file = os.path.join(path, f"rng_rank{dist.get_rank()}.json")
    if state["world_size"] == dist.get_world_size():
        with open(rank_file) as f:
            set_rng_state(json.load(f))
    else:
        print(
            f"resume: saved with {state['world_size']} ranks, now {dist.get_world_size()}: weights reshard, random generators restart",
            flush=True,
        )
    return state


# ----------------------------------------------------------------------------------------------
# Export to Hugging Face format


def prepare_dir(out_dir):
    """Ready out_dir to be written aside and published (publish_dir); returns the directory to write,
    out_dir.tmp, made anew. Undoes what a crash left: an unfinished out_dir.tmp, and the previous
    out_dir still at out_dir.old (a crash between publish_dir's two renames)."""
    out_dir = os.path.normpath(out_dir)
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    if os.path.isdir(old) and not os.path.exists(out_dir):
        os.rename(old, out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def publish_dir(tmp, out_dir):
    """Put the complete directory `tmp` (from prepare_dir) in out_dir's place. out_dir is never
    partial: it is the previous one until the last rename, then the new one; in between, for the
    time of one rename, it is absent and the previous one is out_dir.old."""
    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir):
        os.rename(out_dir, out_dir + ".old")
    os.rename(tmp, out_dir)
    shutil.rmtree(out_dir + ".old", ignore_errors=True)


def write_hf(state_dict, config, generation_config, tokenizer, out_dir, step=None, dtype=torch.float32):
    """Write a full state dict as a Hugging Face model: safetensors with the weights in `dtype`
    (config.json's dtype says which), config, generation config, tokenizer with its chat template.
    Loadable by AutoModelForCausalLM.from_pretrained and vLLM.
    With `step` (the training step the weights are from), also out_dir/grpo_step.json, which
    final_model_problem reads.

    Weights that hold an inf or a NaN are refused (NonFiniteError) before anything is written. The
    model is written to out_dir.tmp and renamed to out_dir only when complete, so a crash mid-write
    never leaves a half-written model, nor deletes the previous one, under out_dir. A write that
    fails raises WriteError (the path; "no space left on device" when the disk is full) and removes
    out_dir.tmp; out_dir stays as it was."""
    from transformers import AutoModelForCausalLM

    out_dir = os.path.normpath(out_dir)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    bad = first_nonfinite(state_dict.items())  # after the cast: a weight past bf16's range would be inf
    if bad is not None:
        raise nonfinite_error(bad, out_dir, "Export an earlier checkpoint, or resume from one with a smaller --lr.")
    with torch.device("meta"):  # a skeleton of the right class, filled with the given tensors
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.load_state_dict(state_dict, assign=True, strict=False)
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    tmp = out_dir + ".tmp"
    try:
        prepare_dir(out_dir)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if step is not None:
            with open(os.path.join(tmp, MODEL_STEP), "w") as f:
                json.dump({"step": step}, f)
        publish_dir(tmp, out_dir)
    except Exception as e:
        todo = f"write it again from a checkpoint: python checkpoint.py export <out-dir>/global_step_N {out_dir}"
        error = write_error(e, getattr(e, "filename", None) or tmp, f"writing the model {out_dir}", todo)
        shutil.rmtree(tmp, ignore_errors=True)
        raise error from e


def check_no_code(model_dir):
    """Refuse a model or checkpoint directory whose config or tokenizer config names Python code to
    run (auto_map): loading it would run that code, and we never run code from a checkpoint."""
    for name in ("config.json", "tokenizer_config.json"):
        file = os.path.join(model_dir, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                auto_map = json.load(f).get("auto_map")
        except (ValueError, AttributeError) as e:
            raise SystemExit(f"{file} is not a JSON object ({e})") from None
        if auto_map:
            raise SystemExit(
                f"{file} names custom code to run (auto_map: {json.dumps(auto_map)}), and checkpoint.py never runs "
                "code from a model or checkpoint. If the model is a transformers architecture, remove auto_map from "
                "that file (and set model_type to the architecture's); otherwise export it with its own code."
            )


def export(checkpoint, out_dir, base=None, adapter_dir=None, dtype=None):
    """Checkpoint -> Hugging Face format, in one process, whatever number of ranks saved it. The
    weights are written in `dtype` ("bf16" or "fp32"; by default the run's compute dtype, its --dtype
    as trainer_state.json records it, as final_model would be).

    A LoRA checkpoint holds the adapters only: they are loaded onto the base model (`base`, by
    default the run's --model) and written twice, as a PEFT adapter directory at adapter_dir
    (default: out_dir + "_adapter") and then merged into a plain model at out_dir. The merged model
    is written last, with the checkpoint's step in grpo_step.json: its presence says both are complete.

    Runs no code from the checkpoint: every from_pretrained passes trust_remote_code=False, and a
    config that names code (auto_map) is refused. Raises WriteError or NonFiniteError as write_hf."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    problem = problem_with(checkpoint)
    if problem:
        raise SystemExit(f"{checkpoint}: cannot export: {problem}")
    hf = os.path.join(checkpoint, "hf")
    check_no_code(hf)
    no_code = dict(trust_remote_code=False)
    config, lora_config = AutoConfig.from_pretrained(hf, **no_code), lora.read_config(hf)
    has_tokenizer = os.path.isfile(os.path.join(hf, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(hf, **no_code) if has_tokenizer else None
    generation_config = GenerationConfig.from_pretrained(hf)  # plain JSON: it has no code to run
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    dtype = torch.bfloat16 if (dtype or state["config"].get("dtype")) == "bf16" else torch.float32
    shards = SafeReader(os.path.join(checkpoint, "shards"))
    if lora_config is None:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, **no_code)
        full = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in skeleton.state_dict().items()}}
        dcp.load(full, storage_reader=shards, no_dist=True)
        write_hf(full["model"], config, generation_config, tokenizer, out_dir, state["step"], dtype)
        print(f"exported {checkpoint} to {out_dir}")
        return
    base = base or state["config"]["model"]
    if os.path.isdir(base):
        check_no_code(base)
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **no_code)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"{checkpoint} holds LoRA adapters; their base model {base!r} does not load ({e}); pass --base DIR"
        ) from None
    from peft import get_peft_model

    model = get_peft_model(model, lora_config)
    lora.check_fingerprint(state.get("base_fingerprint"), lora.base_fingerprint(model), f"{checkpoint} on base {base}")
    adapters = {"model": {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}}
    dcp.load(adapters, storage_reader=shards, no_dist=True)
    model.load_state_dict(adapters["model"], strict=False)
    merged = dict(lora.merged_parameters(model, torch.float32))
    bad = first_nonfinite(merged.items())
    if bad is not None:
        raise nonfinite_error(bad, out_dir, "Export an earlier checkpoint, or resume from one with a smaller --lr.")
    adapter_dir = adapter_dir or os.path.normpath(out_dir) + "_adapter"
    try:
        lora.write_adapter(
            {k.replace(f".{lora.ADAPTER}.", "."): v for k, v in adapters["model"].items()}, lora_config, adapter_dir
        )
    except Exception as e:
        todo = f"run this export again: python checkpoint.py export {checkpoint} {out_dir}"
        raise write_error(
            e, getattr(e, "filename", None) or adapter_dir, f"writing the adapter {adapter_dir}", todo
        ) from e
    write_hf(merged, config, generation_config, tokenizer, out_dir, state["step"], dtype)
    print(f"exported {checkpoint}: the merged model to {out_dir}, the adapter to {adapter_dir}")


def final_model_problem(out_dir, checkpoint):
    """Why <out_dir>/final_model is not the export of `checkpoint` (the run's newest), or None if it is.

    For the start of a run that has finished: a crash while the final model was written leaves no
    final_model, or an unfinished final_model.tmp, or the final model of an earlier end of the run
    (before --max-steps was raised). The final model is written last, with the step of its weights
    in grpo_step.json (write_hf), so a final_model holding the checkpoint's step is complete, and so
    is a LoRA run's final_adapter when it is written before the final model (export() does that).
    To repair: export(checkpoint, final_model, adapter_dir=final_adapter), or save the loaded policy
    again (policy.save_hf)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    final = os.path.join(out_dir, "final_model")
    if os.path.isdir(final + ".tmp"):
        return f"{final}.tmp is a final model whose writing was interrupted"
    if not os.path.isdir(final):
        return f"{final} is missing"
    try:
        with open(os.path.join(final, MODEL_STEP)) as f:
            saved = json.load(f)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{final} has no readable {MODEL_STEP}, so nothing says which step it holds"
    if saved != step:
        return f"{final} holds step {saved}, and the newest checkpoint, {checkpoint}, step {step}"
    return None


# ----------------------------------------------------------------------------------------------
# The run directory: one writer at a time, and a resume that continues the same run

LOCK = "run.lock"

# Flags that may differ when a run is resumed: where its files are, how it is computed (not what),
# how it is watched and saved, and how long it runs. Any other difference is refused unless named in
# --allow-changed: continuing a run with another lr or group size under the same name would give a
# run directory whose metrics and checkpoints describe neither setting.
RESUMABLE = {
    "model",
    "train_data",
    "val_data",
    "out_dir",
    "resume",
    "allow_changed",  # paths (the model's shape is checked on load)
    "max_steps",
    "epochs",  # extend a finished run
    "rollout",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "micro_batch_size",
    "micro_batch_tokens",
    "share_prompts",
    "grad_checkpointing",
    "offload",  # where the weights wait between uses; the numbers are the same
    "engine_logprobs",
    "test_freq",
    "val_before_train",
    "val_max_prompts",
    "val_n",
    "val_temperature",
    "early_stop_metric",
    "early_stop_patience",
    "logger",
    "wandb_project",
    "wandb_run_name",
    "verbose",
    "save_model",
    "save_freq",
    "max_ckpt_to_keep",
    "health_bands",
    "async_save",
    "reward_timeout",
    "collective_timeout",
}


# Flags that give the checkpoint's tensors their shapes (the LoRA adapters and their AdamW moments): a
# checkpoint cannot continue with other values, --allow-changed or not. (The model's own shape is
# checked on load, against its config.)
SHAPES = ("lora_rank", "lora_target_modules")


def lock_run_dir(out_dir):
    """Hold <out-dir>/run.lock for as long as this process lives; rank 0 takes it. A second run in the
    same directory is refused, naming the holder: two writers interleave metrics.jsonl and
    checkpoints. It is an flock, which the kernel drops when its holder dies, even by SIGKILL, so a
    crashed run never leaves a lock to clean up. Returns the open file: closing it releases the lock."""
    import fcntl
    import socket

    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, LOCK), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its pid yet"
        f.close()
        raise SystemExit(
            f"{out_dir} is in use by another run ({holder}); wait for it or stop it, or pass another --out-dir"
        ) from None
    f.truncate(0)
    f.write(json.dumps(dict(pid=os.getpid(), host=socket.gethostname())) + "\n")
    f.flush()
    return f


def die_with_launcher():
    """Under torchrun, exit when the launcher dies. torch elastic starts each worker in a session of
    its own, so `kill -9 -- -PGID` on torchrun's group leaves the workers running, still writing into
    the run directory beside a re-run. A thread notices that the parent is gone (we are re-parented)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # plain python: the parent is a shell, which may go away
        return
    import threading
    import time

    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(1.0)
        print(f"rank {os.environ.get('RANK')}: torchrun (pid {launcher}) is gone; exiting", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def holds_a_run(out_dir):
    """What in out_dir a new run would overwrite: its logged steps and checkpoints ([] if none)."""
    found = [f"global_step_{s}" for s in sorted(saved_steps(out_dir))]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.insert(0, "metrics.jsonl")
    return found


def check_run_dir(out_dir, resume, config, allow_changed=()):
    """Decide, before anything in out_dir is written, how this run may use it: returns the checkpoint
    to resume from (None: start fresh), or raises SystemExit saying why not.

    - --resume never in a directory that holds a run is refused: starting over would truncate its
      metrics and leave its checkpoints beside the new run's.
    - A resume whose flags differ from those the run was started with (outside RESUMABLE and
      --allow-changed) is refused, listing the differences.
    """
    existing = holds_a_run(out_dir)
    if resume == "never":
        if existing:
            raise SystemExit(
                f"--resume never: {out_dir} already holds a run ({', '.join(existing[:4])}{', ...' if len(existing) > 4 else ''}), "
                "which starting over would overwrite. Pass a new --out-dir, or move the old run away first."
            )
        return None
    resume_from = find_checkpoint(out_dir, resume)
    if resume_from is not None:
        with open(os.path.join(resume_from, "trainer_state.json")) as f:
            saved, where = json.load(f)["config"], resume_from
    elif existing and os.path.isfile(os.path.join(out_dir, "config.json")):  # steps logged, never saved
        with open(os.path.join(out_dir, "config.json")) as f:
            saved, where = json.load(f), os.path.join(out_dir, "config.json")
    else:
        return None
    reshaped = {k: (saved[k], config[k]) for k in SHAPES if k in saved and k in config and saved[k] != config[k]}
    if resume_from is not None and reshaped:
        listing = "\n".join(f"    --{k.replace('_', '-')}: {a!r} there, {b!r} now" for k, (a, b) in reshaped.items())
        back = " ".join(f"--{k.replace('_', '-')} {a}" for k, (a, _) in reshaped.items())
        raise SystemExit(
            f"{resume_from} cannot continue with other LoRA shapes:\n{listing}\nThe adapters and their optimizer "
            f"state have the shapes these flags give them, so not even --allow-changed can change them. Resume with "
            f"{back}, or pass a new --out-dir for a new run (to start it from this run's weights: python checkpoint.py "
            f"export {resume_from} DIR, then --model DIR)."
        )
    changed = {
        k: (saved[k], v)
        for k, v in config.items()
        if k in saved and saved[k] != v and k not in RESUMABLE and k not in allow_changed
    }
    if changed:
        listing = "\n".join(f"    --{k.replace('_', '-')}: {a!r} there, {b!r} now" for k, (a, b) in changed.items())
        raise SystemExit(
            f"{where} belongs to a run with other flags:\n{listing}\nContinuing it would mix two settings in one run "
            f"directory. Pass a new --out-dir for a new run, or --allow-changed {','.join(changed)} to continue this one "
            "with the new values."
        )
    if resume_from is None:
        print(f"{out_dir}: no checkpoint, so the steps logged there are redone from the start (same flags)", flush=True)
    return resume_from


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    e = commands.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    e.add_argument("checkpoint", help="a global_step_N directory")
    e.add_argument("out_dir", help="where to write the model (with LoRA: the base with the adapters merged in)")
    e.add_argument("--base", default=None, help="LoRA: the base model's directory (default: the run's --model)")
    e.add_argument(
        "--adapter-out", default=None, help="LoRA: where to write the PEFT adapter (default: OUT_DIR_adapter)"
    )
    e.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="the weights' dtype (default: the run's --dtype)"
    )
    args = parser.parse_args()
    try:
        export(args.checkpoint, args.out_dir, args.base, args.adapter_out, args.dtype)
    except (WriteError, NonFiniteError) as e:  # the message says what happened and what to do
        raise SystemExit(str(e)) from None
