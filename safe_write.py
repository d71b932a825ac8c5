"""Writing checkpoints and models safely: never a diverged state, never half a directory, and a
failed write that says why, on every rank.

A state that holds an inf or a NaN is refused before anything is written (NonFiniteError): the training
has diverged, and a checkpoint or a model of it would only carry the damage on. A model directory is
written aside (prepare_dir) and renamed into place when complete (publish_dir). A write that fails
raises WriteError naming the path, the cause ("no space left on device" when the disk is full) and
what to do, and first_failure makes every rank raise it, so that none is left waiting in a collective.
"""

import errno
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class NonFiniteError(ValueError):
    """A tensor to be saved holds an inf or a NaN: the training has diverged, and a checkpoint or a
    model of it would only carry the damage on."""


class WriteError(OSError):
    """A checkpoint or a model could not be written. The message names the path, the cause ("no
    space left on device" when the disk is full) and what to do."""


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
