"""Loading a checkpoint runs no code from it, and a torn, corrupt or foreign checkpoint is found
before it is loaded.

Reading a pickle can call any function the pickle names, so: everything but tensors is JSON; the
shards hold only tensors, read with torch.load(weights_only=True), and a shard entry that is a pickled
object is refused, not loaded (SafeReader); torch's index file (shards/.metadata, a pickle) goes
through an unpickler that admits an exact list of torch's checkpoint classes (read_index).

A save ends with checksums.json: the step, and the size and checksum of every file (write_checksums).
Before resuming, problem_with reads every file of a checkpoint and checks it against them, so that a
partial, corrupt or foreign checkpoint (a shard copied from another step) is found, naming the file,
before anything of it is loaded.
"""

import hashlib
import io
import json
import os
import pickle
import re
import zipfile

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

import rng

CHECKSUMS = "checksums.json"
NON_TENSORS = "non_tensor_state.json"  # everything of the state but its tensors (AdamW's param_groups)

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
# Loading runs no code


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
                rng.check_state(json.load(f))
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
