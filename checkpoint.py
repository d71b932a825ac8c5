"""Checkpoints: a run killed at any moment resumes exactly, from its newest complete checkpoint.

Save (save_run, every --save-freq steps): Checkpointer.save writes global_step_N.tmp/: the policy's and AdamW's
tensors as shards (torch.distributed.checkpoint, each rank its own, none gathered), non_tensor_state.json (AdamW's
param_groups), rng_rank{r}.json (every random generator), trainer_state.json (step, LR scheduler, config, metric
history), hf/ (config, tokenizer), checksums.json. Once every rank is done it becomes global_step_N/ and
latest_checkpointed_iteration.txt (verl's tracker) is replaced atomically: a crash mid-save leaves the previous
checkpoint in charge. Resume (the same command again): run_dir.claim picks the newest complete checkpoint
(find_checkpoint); resume_run loads the shards, AdamW, each rank's generators and the scheduler (load), and the loop
goes on at step N + 1. Exactly, because nothing else holds state: the prompts' order is a function of (seed, epoch)
and the sampling seeds of (seed, step), and a step stopped before its update is abandoned (train_grpo.abandoned).
With LoRA only what trains is saved. Loading runs no code (integrity.py); to Hugging Face format: export.py.
"""

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import integrity
import lora
import rng
import safe_write
from config import allowed_changes
from distributed import crash_point

TRACKER = "latest_checkpointed_iteration.txt"


def step_dir(out_dir, step):
    return os.path.join(out_dir, f"global_step_{step}")


def save_run(
    checkpointer, step, *, args, train_rows, policy, optimizer, scheduler, config, log, fingerprint, tokenizer, rollouts
):
    """Everything needed to continue this run exactly from after `step` (Checkpointer). fingerprint: the
    fingerprints of what it holds no copy of ({"base_fingerprint", "teacher_fingerprint"}: resume_run); rollouts:
    the run's rollout source, whose rollouts made ahead are saved (rollout_source.py)."""
    epoch = max(step - 1, 0) // (len(train_rows) // args.prompt_batch_size)
    trainer_state = dict(epoch=epoch, scheduler=scheduler.state_dict(), config=config, metrics=log.history)
    trainer_state.update(fingerprint or {})
    if args.max_staleness:  # the rollouts already made for the next steps (async_rollout.py)
        trainer_state["rollouts_ahead"] = rollouts.state(step)
    checkpointer.save(step, policy, optimizer, trainer_state, tokenizer)


def resume_run(path, policy, optimizer, scheduler, *, args, fingerprints=None):
    """Load a checkpoint into the policy, optimizer and scheduler; returns (its step, the metric
    history, the rollouts it holds for later steps). What the checkpoint holds no copy of is checked by its
    fingerprint (`fingerprints`: {"base_fingerprint", "teacher_fingerprint"}, None where there is none): LoRA
    adapters on another base model are refused, and so is a teacher whose weights changed (check_teacher)."""
    state, now = load(path, policy, optimizer, dataclasses.asdict(args)), fingerprints or {}
    lora.check_fingerprint(state.get("base_fingerprint"), now.get("base_fingerprint"), f"{path} (--model {args.model})")
    check_teacher(state.get("teacher_fingerprint"), now.get("teacher_fingerprint"), path, args)
    scheduler.load_state_dict(state["scheduler"])
    step, history = state["step"], state["metrics"]
    if {"lr", "weight_decay"} & allowed_changes(args):  # the restored optimizer and scheduler hold the old ones
        scheduler.base_lrs = [args.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = args.lr, args.weight_decay
            group["lr"] = args.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what actor/lr reports
    return step, history, state.get("rollouts_ahead", {})


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


def flat_items(tree, prefix=""):
    """(dotted name, leaf) of nested dicts, in order: the names torch.distributed.checkpoint gives them."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


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
        safe_write.check_finite(
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
                with open(
                    os.path.join(tmp, integrity.NON_TENSORS), "w"
                ) as f:  # param_groups are the same on every rank
                    json.dump(plain, f)
            except Exception as e:
                error = e
        self._check(error, step, tmp)  # and a barrier: tmp exists
        try:
            with open(os.path.join(tmp, f"rng_rank{rank}.json"), "w") as f:
                json.dump(rng.get_state(), f)
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
            error = safe_write.write_error(error, getattr(error, "filename", None) or path, f"saving {final}", todo)
        failure = safe_write.first_failure(error)
        if failure is not None:
            if dist.get_rank() == 0:  # every rank has stopped writing into it
                shutil.rmtree(tmp, ignore_errors=True)
            raise safe_write.WriteError(str(failure)) from original

    def _finish(self, step):
        crash_point("save", step)  # all shards written, not yet visible: the worst moment to die
        dist.barrier()  # every rank's shards are on disk
        final, tracker = step_dir(self.out_dir, step), os.path.join(self.out_dir, TRACKER)
        tmp, error, path = final + ".tmp", None, final + ".tmp"
        if dist.get_rank() == 0:
            try:  # everything that may fail to write, before the checkpoint is published
                integrity.write_checksums(tmp, step)
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
        problem = integrity.problem_with(resume) if os.path.isdir(resume) else "no such directory"
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
        problem = integrity.problem_with(step_dir(out_dir, step))
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
    saved = integrity.read_index(os.path.join(path, "shards", ".metadata")).state_dict_metadata
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
    dcp.load(tensors, storage_reader=integrity.SafeReader(os.path.join(path, "shards")))
    with open(os.path.join(path, integrity.NON_TENSORS)) as f:
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
            rng.set_state(json.load(f))
    else:
        print(
            f"resume: saved with {state['world_size']} ranks, now {dist.get_world_size()}: weights reshard, random generators restart",
            flush=True,
        )
    return state


# ----------------------------------------------------------------------------------------------
# The trainer's whole state: what train_grpo saves and resumes


def check_teacher(saved, now, path, args):
    """The teacher is never checkpointed: a --teacher directory whose files were replaced since the run started
    would make the resumed run learn from another teacher than its first steps did. Refused, or with
    --allow-changed teacher accepted and said. saved, now: distill.teacher_fingerprint's numbers (None: none)."""
    if saved is None or now is None or abs(saved - now) <= 1e-9 * max(1.0, abs(saved)):
        return
    what = (
        f"--teacher {args.teacher}: its weights are not those {path} was trained with (fingerprint {saved!r}, now "
        f"{now!r})"
    )
    if "teacher" not in allowed_changes(args):
        raise SystemExit(
            f"{what}: the run would mix two teachers. Pass the teacher the run started with, or add "
            "--allow-changed teacher to go on with this one"
        )
    print(f"resume: {what}; going on with this teacher (--allow-changed teacher)", flush=True)
