"""The run directory: one run at a time writes into it, and a resume continues the same run.

    <out-dir>/run.lock    held (flock) by the run writing here, which names itself in it

Rank 0 decides, before anything in the directory is written, how this run may use it (claim): a second
run in the same directory is refused, and so is --resume never over an existing run, and a resume with
other training flags than the run was started with unless --allow-changed names them (never the flags
that shape the checkpoint's tensors: SHAPES). Under torchrun every worker also exits when the launcher
dies (die_with_launcher), so that no orphan keeps writing here beside a re-run.
"""

import dataclasses
import json
import os

import torch.distributed as dist

import checkpoint
import export
import report
from config import allowed_changes
from distributed import print0
from run_log import should_stop

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
    "compile_blocks",  # the same math, its float ops in another order
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
    found = [f"global_step_{s}" for s in sorted(checkpoint.saved_steps(out_dir))]
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
    resume_from = checkpoint.find_checkpoint(out_dir, resume)
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
            f"{back}, or pass a new --out-dir for a new run (to start it from this run's weights: python export.py "
            f"{resume_from} DIR, then --model DIR)."
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


def claim(args, rank):
    """The run directory is ours alone, and a resume continues the same run: decided by rank 0
    before anything in it is written, and told to every rank. Returns (the checkpoint to resume
    from or None, the directory's lock: hold it until the process exits)."""
    decision, lock = [None, None], None  # [checkpoint to resume from, why this run may not use the directory]
    if rank == 0:
        try:
            lock = lock_run_dir(args.out_dir)
            config, allowed = dataclasses.asdict(args), allowed_changes(args)
            decision[0] = check_run_dir(args.out_dir, args.resume, config, allowed)
        except SystemExit as e:
            decision[1] = str(e)
    dist.broadcast_object_list(decision, src=0)
    if decision[1]:
        raise SystemExit(decision[1])
    os.makedirs(os.path.join(args.out_dir, "samples"), exist_ok=True)
    return decision[0], lock


def end_if_finished(path, args, total_steps, rank):
    """Before the engine loads: if the checkpoint at `path` ends the run (its last step, or an early
    stop), there is nothing to train, and the process ends here. A finished run whose final model is
    missing (it was killed while writing it) gets it now, exported from that checkpoint."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    step, history = state["step"], state["metrics"]
    if step < total_steps and not should_stop(history, args.early_stop_metric, args.early_stop_patience):
        return
    how = "early-stopped" if step < total_steps else f"of {total_steps}"
    problem = export.final_model_problem(args.out_dir, path) if args.save_model else None
    if problem is None:
        raise SystemExit(
            f"{args.out_dir}: this run has finished (step {step}, {how}). "
            "Raise --max-steps or --epochs to train it further, or pass a new --out-dir for a new run."
        )
    print0(f"{args.out_dir}: this run finished (step {step}, {how}), but {problem}; exporting it from {path}")
    if rank == 0:  # one process reads the whole checkpoint, whatever number of ranks wrote it
        adapter = os.path.join(args.out_dir, "final_adapter") if args.lora_rank else None
        export.export(path, os.path.join(args.out_dir, "final_model"), base=args.model, adapter_dir=adapter)
        report_path, verdicts = report.write_report(args.out_dir)
        print0(f"health report: {report_path}: {verdicts['overall']}")
    dist.barrier()
    raise SystemExit(0)
