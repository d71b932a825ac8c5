"""--stream-rollouts: rollout ranks that never wait for a step to end (verl's fully async rollouter, AReaL's
interruptible generation), for --rollout-ranks K with --max-staleness S >= 1.

Each rollout rank keeps its engine full: it starts a group (a prompt's n samples) whenever fewer than a
step's share are running and the group's step j is at most S + 1 ahead of the version v it holds
(j - 1 - v <= S: the staleness cap). A new version is loaded between two engine steps while the other
groups run on (vLLM recomputes their KV cache under it), so an answer may hold two versions' tokens; each
token's behaviour log-prob is the one it was drawn with, which the decoupled loss needs. A group is
scored and sent as soon as it ends, tagged with the version it started under (its oldest); step t still
trains on its own prompts, in the usual order.

Which version makes which sample now depends on timing: a resumed run goes on validly, not identically
(the checkpoint's rollouts ahead are kept; groups in flight at the kill are made again). Validation sees
exactly the version due: the engine first finishes what it runs (its only pause but the cap). vLLM only.
"""

import queue
import threading
import time
from functools import partial

from async_rollout import to_plain
from rollout import sampling_seeds, score_group, step_prompts
from rollout_ranks import START, STOP, load_weights, receive_weights, send_groups, send_validation, validation_due


def serve(split, engine, *, args, total_steps, validate, rank, world, train_rows, scoring):
    """A rollout rank's whole run (rollout_ranks.serve's, streamed); scoring: rollout.score_group's keywords."""
    from vllm_engine import Stream, VLLMEngine

    if not isinstance(engine, VLLMEngine):
        raise RuntimeError("--stream-rollouts needs the vLLM engine (--rollout vllm): it runs vLLM step by step")
    bridge, stream, S, n = split.bridge, Stream(engine), args.max_staleness, args.group_size
    score = partial(score_group, train_rows, **scoring)  # (index, samples, step=, place=) -> a group's StepRollout
    start = bridge.recv(0, START, "where to start")
    if start == STOP:  # the run had already finished
        return
    version, probe, fresh = start["step"], start["probe"], start["step"] == 0
    arrived = receive_in_background(bridge, first=version + fresh, last=total_steps)
    if fresh and validation_due(0, args, total_steps, fresh):
        send_validation(bridge, validate(0, engine=stream), rank)
    if not fresh:  # resumed: the checkpoint's weights first, before any group starts
        load_weights(bridge, stream, *take(arrived.get()), probe, args)
    todo = groups(train_rows, start["first"], total_steps, args=args, rank=rank, world=world)
    share = args.prompt_batch_size // world  # groups running at most: a step's share, as lock-step runs at once
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, logprobs=True)
    sampling["max_new_tokens"] = args.max_response_length
    upcoming, running, timing = next(todo, None), {}, {}  # running: (step, place) -> [its version, loads since]

    def spent(what, since):
        timing[what] = timing.get(what, 0.0) + time.perf_counter() - since

    def finish(done):  # score the ended groups, send them in one message with the times since the last
        if not done:
            return
        t = time.perf_counter()
        scored = []
        for (j, place, index), out in done:
            started, loads = running.pop((j, place))
            ro = score(index, out, step=j, place=place)
            ro.versions = [started] * len(ro.response_ids)
            scored.append((j, place, to_plain(ro), loads))
        spent("reward", t)
        send_groups(bridge, scored, dict(timing))
        timing.clear()

    while upcoming or len(stream) or version < total_steps:
        blocked = not len(stream) and (upcoming is None or upcoming[0] - 1 - S > version)
        t = time.perf_counter()
        try:  # the next version: waited for when nothing else can be done, else taken if it has come
            received = take(arrived.get(timeout=args.collective_timeout) if blocked else arrived.get_nowait())
        except queue.Empty:
            if blocked:
                what = f"policy version {version + 1} from trainer rank 0"
                raise RuntimeError(f"waited for {what} longer than --collective-timeout") from None
            received = None
        if blocked:
            spent("rollout_idle", t)  # the engine's only wait: S steps ahead of the trainers, or at the end
        if received == STOP:
            return
        if received:
            t = time.perf_counter()
            version = load_weights(bridge, stream, *received, probe, args)
            for group in running.values():
                group[1] += 1
            spent("load_weights", t)
            if validation_due(version, args, total_steps, fresh):
                while len(stream):  # what runs is finished first: validation needs the engine to itself
                    finish(stream.step())
                send_validation(bridge, validate(version, engine=stream), rank)  # a stream never sleeps
            bridge.flush(through=version)  # the groups of steps up to `version` were trained on, so taken
        t = time.perf_counter()
        while upcoming and len(stream) < share and upcoming[0] - 1 - S <= version:
            j, place, index, seed = upcoming
            stream.submit((j, place, index), train_rows[index]["prompt_ids"], n, seed, **sampling)
            running[j, place] = [version, 0]
            upcoming = next(todo, None)
        done = stream.step() if len(stream) else []
        spent("gen", t)
        finish(done)
    bridge.flush()


def groups(train_rows, first, last, *, args, rank, world):
    """(step, place in the step's global batch, row index, sampling seed) of this rollout rank's prompts of steps
    first..last, in order: the prompts and seeds rollout.collect_rollout would use."""
    for j in range(first, last + 1):
        indices, offset = step_prompts(train_rows, j, 0, args=args, rank=rank, world=world)
        for i, (index, seed) in enumerate(zip(indices, sampling_seeds(args.seed, j, offset, len(indices)))):
            yield j, offset + i, index, seed


def receive_in_background(bridge, first, last):
    """A queue of versions first..last as they arrive ((header, buckets), STOP, or the error raised),
    received by a thread of their own, so that generation goes on meanwhile."""
    arrived = queue.Queue()

    def receive():
        try:
            for version in range(first, last + 1):
                arrived.put(received := receive_weights(bridge, version))
                if received == STOP:
                    return
        except Exception as e:  # to the main thread, which raises it
            arrived.put(e)

    threading.Thread(target=receive, daemon=True, name="weights").start()
    return arrived


def take(received):
    if isinstance(received, Exception):
        raise received
    return received
