"""torch.distributed in a few functions: every rank computes, rank 0 talks.

Under `torchrun` each rank is one process with one device (a GPU, or the CPU with the gloo
backend). `python train_grpo.py` without torchrun is a world of one. Collectives take the device
explicitly: nccl reduces CUDA tensors, gloo CPU ones.
"""

import datetime
import math
import os
import signal
import time

import torch
import torch.distributed as dist

from reward_worker import waits
from user_errors import record_root_cause

# Large CPU tensors in 2 MiB huge pages: torch's allocator asks the kernel for them (madvise) when this
# is set before its first CPU allocation, so at import. Every micro-batch allocates [vocab, hidden]
# tensors, and in 4 KiB pages each costs a page fault per page (BENCHMARKS.md, Qwen vocabulary).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def full_tensor(x):
    """The whole tensor of an FSDP2-sharded DTensor (a collective: every rank calls it, in the
    same order); a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def init_distributed(timeout=600.0):
    """Join the process group; returns (rank, world size, this rank's device). A collective that
    waits more than `timeout` seconds for another rank raises (is_peer_failure) instead of waiting
    for torch's default of 30 minutes: a rank that died or stopped must not hang the others silently."""
    if "RANK" not in os.environ:  # plain `python train_grpo.py`: a world of one
        port = str(29500 + os.getpid() % 1000)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    # on GPUs, nccl for CUDA tensors and gloo for CPU ones (--offload params keeps the shards in CPU memory)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    expandable_segments(True)  # a colocated vLLM engine turns them off while it is awake
    return rank, world, device


def expandable_segments(on):
    """Switch CUDA's caching allocator to expandable segments (on) or back: a segment then grows in
    place instead of a new one being reserved for each new size, so micro-batches whose shapes change
    every step do not fragment the GPU's memory (torchtitan's and verl's trainers run so). On from
    init_distributed; a colocated vLLM engine turns it off from its start and whenever it wakes, on when
    it sleeps, as its sleep-mode memory pool does not support it (verl switches the same way). Nothing
    happens off CUDA, or where the user set PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) themselves."""
    if torch.cuda.is_available() and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")


def is_peer_failure(error):
    """Whether an exception from a collective means another rank is gone or stuck: gloo's and
    nccl's timeouts, and a peer's closed connection."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text
        for s in (
            "Timed out",
            "timed out",
            "Application timeout caused pair closure",
            "Connection closed by peer",
            "Connection reset by peer",
            "Watchdog",
        )
    )


# ----------------------------------------------------------------------------------------------
# A polite stop: SIGTERM (Slurm, Kubernetes, torchrun passing one on) and SIGINT (Ctrl-C)

_stop = {"signal": None}
# A signal after the last step has no step boundary to stop at: the run ends as if none had come.
STOPPING = (
    "stopping at the next step boundary (after the last step: the run finishes as usual and writes its final model)"
)


def catch_stop_signals():
    """From now on SIGTERM and SIGINT only ask the run to stop (stop_requested): the trainer then
    saves a checkpoint at the next step boundary and exits, instead of dying mid-step and losing every
    step since the last save; after the last step the run ends as it would have. A second signal is the
    same request; SIGKILL still kills at once. A rank in a reward function's or a tool's call says which,
    and for how long: that is why its peers gave up on it (torchrun passes this rank a SIGTERM when
    another one failed)."""

    def ask(signum, frame):
        who = ("rollout rank " if os.environ.get("GRPO_ROLLOUT_SIDE") else "rank ") + os.environ.get("RANK", "0")
        if _stop["signal"] is None:  # the handler cannot tell whether a step is left: it says what each case does
            print(f"{who}: {signal.Signals(signum).name}: {STOPPING}", flush=True)
        for line in waits():
            print(f"{who}: {signal.Signals(signum).name} came while {line}", flush=True)
        _stop["signal"] = signum

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, ask)


def stop_signal():
    """The signal that asked this process to stop, or None (a rollout rank passes it on to the trainers)."""
    return _stop["signal"]


def ask_to_stop(signum):
    """As if `signum` had reached this process: trainer rank 0 passing on a rollout rank's stop."""
    _stop["signal"] = _stop["signal"] or signum


def stop_requested(device):
    """The signal that asked some rank to stop (signal.Signals), or None: a collective, so that every
    rank stops at the same step even when the signal reached only one of them."""
    asked = torch.tensor(float(_stop["signal"] or 0), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    return signal.Signals(int(asked.item())) if asked.item() else None


def crash_point(where, step):
    """For the crash and stop tests: GRPO_CRASH_AT=where:step makes this process kill itself (SIGKILL) there;
    where:step:SIGTERM has rank 0 send SIGTERM to its launcher (torchrun passes it to every rank, as after
    Slurm's), and each rank waits until it has arrived: a stop at a known point, however fast the steps."""
    if os.environ.get("GRPO_CRASH_AT", "").removesuffix(":SIGTERM") == f"{where}:{step}":
        crash(terminate=os.environ["GRPO_CRASH_AT"].endswith(":SIGTERM"))


def crash(terminate):
    if not terminate:
        os.kill(os.getpid(), signal.SIGKILL)
    if int(os.environ.get("RANK", 0)) == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.time() + 60
    while _stop["signal"] is None and time.time() < deadline:
        time.sleep(0.01)


def print0(*a, **kw):
    """Print on rank 0 only (with --rollout-ranks: the trainers' rank 0)."""
    if int(os.environ.get("RANK", 0)) == 0 and "GRPO_ROLLOUT_SIDE" not in os.environ:
        print(*a, **kw, flush=True)


def all_sum(x, device):
    """The sum of a number over ranks."""
    t = torch.tensor(float(x), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def all_sum_tensor(t, device):
    """The sum of a 0-d tensor over ranks, as a CPU tensor (advantage.masked_whiten's `total`)."""
    return torch.tensor(all_sum(t, device))


def all_gather(obj):
    """Every rank's `obj` (anything picklable), in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_metrics(metrics, device):
    """Average metrics over ranks; keys ending in max or min (verl's critic/score/max, and its
    training/rollout_logprob_diff_max) take the max or min. A key that some ranks lack (a reward's extra
    keys may differ between ranks) is averaged over the ranks that have it."""
    if dist.get_world_size() == 1:
        return metrics
    keys = sorted(set().union(*all_gather(sorted(metrics))))  # every rank reduces the same list
    out = {}
    for op, pick, missing in (
        (dist.ReduceOp.MAX, ("/max", "_max"), -math.inf),
        (dist.ReduceOp.MIN, ("/min", "_min"), math.inf),
        (dist.ReduceOp.SUM, None, 0.0),
    ):
        sel = [k for k in keys if (k.endswith(pick) if pick else not k.endswith(("/max", "_max", "/min", "_min")))]
        if not sel:
            continue
        t = torch.tensor([float(metrics.get(k, missing)) for k in sel], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        if pick is None:  # a mean over the ranks that have the key
            have = torch.tensor([float(k in metrics) for k in sel], dtype=torch.float64, device=device)
            dist.all_reduce(have)
            t /= have
        out.update(zip(sel, t.tolist()))
    return out


def run(main, clear_errors=()):
    """Run a script's main() so that under torchrun the error it ends with is the root cause torchrun
    prints last: our SystemExit messages and `clear_errors` (which name their path and what to do)
    as they are, a peer's failure (is_peer_failure) as the advice to resume, anything else as
    "Type: message" with its traceback."""
    try:
        main()
    except SystemExit as e:  # our errors say what to do: under torchrun they are also its summary's last line
        if isinstance(e.code, str):
            record_root_cause(e.code)
        raise
    except clear_errors as e:
        record_root_cause(str(e))
        raise SystemExit(str(e)) from None
    except Exception as e:
        if not is_peer_failure(e):
            record_root_cause(f"{type(e).__name__}: {e}")
            raise
        message = (
            f"rank {os.environ.get('RANK', 0)}: another rank stopped answering ({e}). It died or is stuck; its own "
            "output says why. Checkpoints are intact: rerun the same command to resume. If ranks legitimately wait "
            "longer than this for each other, raise --collective-timeout."
        )
        # torchrun's root cause is the failure recorded first, to the second, and a tie goes to the lower rank:
        # a rank that died recorded its error before this one saw it die, so one second later always sorts after
        time.sleep(1)
        record_root_cause(message)
        raise SystemExit(message) from None
