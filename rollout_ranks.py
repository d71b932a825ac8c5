"""--rollout-ranks K: the last K torchrun ranks only generate, the others only train, so generation and the
update can run at the same time on different devices (verl's one-step-off-policy placement). With
--max-staleness S >= 1 the rollout ranks generate step t + 1 while the trainers train step t.

Each side has a torch.distributed world of its own (init): the N = W - K trainers run FSDP2, metrics and
checkpoints as N ranks would alone; the rollout ranks run engines as K colocated ranks would. Trainer
rank 0 and the rollout ranks share the bridge, a gloo group of pickled messages between our own
processes: START (the flags, where to start), WEIGHTS (version v after each update: a header, then
buckets broadcast over NCCL where every bridge rank has a GPU of its own, else gloo; weight_sync.py;
sent without waiting for the rollout ranks to take them), ROLLOUT (a rollout rank's share
of step j, as soon as it is made), VALIDATION (of version v, when one is due). Step j's rollout comes from
version j - 1 - S (async_rollout.py). Waiting longer than --collective-timeout is an error naming what
was awaited, never a hang.
"""

import contextlib
import dataclasses
import datetime
import os
import pickle

import torch
import torch.distributed as dist

from async_rollout import from_plain, generation_version, join, to_plain
from distributed import ask_to_stop, stop_signal
from weight_sync import WeightSyncError, bucket_sums, check_engine, pack, trainer_probe, unpack

START, WEIGHTS, ROLLOUT, VALIDATION = 1, 2, 3, 4  # the bridge's message tags
STOP = "stop"  # sent instead of weights when the trainers stop early


class Bridge:
    """Messages between trainer rank 0 (bridge rank 0) and rollout rank i (bridge rank i + 1), over gloo;
    the weights' buckets are broadcast from bridge rank 0 over `weights` (weights_group) into tensors on
    `weights_device`. Sends return at once; their buffers are kept until flush()."""

    def __init__(self, group, timeout, weights, weights_device):
        self.group, self.timeout, self.pending = group, datetime.timedelta(seconds=timeout), []
        self.weights, self.weights_device = weights, weights_device
        self.last_gap = None  # a rollout rank's: the weight check's probe gap, of the version it holds

    def send_tensor(self, tensor, dst, tag, mark=0):
        self.pending.append((self.group.send([tensor], dst, tag), tensor, mark))

    def send(self, obj, dst, tag, mark=0):
        """Send `obj`; mark: flush(through) may wait for it once mark <= through."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send_tensor(torch.tensor([data.numel()]), dst, tag, mark)
        self.send_tensor(data, dst, tag, mark)

    def recv_tensor(self, tensor, src, tag, what):
        return self.wait(self.group.recv([tensor], src, tag), tensor, src, what)

    def wait(self, work, tensor, src, what):
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            side = "trainer rank 0" if src == 0 else f"rollout rank {src - 1}"
            raise RuntimeError(f"waited for {what} from {side}: {e} (--collective-timeout)") from None
        return tensor

    def send_buckets(self, buckets):
        """Trainer rank 0: broadcast each bucket to every rollout rank (they take it in receive_buckets)."""
        for b in buckets:
            self.pending.append((self.weights.broadcast([b], from_trainer()), b, 0))

    def receive_buckets(self, sizes, what):
        """A rollout rank: the buckets of `sizes` [(dtype name, numel)], from trainer rank 0's send_buckets."""
        out = []
        for i, (dtype, numel) in enumerate(sizes):
            bucket = torch.empty(numel, dtype=getattr(torch, dtype), device=self.weights_device)
            work = self.weights.broadcast([bucket], from_trainer())
            out.append(self.wait(work, bucket, 0, f"bucket {i + 1} of {len(sizes)} of {what}"))
        return out

    def recv(self, src, tag, what):
        size = self.recv_tensor(torch.zeros(1, dtype=torch.int64), src, tag, what)
        return pickle.loads(self.recv_tensor(torch.empty(int(size.item()), dtype=torch.uint8), src, tag, what).numpy())

    def flush(self, through=float("inf")):
        """Wait until every message sent (marked at most `through`: known to be taken by now) has been
        taken, and free it."""
        for work, _, mark in self.pending:
            if mark <= through:
                work.wait(self.timeout)
        self.pending = [p for p in self.pending if p[2] > through]


@dataclasses.dataclass
class RankSplit:
    rank: int  # among all W ranks
    trainers: int  # N
    rollout_ranks: int  # K
    bridge: Bridge | None  # trainer rank 0 and the rollout ranks only

    @property
    def generates(self):
        return self.rank >= self.trainers


def init(rollout_ranks, timeout):
    """Join this rank's side; returns (RankSplit, its rank and world size within its side, its device)."""
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=timeout)))
    trainers, wait = world - rollout_ranks, datetime.timedelta(seconds=timeout)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if cuda else "cpu")  # sides may share one
    if cuda:
        torch.cuda.set_device(device)
    side, side_rank, side_world = (
        ("trainers", rank, trainers) if rank < trainers else ("rollout", rank - trainers, rollout_ranks)
    )
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, store=dist.PrefixStore(side, store), rank=side_rank, world_size=side_world, timeout=wait
    )
    if side == "rollout":  # vLLM's external launcher reads these; print0 stays quiet on this side
        os.environ.update(RANK=str(side_rank), WORLD_SIZE=str(side_world), GRPO_ROLLOUT_SIDE="1")
    bridge = None
    if rank == 0 or side == "rollout":
        bridge_rank, size = side_rank + (side == "rollout"), rollout_ranks + 1
        group = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), bridge_rank, size, wait)
        weights = weights_group(dist.PrefixStore("weights", store), bridge_rank, size, device, group, wait)
        bridge = Bridge(group, timeout, *weights)
    return RankSplit(rank, trainers, rollout_ranks, bridge), side_rank, side_world, device


def weights_group(store, rank, size, device, bridge, wait):
    """(The group the weights' buckets are broadcast over, the device they travel on): NCCL between GPUs
    when every bridge rank has a GPU of its own (ranks that share one cannot be in an NCCL group, as when
    a trainer and a rollout rank share a single GPU), else gloo through CPU memory. The NCCL line has not
    run here: it needs two GPUs, and the machines lent to this project have one."""
    own = device.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count()
    every = torch.tensor([int(own)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    bridge.allreduce([every], opts).wait(wait)  # every bridge rank must pick the same backend
    if every.item():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        group, on = dist.ProcessGroupNCCL(store, rank, size, options), device
    else:
        group, on = dist.ProcessGroupGloo(store, rank, size, wait), torch.device("cpu")
    group.broadcast([torch.zeros(1, device=on)], from_trainer()).wait(wait)  # connect now, while all are here
    return group, on


def from_trainer():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0  # trainer rank 0
    return opts


def validation_due(version, args, total_steps, fresh):
    """Whether the trainer validates after `version` updates (0: before training, in a fresh run)."""
    if args.test_freq <= 0:
        return False
    if version == 0:
        return args.val_before_train and fresh
    return version % args.test_freq == 0 or version == total_steps


# ----------------------------------------------------------------------------------------------
# The rollout side


def serve(split, engine, *, args, total_steps, collect, validate, rank):
    """A rollout rank's whole run: take each version of the weights as it comes, generate every step's
    share of the rollout as soon as the version it is due from is held, validate when due."""
    bridge, S = split.bridge, args.max_staleness
    start = bridge.recv(0, START, "where to start")  # after the trainers resumed
    if start == STOP:  # the run had already finished
        return
    version, probe, fresh = start["step"], start["probe"], start["step"] == 0

    def advance():  # take the next version; validate it when the trainers do. False: they stopped
        nonlocal version
        version += 1
        if take_weights(bridge, engine, version, probe, args) == STOP:
            return False
        bridge.flush(through=version)  # the rollouts of steps up to `version` were trained on, so taken
        if validation_due(version, args, total_steps, fresh):
            send_validation(bridge, validate(version), rank)
        return True

    if fresh and validation_due(0, args, total_steps, fresh):
        send_validation(bridge, validate(0), rank)
    if not fresh:  # resumed: the checkpoint's weights first (validated before it was saved)
        take_weights(bridge, engine, version, probe, args)
    for j in range(start["first"], total_steps + 1):
        while version < generation_version(j, S):
            if not advance():
                return
        timing = {}
        ro = collect(j, timing=timing)
        ro.versions = [version] * len(ro.response_ids)
        send_groups(bridge, [(j, 0, to_plain(ro), 0)], timing)
    while version < total_steps:  # the last versions: none generates, validation may be due
        if not advance():
            return
    bridge.flush()


def send_groups(bridge, groups, timing):
    """A ROLLOUT message: groups [(step, place of the first prompt in the step, plain rollout, weight loads
    during its generation)], this rank's times since its last message, its last probe gap, and whether a
    SIGTERM reached it (then the trainers stop the run; it goes on until they do)."""
    message = dict(groups=groups, timing=timing, weight_sync_gap=bridge.last_gap, stop=int(stop_signal() or 0))
    bridge.send(message, 0, ROLLOUT, mark=max(j for j, *_ in groups))


def send_validation(bridge, result, rank):
    if rank == 0:  # the metrics are already every rollout rank's
        bridge.send(result, 0, VALIDATION)


def take_weights(bridge, engine, version, probe, args):
    """Receive version `version` (or STOP), load it, check the engine serves it."""
    received = receive_weights(bridge, version)
    return STOP if received == STOP else load_weights(bridge, engine, *received, probe, args)


def receive_weights(bridge, version):
    """(header, buckets) of version `version`, each bucket's sums checked; or STOP."""
    header = bridge.recv(0, WEIGHTS, f"policy version {version}")
    if header == STOP:
        return STOP
    if header["version"] != version:
        raise WeightSyncError(f"expected policy version {version}, the trainer sent version {header['version']}")
    buckets = bridge.receive_buckets(header["buckets"], f"policy version {version}")
    for i, (got, sent) in enumerate(zip(bucket_sums(buckets), header["sums"])):
        if got != sent:
            raise WeightSyncError(
                f"policy version {version}: bucket {i + 1} arrived with sums {got}, was sent with {sent}"
            )
    return header, buckets


def load_weights(bridge, engine, header, buckets, probe, args):
    """Load received weights into the engine, then check it serves them; returns their version."""
    version = header["version"]
    engine.wake_up()
    if os.environ.get("GRPO_FAULT") != f"skip_weights:{version}":  # the weight-sync test's fault: a load lost
        engine.update_weights(unpack(header["layout"], buckets))
    bridge.last_gap = check_engine(engine, probe, header["probe"], version=version, dtype=args.dtype)
    engine.sleep()
    return version


# ----------------------------------------------------------------------------------------------
# The trainer side


class Trainers:
    """What the trainers do with the rollout ranks: start them, receive rollouts and validations,
    send weights. Every trainer rank calls each method (they are collectives among the trainers);
    only trainer rank 0 talks to the rollout ranks."""

    def __init__(self, split, *, rank, world, args, train_rows):
        self.split, self.bridge, self.rank, self.world = split, split.bridge, rank, world
        self.args, self.train_rows, self.receivers = args, train_rows, range(1, split.rollout_ranks + 1)
        self.probe = None  # weight_sync's probe: dict(ids, pad_id, device)
        self.share = args.prompt_batch_size // split.rollout_ranks  # a rollout rank's prompts per step
        self.held = {}  # (rollout rank, step) -> [(place, plain group(s), weight loads)] received ahead of use

    def broadcast(self, obj):
        """Trainer rank 0's `obj`, on every trainer rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def start(self, step, first):
        """Tell the rollout ranks to start after `step` (its weights follow if step > 0), generating from step `first`."""
        if self.rank == 0:
            for r in self.receivers:
                self.bridge.send(dict(step=step, first=first, probe=self.probe["ids"]), r, START)

    def rollout(self, step):
        """Step `step`'s rollout: this trainer rank's share of it (StepRollout), with the probe gap of the
        rollout ranks' last weight check and their metrics (remote_metrics)."""
        plain = None
        if self.rank == 0:
            parts, times, gaps, loads = [], [], [], []
            for r in self.receivers:  # its messages until its share of the step is in; they hold whole groups
                spent = {}
                while sum(len(g["indices"]) for _, g, _ in self.held.get((r, step), [])) < self.share:
                    message = self.bridge.recv(r, ROLLOUT, f"step {step}'s rollout")
                    if message["stop"]:  # a rollout rank was asked to stop: so is the run
                        ask_to_stop(message["stop"])
                    for j, place, group, load in message["groups"]:
                        self.held.setdefault((r, j), []).append((place, group, load))
                    for k, v in message["timing"].items():
                        spent[k] = spent.get(k, 0.0) + v
                    gaps += [message["weight_sync_gap"]] if message["weight_sync_gap"] is not None else []
                pieces = sorted(self.held.pop((r, step)), key=lambda piece: piece[0])  # in the step's order
                parts, loads = parts + [g for _, g, _ in pieces], loads + [load for *_, load in pieces]
                times.append(spent)
            plain = join(parts) | {"weight_sync_gap": max(gaps) if gaps else None}  # none before a sync
            metrics = {f"timing_s/{k}": max(t.get(k, 0.0) for t in times) for k in set().union(*times)}  # the slowest
            if self.args.stream_rollouts:  # the step's groups whose generation a new version interrupted
                metrics["rollout/interrupted"] = sum(load > 0 for load in loads) / len(loads)
            plain["remote_metrics"] = metrics
        plain = self.broadcast(plain)
        local = self.args.prompt_batch_size // self.world
        ro = from_plain(plain, self.train_rows, slice(self.rank * local, (self.rank + 1) * local), self.args.group_size)
        ro.weight_sync_gap, ro.remote_metrics = plain["weight_sync_gap"], plain["remote_metrics"]
        return ro

    def send_weights(self, policy, dtype, version):
        """Version `version` of the weights (with LoRA, merged) to every rollout rank, in buckets, with the
        probe's log-probs under it for their check (a collective among the trainers: the tensors are gathered)."""
        from policy import full_parameters

        expected = trainer_probe(policy, **self.probe)
        tensors = full_parameters(policy, dtype)
        if self.rank != 0:
            for _ in tensors:  # each is a collective
                pass
            return
        self.bridge.flush()  # the previous version's buckets are free once every rollout rank took them
        layout, buckets = pack(tensors, self.bridge.weights_device)
        header = dict(version=version, layout=layout, probe=expected, sums=bucket_sums(buckets))
        header["buckets"] = [(str(b.dtype).removeprefix("torch."), b.numel()) for b in buckets]
        for r in self.receivers:
            self.bridge.send(header, r, WEIGHTS)
        self.bridge.send_buckets(buckets)

    def validation(self, step, log):
        """The rollout ranks' validation of version `step`: its metrics (its samples go to the run's log)."""
        result = self.bridge.recv(1, VALIDATION, f"the validation of policy version {step}") if self.rank == 0 else None
        from eval import log_validation

        return log_validation(step, *self.broadcast(result), log)

    def close(self, early):
        """The end of the run: tell the rollout ranks no more weights come if it ended `early` (an early
        stop, SIGTERM), then wait until they took everything sent."""
        if self.rank == 0:
            for r in self.receivers if early else ():
                self.bridge.send(STOP, r, WEIGHTS)
            self.bridge.flush()


def send_flags(split, args):
    """Trainer rank 0 sends the flags as the trainers resolved them to every rollout rank (rollout_rank.run)."""
    if split.rank == 0:
        for r in range(1, split.rollout_ranks + 1):
            split.bridge.send(args, r, START)


@contextlib.contextmanager
def stopped_if_exiting(split):
    """Trainer rank 0 tells the rollout ranks to stop (before they start) if the block exits the process."""
    try:
        yield
    except SystemExit:
        if split and split.rank == 0:
            for r in range(1, split.rollout_ranks + 1):
                split.bridge.send(STOP, r, START)
            split.bridge.flush()
        raise
