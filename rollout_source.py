"""Where a trainer's step rollout comes from, behind one interface, so the trainer's loop never asks which
placement it runs. A source has:
    take(step, timing) -> this rank's StepRollout of step `step`
    publish(policy, version)  the weights after `version` updates to whoever generates, checked there
    validation(step, log) -> the validation metrics of the policy after `step` updates
    metrics(ro) -> the step's staleness (async_rollout.staleness_metrics) and weight-sync metrics
    start(step), state(done), load(saved)  where it starts; what a checkpoint holds of it (the rollouts made ahead)
    close(early)
Colocated: this rank's own engine (rollout.collect_rollout), with --max-staleness S the rollouts made up to
S steps ahead by older weights (async_rollout.RolloutsAhead). RolloutRanks: --rollout-ranks K, the last K
ranks generate (rollout_rank.py), in lock-step or, with --stream-rollouts, group by group; the trainers
receive their share and send weights. A new placement is a class with these methods, chosen in make."""

from functools import partial

from async_rollout import RolloutsAhead
from eval import run_validation
from rollout import collect_rollout
from rollout_ranks import Trainers
from run_log import timed
from weight_sync import probe_ids, sync_and_check


def make(split, engine, policy_dtype, *, total_steps, **inputs):
    """The source for this run's placement (split: None, or --rollout-ranks' rollout_ranks.RankSplit); inputs: Colocated's keywords (RolloutRanks takes a few of them)."""
    args = inputs["args"]
    made_ahead = RolloutsAhead(args.max_staleness, total_steps)
    if split:
        keep = ("args", "train_rows", "pad_id", "rank", "world", "device")
        return RolloutRanks(split, made_ahead, policy_dtype, **{k: inputs[k] for k in keep})
    return Colocated(engine, made_ahead, policy_dtype, **inputs)


class Colocated:
    """This rank's engine generates and scores this rank's prompts, waking between updates."""

    def __init__(
        self,
        engine,
        made_ahead,
        dtype,
        *,
        args,
        train_rows,
        val_rows,
        tokenizer,
        reward,
        eos_ids,
        tools,
        pad_id,
        rank,
        world,
        device,
    ):
        self.engine, self.made_ahead, self.dtype, self.args = engine, made_ahead, dtype, args
        self.train_rows = train_rows
        self.inputs = dict(tokenizer=tokenizer, eos_ids=eos_ids, tools=tools)
        self.val_rows, self.reward, self.rank, self.world, self.device = val_rows, reward, rank, world, device
        self.probe = dict(probe=probe_ids(train_rows), pad_id=pad_id, device=device)
        self.gap = None  # the last weight sync's probe gap (weight_sync.py)

    def take(self, step, timing):
        """Step `step`'s rollout: rollout.collect_rollout on this rank's engine, which holds the weights of step
        - 1. With --max-staleness S, made up to S steps ahead by older weights (async_rollout.RolloutsAhead)."""
        collect = partial(collect_rollout, self.engine, self.train_rows, args=self.args, rank=self.rank,
                          world=self.world, reward=self.reward, device=self.device, timing=timing, **self.inputs)  # fmt: skip
        if self.args.max_staleness or self.made_ahead.ready:  # made ahead, or held by the checkpoint resumed
            return self.made_ahead.take(step, collect)
        ro = collect(step)  # the synchronous loop
        ro.versions = [step - 1] * len(ro.response_ids)
        return ro

    def publish(self, policy, version):
        """The new weights into the engine, then a check that it serves them (weight_sync.py). An engine that
        generates with the policy's own weights has nothing to take (rollout/weights_shared)."""
        if getattr(self.engine, "shares_policy", False):
            return
        self.gap = sync_and_check(
            self.engine, policy, self.dtype, version=version, dtype_name=self.args.dtype, **self.probe
        )

    def validation(self, step, log):
        return run_validation(
            step,
            engine=self.engine,
            val_rows=self.val_rows,
            reward_fn=self.reward[0],
            args=self.args,
            rank=self.rank,
            world=self.world,
            log=log,
            **self.inputs,
        )

    def metrics(self, ro):
        shared = {"rollout/weights_shared": 1.0} if getattr(self.engine, "shares_policy", False) else {}
        if not self.args.max_staleness:
            return shared
        return (
            shared | self.made_ahead.staleness | ({"rollout/weight_sync_gap": self.gap} if self.gap is not None else {})
        )

    def start(self, step):
        pass  # the engine is this rank's: nothing to tell

    def state(self, done):
        return self.made_ahead.state(done)

    def load(self, saved):
        self.made_ahead.load(saved, self.train_rows, rank=self.rank, world=self.world, group_size=self.args.group_size)

    def close(self, early):
        pass  # the engine is closed with the run (startup.close)


class RolloutRanks:
    """The rollout ranks generate and score; the trainers receive each step's rollout and send the weights
    (rollout_ranks.Trainers: collectives among the trainers; trainer rank 0 talks to the rollout ranks)."""

    def __init__(self, split, made_ahead, dtype, *, args, train_rows, pad_id, rank, world, device):
        self.made_ahead, self.dtype, self.args, self.train_rows = made_ahead, dtype, args, train_rows
        self.rank, self.world = rank, world
        self.remote = Trainers(split, rank=rank, world=world, args=args, train_rows=train_rows)
        self.remote.probe = dict(ids=probe_ids(train_rows), pad_id=pad_id, device=device)

    def take(self, step, timing):
        with timed(timing, "wait_rollout"):
            return self.made_ahead.receive_step(step, self.remote.rollout)

    def publish(self, policy, version):
        self.remote.send_weights(policy, self.dtype, version)

    def validation(self, step, log):
        return self.remote.validation(step, log=log)

    def metrics(self, ro):  # the gap is the rollout ranks' check of the weights that made `ro`
        return self.made_ahead.staleness | (
            {"rollout/weight_sync_gap": ro.weight_sync_gap} if ro.weight_sync_gap is not None else {}
        )

    def start(self, step):
        """The rollout ranks start from the step after the rollouts held, with step `step`'s weights."""
        self.remote.start(step, first=max(self.made_ahead.ready, default=step) + 1)

    def state(self, done):
        return self.made_ahead.state(done)

    def load(self, saved):
        self.made_ahead.load(saved, self.train_rows, rank=self.rank, world=self.world, group_size=self.args.group_size)

    def close(self, early):
        self.remote.close(early)
