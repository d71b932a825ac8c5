"""Checkpoints: exact resume after a crash, atomic sharded saves, retention, and export.

    <out-dir>/global_step_N/                  one complete checkpoint
        shards/                               policy + optimizer, torch.distributed.checkpoint:
                                              every rank writes its own shards, none gathers them
        rng_rank{r}.json                      every random generator of rank r
        trainer_state.json                    step, LR scheduler, config, metric history
        hf/                                   model config and tokenizer, for export
    <out-dir>/latest_checkpointed_iteration.txt    the newest complete step (verl's tracker name)

A checkpoint is written as global_step_N.tmp/ and renamed only when every rank has finished, then
the tracker is replaced atomically: a crash mid-save leaves the previous checkpoint in charge.
The data loader needs no state of its own: the order of prompts is a function of (seed, epoch)
and the step says where in it we are. The rollout's sampling seeds are a function of (seed, step).

    python checkpoint.py export runs/grpo/global_step_200 my_model   # -> Hugging Face format

Loading unpickles nothing arbitrary: JSON, torch.load(weights_only=True) inside
torch.distributed.checkpoint for the shards, and an allow-list unpickler for its index file.
"""

import json
import os
import pickle
import random
import shutil
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

TRACKER = "latest_checkpointed_iteration.txt"


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
    state = {"python": [version, list(mt), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached], "torch": torch.get_rng_state().tolist()}
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


# ----------------------------------------------------------------------------------------------
# Saving


class Checkpointer:
    """Saves every rank's shards of the policy and optimizer, plus the trainer state, atomically.

    With async_save the shards are copied to CPU memory and written in the background while
    training goes on; the next save (or wait(), at the end of training) completes the previous one.
    """

    def __init__(self, out_dir, keep=-1, async_save=False):
        self.out_dir, self.keep, self.async_save = out_dir, keep, async_save
        self.pending = None  # (future, step) of a background save
        # background writes run their collectives on a group of their own, not the training one
        self.group = dist.new_group(backend="gloo") if async_save else None
        if dist.get_rank() == 0 and os.path.isdir(out_dir):  # partial saves left by a crash
            for name in sorted(os.listdir(out_dir)):
                if name.startswith("global_step_") and name.endswith(".tmp"):
                    print(f"removing {os.path.join(out_dir, name)}, a checkpoint a crash left unfinished", flush=True)
                    shutil.rmtree(os.path.join(out_dir, name))
        dist.barrier()

    def save(self, step, model, optimizer, trainer_state, tokenizer=None):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        self.wait()
        rank, tmp = dist.get_rank(), step_dir(self.out_dir, step) + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash
            os.makedirs(tmp)
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(dict(trainer_state, step=step, world_size=dist.get_world_size()), f)
            model.config.save_pretrained(os.path.join(tmp, "hf"))
            model.generation_config.save_pretrained(os.path.join(tmp, "hf"))
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "hf"))
        dist.barrier()
        with open(os.path.join(tmp, f"rng_rank{rank}.json"), "w") as f:
            json.dump(rng_state(), f)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        shards = os.path.join(tmp, "shards")
        if self.async_save:
            self.pending = (dcp.async_save(state, checkpoint_id=shards, process_group=self.group), step)
        else:
            dcp.save(state, checkpoint_id=shards)
            self._finish(step)

    def wait(self):
        """Complete a background save, if one is running."""
        if self.pending is not None:
            future, step = self.pending
            future.result()
            self.pending = None
            self._finish(step)

    def _finish(self, step):
        crash_point("save", step)  # all shards written, not yet visible: the worst moment to die
        dist.barrier()  # every rank's shards are on disk
        if dist.get_rank() == 0:
            final = step_dir(self.out_dir, step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(step_dir(self.out_dir, step) + ".tmp", final)
            tracker = os.path.join(self.out_dir, TRACKER)
            with open(tracker + ".tmp", "w") as f:
                f.write(str(step))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tracker + ".tmp", tracker)
            if self.keep > 0:  # older checkpoints go only now that a newer one is complete
                for old in sorted(saved_steps(self.out_dir))[: -self.keep]:
                    shutil.rmtree(step_dir(self.out_dir, old), ignore_errors=True)
        dist.barrier()


def saved_steps(out_dir):
    """Steps of the global_step_N directories in out_dir (complete or not; .tmp ones excluded)."""
    if not os.path.isdir(out_dir):
        return []
    return [int(d.rsplit("_", 1)[1]) for d in os.listdir(out_dir) if d.startswith("global_step_") and d.rsplit("_", 1)[1].isdigit()]


# ----------------------------------------------------------------------------------------------
# Loading


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint stores its index as a pickle; allow only the classes it uses."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}  # fmt: skip

    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which a checkpoint never contains")


class SafeReader(FileSystemReader):
    """A FileSystemReader that reads the checkpoint index with the allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def problem_with(path):
    """Why the checkpoint at `path` cannot be loaded, or None if it is complete."""
    for name in ("trainer_state.json", os.path.join("shards", ".metadata"), os.path.join("hf", "config.json")):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        with open(os.path.join(path, "shards", ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:
        return f"unreadable ({type(e).__name__}: {e})"
    for r in range(state["world_size"]):
        if not os.path.isfile(os.path.join(path, f"rng_rank{r}.json")):
            return f"rng_rank{r}.json is missing"
    for info in metadata.storage_data.values():  # every shard file long enough for what it should hold
        shard = os.path.join(path, "shards", str(info.relative_path))
        if not os.path.isfile(shard) or os.path.getsize(shard) < info.offset + info.length:
            return f"shard {info.relative_path} is missing or truncated"
    return None


def find_checkpoint(out_dir, resume):
    """The checkpoint to resume from: None for a fresh start.

    resume="never": None. resume=PATH: that checkpoint, or an error saying what is wrong with it.
    resume="auto": the tracker's checkpoint; if it is partial or corrupt, say so and fall back to
    the newest complete one.
    """
    if resume == "never":
        return None
    if resume != "auto":
        problem = problem_with(resume) if os.path.isdir(resume) else "no such directory"
        if problem:
            raise SystemExit(f"--resume {resume}: cannot resume from it: {problem}")
        return resume
    candidates = sorted(saved_steps(out_dir), reverse=True)
    tracker = os.path.join(out_dir, TRACKER)
    if os.path.isfile(tracker):
        latest = int(open(tracker).read().strip())
        candidates = [latest] + [s for s in candidates if s != latest]
    for step in candidates:
        problem = problem_with(step_dir(out_dir, step))
        if problem is None:
            return step_dir(out_dir, step)
        print(f"resume: skipping {step_dir(out_dir, step)}: {problem}", flush=True)
    return None


# model config fields that decide the shapes of the weights and the optimizer state
MODEL_SHAPE = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip


def load(path, model, optimizer, config):
    """Load a checkpoint into the (sharded) model and optimizer; returns its trainer state.

    Model and optimizer reshard to any number of ranks. A model of different shape is an error
    naming the fields that differ; other config changes are allowed and listed.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
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
    incompatible = {k: (saved_model.get(k), now_model.get(k)) for k in MODEL_SHAPE if saved_model.get(k) != now_model.get(k)}
    if incompatible:
        raise SystemExit(
            f"{path} was saved by an incompatible run: the model differs in "
            + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in incompatible.items())
            + f" (saved with --model {state['config']['model']}, now {config['model']})"
        )
    changed = sorted(k for k, v in config.items() if state["config"].get(k) != v)
    if changed:
        print(f"resume: config differs from the checkpoint's in {changed}; continuing with the new values", flush=True)
    sharded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sharded, storage_reader=SafeReader(os.path.join(path, "shards")))
    set_model_state_dict(model, sharded["model"])
    set_optimizer_state_dict(model, optimizer, sharded["optim"])
    rank_file = os.path.join(path, f"rng_rank{dist.get_rank()}.json")
    if state["world_size"] == dist.get_world_size():
        with open(rank_file) as f:
            set_rng_state(json.load(f))
    else:
        print(f"resume: saved with {state['world_size']} ranks, now {dist.get_world_size()}: weights reshard, random generators restart", flush=True)
    return state


# ----------------------------------------------------------------------------------------------
# Export to Hugging Face format


def write_hf(state_dict, config, generation_config, tokenizer, out_dir):
    """Write a full state dict as a Hugging Face model: safetensors, config, generation config,
    tokenizer with its chat template. Loadable by AutoModelForCausalLM.from_pretrained and vLLM."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # a skeleton of the right class, filled with the given tensors
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, assign=True, strict=False)
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def export(checkpoint, out_dir):
    """Checkpoint -> Hugging Face format, in one process, whatever number of ranks saved it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    problem = problem_with(checkpoint)
    if problem:
        raise SystemExit(f"{checkpoint}: cannot export: {problem}")
    hf = os.path.join(checkpoint, "hf")
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    full = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in skeleton.state_dict().items()}}
    dcp.load(full, storage_reader=SafeReader(os.path.join(checkpoint, "shards")), no_dist=True)
    tokenizer = AutoTokenizer.from_pretrained(hf) if os.path.isfile(os.path.join(hf, "tokenizer_config.json")) else None
    write_hf(full["model"], config, GenerationConfig.from_pretrained(hf), tokenizer, out_dir)
    print(f"exported {checkpoint} to {out_dir}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    e = commands.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    e.add_argument("checkpoint", help="a global_step_N directory")
    e.add_argument("out_dir", help="where to write the model")
    args = parser.parse_args()
    export(args.checkpoint, args.out_dir)
