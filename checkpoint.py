"""Checkpoints: exact resume after a crash, atomic sharded saves, retention, and export.

    <out-dir>/global_step_N/                  one complete checkpoint
        shards/                               the tensors of policy + optimizer, torch.distributed.checkpoint:
                                              every rank writes its own shards, none gathers them
        non_tensor_state.json                 the rest of that state, as JSON: AdamW's param_groups (lr, betas, ...)
        rng_rank{r}.json                      every random generator of rank r
        trainer_state.json                    step, LR scheduler, config, metric history
        hf/                                   model config and tokenizer, for export
    <out-dir>/latest_checkpointed_iteration.txt    the newest complete step (verl's tracker name)
    <out-dir>/run.lock                        held (flock) by the run writing here: one writer at a time

A run directory holds one run: check_run_dir refuses a resume with other training flags (unless
--allow-changed), and --resume never over an existing run, before anything in it is written.

A checkpoint is written as global_step_N.tmp/ and renamed only when every rank has finished, then
the tracker is replaced atomically: a crash mid-save leaves the previous checkpoint in charge.
The data loader needs no state of its own: the order of prompts is a function of (seed, epoch)
and the step says where in it we are. The rollout's sampling seeds are a function of (seed, step).

    python checkpoint.py export runs/grpo/global_step_200 my_model   # -> Hugging Face format

With LoRA (lora.py) a checkpoint holds only what trains: the adapters and their optimizer state,
plus hf/adapter_config.json and the base weights' fingerprint; the base comes from --model again.

Loading a checkpoint runs no code from it. Reading a pickle can call any function the pickle names,
so: everything but tensors is JSON; the shards hold only tensors, read with
torch.load(weights_only=True), and a shard entry that is a pickled object is refused, not loaded;
torch's index file (shards/.metadata, a pickle) goes through an unpickler that admits an exact list
of torch's checkpoint classes. Before resuming we read every file of the checkpoint: a partial or
corrupt one is skipped with a message naming the file, and if none is good the run refuses to start
rather than silently starting over.
"""

import io
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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

import lora

TRACKER = "latest_checkpointed_iteration.txt"
NON_TENSORS = "non_tensor_state.json"


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
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self.wait()
        rank, tmp = dist.get_rank(), step_dir(self.out_dir, step) + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash
            os.makedirs(tmp)
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(dict(trainer_state, step=step, world_size=dist.get_world_size()), f)
            model.config.save_pretrained(os.path.join(tmp, "hf"))
            model.generation_config.save_pretrained(os.path.join(tmp, "hf"))
            if lora.is_lora(model):  # what the adapters are; the base is --model
                model.peft_config[lora.ADAPTER].save_pretrained(os.path.join(tmp, "hf"))
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "hf"))
        dist.barrier()
        with open(os.path.join(tmp, f"rng_rank{rank}.json"), "w") as f:
            json.dump(rng_state(), f)
        state = {"model": trainable_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
        tensors, plain = split_tensors(state)
        if rank == 0:  # param_groups are the same on every rank
            with open(os.path.join(tmp, NON_TENSORS), "w") as f:
                json.dump(plain, f)
        shards = os.path.join(tmp, "shards")
        if self.async_save:
            self.pending = (dcp.async_save(tensors, checkpoint_id=shards, process_group=self.group), step)
        else:
            dcp.save(tensors, checkpoint_id=shards)
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

    We read every file a resume would read, shards included (each entry must load as a tensor), so
    that a garbled file is found here, and skipped, rather than halfway through loading. That reads
    the whole checkpoint once more on every rank, at resume only (about a second per GB on CPU).
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
    except Exception as e:
        return f"{name} is unreadable ({type(e).__name__}: {e})"
    pickled = [fqn for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)]
    if pickled:
        return (
            f"the shards hold pickled objects ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}), which we never load"
            " (checkpoint.py used to write the optimizer's param_groups that way)"
        )
    for info in metadata.storage_data.values():  # every shard file long enough for what it should hold
        shard = os.path.join(path, "shards", str(info.relative_path))
        if not os.path.isfile(shard) or os.path.getsize(shard) < info.offset + info.length:
            return f"shard {info.relative_path} is missing or truncated"
    for index, info in metadata.storage_data.items():  # and each entry in it a tensor
        with open(os.path.join(path, "shards", str(info.relative_path)), "rb") as f:
            f.seek(info.offset)
            entry = f.read(info.length)
        try:
            tensor = torch.load(io.BytesIO(entry), map_location="cpu", weights_only=True)
        except Exception as e:
            tensor = e
        if not isinstance(tensor, torch.Tensor):
            return f"shard {info.relative_path} is corrupt: {index.fqn} at byte {info.offset} is not a tensor ({type(tensor).__name__})"
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


def load(path, model, optimizer, config):
    """Load a checkpoint into the (sharded) model and optimizer; returns its trainer state.

    Model and optimizer reshard to any number of ranks. A model of different shape is an error
    naming the fields that differ; other config changes are allowed and listed.
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


def write_hf(state_dict, config, generation_config, tokenizer, out_dir):
    """Write a full state dict as a Hugging Face model: safetensors, config, generation config,
    tokenizer with its chat template. Loadable by AutoModelForCausalLM.from_pretrained and vLLM.

    The model is written to out_dir.tmp and renamed to out_dir only when complete, so a crash
    mid-write never leaves a half-written model, nor deletes the previous one, under out_dir."""
    from transformers import AutoModelForCausalLM

    out_dir = os.path.normpath(out_dir)
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    if os.path.isdir(old) and not os.path.exists(out_dir):  # a crash between the two renames below
        os.rename(old, out_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # a write a crash left unfinished
    shutil.rmtree(old, ignore_errors=True)
    with torch.device("meta"):  # a skeleton of the right class, filled with the given tensors
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, assign=True, strict=False)
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.exists(out_dir):  # out_dir is absent only between these two renames, never partial
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def export(checkpoint, out_dir, base=None, adapter_dir=None):
    """Checkpoint -> Hugging Face format, in one process, whatever number of ranks saved it.

    A LoRA checkpoint holds the adapters only: they are loaded onto the base model (`base`, by
    default the run's --model) and written twice, merged into a plain model at out_dir and as a PEFT
    adapter directory at adapter_dir (default: out_dir + "_adapter")."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    problem = problem_with(checkpoint)
    if problem:
        raise SystemExit(f"{checkpoint}: cannot export: {problem}")
    hf = os.path.join(checkpoint, "hf")
    config, lora_config = AutoConfig.from_pretrained(hf), lora.read_config(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf) if os.path.isfile(os.path.join(hf, "tokenizer_config.json")) else None
    shards = SafeReader(os.path.join(checkpoint, "shards"))
    if lora_config is None:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        full = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in skeleton.state_dict().items()}}
        dcp.load(full, storage_reader=shards, no_dist=True)
        write_hf(full["model"], config, GenerationConfig.from_pretrained(hf), tokenizer, out_dir)
        print(f"exported {checkpoint} to {out_dir}")
        return
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    base = base or state["config"]["model"]
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except OSError as e:
        raise SystemExit(
            f"{checkpoint} holds LoRA adapters; their base model {base!r} does not load ({e}); pass --base DIR"
        ) from None
    from peft import get_peft_model

    model = get_peft_model(model, lora_config)
    lora.check_fingerprint(state.get("base_fingerprint"), lora.base_fingerprint(model), f"{checkpoint} on base {base}")
    adapters = {"model": {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}}
    dcp.load(adapters, storage_reader=shards, no_dist=True)
    model.load_state_dict(adapters["model"], strict=False)
    write_hf(
        dict(lora.merged_parameters(model, torch.float32)),
        config,
        GenerationConfig.from_pretrained(hf),
        tokenizer,
        out_dir,
    )
    adapter_dir = adapter_dir or os.path.normpath(out_dir) + "_adapter"
    lora.write_adapter(
        {k.replace(f".{lora.ADAPTER}.", "."): v for k, v in adapters["model"].items()}, lora_config, adapter_dir
    )
    print(f"exported {checkpoint}: the merged model to {out_dir}, the adapter to {adapter_dir}")


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
}


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
    args = parser.parse_args()
    export(args.checkpoint, args.out_dir, args.base, args.adapter_out)
