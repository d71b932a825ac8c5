"""A rollout rank's whole run (--rollout-ranks K: the last K ranks): train_grpo.main hands it over at once.
It takes the trainers' flags as they resolved them, reads the same inputs (startup.py), starts the engine,
then generates, scores and validates for the trainers until they stop: a step's share at a time in
lock-step (rollout_ranks.serve), or group by group with --stream-rollouts (stream_rollouts.serve). It has
no policy and no run directory; the trainers log, checkpoint and resume for both sides."""

from functools import partial

import reward_model
import rollout_ranks
import startup
import stream_rollouts
from distributed import catch_stop_signals
from eval import validate_step
from rollout import collect_rollout, start_engine


def run(args, split, rank, world, device):
    """Generate for the trainers; rank and world are this rank's within the rollout side."""
    here = startup.ranks_here()
    mesh, dtype, _ = startup.start(args, world, device)
    args = split.bridge.recv(0, rollout_ranks.START, "the run's flags")  # the demo's paths, the dtype
    tokenizer, _, eos_ids, tools = startup.tokenizer_and_tools(args)
    train_rows, val_rows, total_steps = startup.read_data(args, tokenizer, tools)
    reward_fn = startup.reward_fn(args, train_rows, val_rows)
    engine = start_engine(args, world, here, device, dtype, trains=False)  # first: it sets the thread count
    catch_stop_signals()  # after the engine, which may set handlers of its own: SIGTERM/SIGINT now stop politely
    rm = reward_model.load_reward_model(args.reward_model, mesh, device, dtype) if args.reward_model else None
    scoring = dict(args=args, tokenizer=tokenizer, reward=(reward_fn, rm), eos_ids=eos_ids, device=device)
    how = dict(val_rows=val_rows, tokenizer=tokenizer, reward_fn=reward_fn, eos_ids=eos_ids, args=args, tools=tools)
    validate = partial(validate_step, engine=engine, rank=rank, world=world, **how)
    if args.stream_rollouts:  # group by group, the engine never waiting for a step's end
        serve = partial(stream_rollouts.serve, train_rows=train_rows, world=world, scoring=scoring)
    else:  # a step's share at a time
        collect = partial(collect_rollout, engine, train_rows, rank=rank, world=world, tools=tools, **scoring)
        serve = partial(rollout_ranks.serve, collect=collect)
    serve(split, engine, args=args, total_steps=total_steps, validate=validate, rank=rank)
    startup.close(engine, tools)
