"""TRL's calling convention for reward functions, beside verl's (reward.py); each function's kind is found
by its parameters (is_batched). A TRL-style function scores a whole batch in one call:

    def accuracy_reward(completions, solution, **kwargs) -> list[float | None]

with prompts, completions (text, or [{"role": "assistant", "content": ...}] for chat prompts),
completion_ids, trainer_state (.global_step), log_extra(column, values), log_metric(name, value) and every
dataset column as keyword lists. It runs in the reward worker (reward_worker.py), one request per function
and batch, under the same --reward-timeout and --reward-errors rules as verl's. None means "does not apply":
a sample's score is sum_i w_i * s_i over the functions that returned a number (TRL's nansum); a sample no
function applies to is counted (reward_extra/reward_unscored/mean), named on stderr, logged as 0 and, as in
TRL, left out of its group's advantages (advantage.left_out_of_groups). Each
function's values are logged as TRL's rewards/<name>/mean and /std; log_extra's columns go to samples/*.jsonl.
score_rows is the trainer's way in: it hands verl-only reward functions to reward.score_rows unchanged."""

import asyncio
import functools
import inspect
import sys
import types

import reward
from prompt_data import PROMPT_ONLY_SOURCE
from user_errors import RewardError, describe, safe_repr

BATCH_ARGUMENTS = ("completions", "completion_ids", "prompts")  # any of them, and no solution_str: TRL's kind
NOT_COLUMNS = ("prompt", "prompt_ids")  # a row's keys that are not passed as columns (prompt_ids: data_prep's)


def is_batched(fn):
    """Whether `fn` (a function, a callable instance, an async function) takes TRL's batched arguments: a
    parameter named completions, completion_ids or prompts, and none named solution_str (verl's)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called verl's way, as before
        return False
    return "solution_str" not in params and any(p in params for p in BATCH_ARGUMENTS)


def function_names(fns):
    """TRL's name for each function (rewards/<name>/mean): its __name__, a callable instance's class name, a
    partial's function's; repeats get _2, _3, ..."""
    bases = [getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) for fn in fns]
    return reward.unique_names([base or type(fn).__name__ for base, fn in zip(bases, fns)])


# ----------------------------------------------------------------------------------------------
# The worker's side


def load_rewards(setup):
    """The reward worker's loader (reward_worker.Worker) for (specs, weights): verl's answer, reward.answer_reward,
    when every function is verl's; else answer_batch, with (names, kinds, weights) sent back as the worker's info."""
    specs, weights = setup
    fns = [reward.load_reward_fn(s) for s in specs]
    kinds = ["trl" if is_batched(fn) else "verl" for fn in fns]
    if "trl" not in kinds:  # what reward.load_reward_fns_in_process makes, from the functions loaded once
        one = (
            fns[0]
            if len(fns) == 1 and weights is None
            else reward.weighted_reward(fns, weights, reward.reward_names(specs))
        )
        return functools.partial(reward.answer_reward, one), None
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ValueError(f"{len(weights)} reward weights for {len(fns)} reward functions; give one per --reward-fn")
    info = dict(names=function_names(fns), kinds=kinds, weights=weights)
    return functools.partial(answer_batch, fns, kinds), info


def answer_batch(fns, kinds, request):
    """The reply to (i, batch): fns[i] on the whole batch, ((values, problems, logged), None), where values holds
    a float or None per sample, problems {sample: what was wrong with its value}, logged what log_extra and
    log_metric received; (None, problem) when the call itself failed (raised, returned no list of the batch's
    length). A verl-kind function (beside TRL's) is called once per sample, as reward.score_one calls it."""
    i, batch = request
    fn, n = fns[i], len(batch["prompts"])
    if kinds[i] == "verl":
        values, problems = [], {}
        for j, sample in enumerate(batch["verl_samples"]):
            value, _, problem = reward.score_one(fn, *sample)
            values.append(value)
            if problem:
                problems[j] = problem
        return (values, problems, {}), None
    logged = {"extra": {}, "metric": {}}
    kwargs = dict(batch["columns"])  # the dataset's columns; ours below win over a column of the same name
    kwargs.update(prompts=batch["prompts"], completions=batch["completions"], completion_ids=batch["completion_ids"])
    kwargs.update(trainer_state=types.SimpleNamespace(**batch["trainer_state"]))
    kwargs.update(log_extra=functools.partial(log_into, logged["extra"]))
    kwargs.update(log_metric=functools.partial(log_into, logged["metric"]))
    try:
        out = fn(**kwargs)
        if inspect.isawaitable(out):  # an async def function, or an instance whose __call__ is one
            out = asyncio.run(awaited(out))
        out = list(out) if isinstance(out, (list, tuple)) or hasattr(out, "tolist") else out
    except (Exception, SystemExit) as e:
        return None, describe(e)
    if not isinstance(out, list):
        return None, f"returned {safe_repr(out):.100} (a {type(out).__name__}); expected a list of {n} rewards"
    if len(out) != n:
        return (
            None,
            f"returned {len(out)} rewards for {n} completions; expected one per completion (None where it does not apply)",
        )
    values, problems = [], {}
    for j, value in enumerate(out):
        number = None if value is None else reward.real_number(value)
        if value is not None and (number is None or not reward.is_finite(number)):
            problems[j] = (
                f"returned {safe_repr(value)} (a {type(value).__name__}) for it; expected a finite real number, or None"
            )
        values.append(None if number is None else float(number))
    return (values, problems, logged), None


async def awaited(awaitable):
    return await awaitable


def log_into(logged, name, value):
    """log_extra(column, values) and log_metric(name, value), as TRL passes them: kept per name."""
    logged.setdefault(name, []).append(value)


# ----------------------------------------------------------------------------------------------
# The trainer's side


def score_rows(
    reward_fn,
    rows,
    texts,
    first=0,
    response_ids=None,
    truncated=None,
    errors="raise",
    where="",
    conversations=None,
    step=0,
    completion_ids=None,
):
    """reward.score_rows, for reward functions of either kind: TRL's (a RewardWorker whose info names them)
    get one call per function for the batch (batch_kwargs), verl's go to reward.score_rows as they are.
    step: trainer_state.global_step; completion_ids: the responses' tokens where response_ids (which verl's
    functions see in extra_info) are not given. Returns (scores, extras) as reward.score_rows does, plus
    rewards/<name> (each function's values, None where it returned None), reward_unscored (1.0 where none
    applied), log_extra/<column> and log_metric/<name> (run_log.rollout_metrics reads them)."""
    info = getattr(reward_fn, "info", None)
    if not isinstance(reward_fn, reward.RewardWorker) or not info:
        if rows and "reward_model" not in rows[0]:
            name = getattr(reward_fn, "__name__", repr(reward_fn))
            raise RewardError(
                f"reward function {name} has verl's signature (data_source, solution_str, ground_truth, extra_info), "
                "and this is a prompt-only dataset (no data_source, no reward_model): write it TRL's way, "
                "f(completions, **kwargs) -> list[float | None], which gets every column of the dataset"
            )
        return reward.score_rows(reward_fn, rows, texts, first, response_ids, truncated, errors, where, conversations)
    ids = response_ids if response_ids is not None else completion_ids
    batch = batch_kwargs(rows, texts, ids, conversations, step)
    if "verl" in info["kinds"]:
        infos = reward.sample_infos(rows, response_ids, truncated, conversations)
        sources = [r.get("data_source", PROMPT_ONLY_SOURCE) for r in rows]
        truths = [(r.get("reward_model") or {}).get("ground_truth") for r in rows]
        batch["verl_samples"] = list(zip(sources, texts, truths, infos))
    requests = [(i, batch) for i in range(len(info["names"]))]
    replies = reward_fn.call(requests, stop_on_error=errors == "raise")
    return combine(replies, info, len(rows), first=first, errors=errors, where=where)


def batch_kwargs(rows, texts, ids, conversations, step):
    """What a TRL-style function is called with, for the worker (picklable): prompts as the dataset holds them,
    completions as text for a text prompt or as messages for a chat prompt (the whole conversation after the
    prompt, multi-turn), completion_ids, trainer_state, and every column of the rows but NOT_COLUMNS."""
    if conversations is not None:
        completions = [[dict(m) for m in c] for c in conversations]
    else:
        completions = [
            t if isinstance(r["prompt"], str) else [{"role": "assistant", "content": t}] for r, t in zip(rows, texts)
        ]
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in NOT_COLUMNS))
    return dict(
        prompts=[r["prompt"] for r in rows],
        completions=completions,
        completion_ids=[[int(t) for t in x] for x in ids] if ids is not None else None,
        trainer_state=dict(global_step=step),
        columns={k: [r.get(k) for r in rows] for k in keys},
    )


def combine(replies, info, n, *, first, errors, where):
    """(scores, extras) from each function's reply: score = sum_i w_i * s_i over the functions that returned
    a number for the sample. A failed call or value: RewardError naming the function and where (errors="raise"),
    or the samples score 0 and count in reward_error (errors="skip"), as reward.score_responses does."""
    names, weights = info["names"], info["weights"]
    values = [[None] * n for _ in names]  # [function][sample]
    failed = [[] for _ in range(n)]  # each sample's problems, "name: problem"
    extras = {}
    for i, (value, problem) in enumerate(replies):
        place = (
            f"{where}, samples {first}-{first + n - 1} of the batch" if where else f"samples {first}-{first + n - 1}"
        )
        if problem is not None:
            if errors == "raise":
                raise RewardError(f"reward function {names[i]}, {place}: {problem}. {SKIP_HINT}")
            for j in range(n):
                failed[j].append(f"reward function {names[i]}, {place}: {problem}")
            continue
        values[i], problems, logged = value
        for j, said in problems.items():
            at = f"reward function {names[i]}, {reward.sample_place(where, first + j)}: {said}"
            if errors == "raise":
                raise RewardError(f"{at}. {SKIP_HINT}")
            failed[j].append(at)
            values[i][j] = None
        add_logged(extras, logged, n)
    scores, unscored = [], []
    for j in range(n):
        applied = [(w, v[j]) for w, v in zip(weights, values) if v[j] is not None]
        scores.append(0.0 if failed[j] else sum(w * v for w, v in applied))
        unscored.append(float(not failed[j] and not applied))
    extras.update({f"rewards/{name}": column for name, column in zip(names, values)})
    extras["reward_unscored"] = unscored
    if any(unscored):
        j = unscored.index(1.0)
        print(
            f"reward: {int(sum(unscored))} of {n} samples{' at ' + where if where else ''} got None from every reward "
            f"function ({', '.join(names)}): left out of their groups' advantages (advantage 0), counted in "
            f"reward_extra/reward_unscored/mean; the first is "
            f"{reward.sample_place(where, first + j)}",
            file=sys.stderr,
        )
    if errors == "skip":
        extras["reward_error"] = [float(bool(f)) for f in failed]
        if any(failed):
            count = sum(map(bool, failed))
            first_problem = next(f[0] for f in failed if f)
            print(
                f"reward errors: {count} of {n} samples scored 0 (--reward-errors skip); the first: {first_problem}",
                file=sys.stderr,
            )
    return scores, extras


SKIP_HINT = "To score such samples 0 and count them, pass --reward-errors skip"


def add_logged(extras, logged, n):
    """log_extra's columns (one value per sample: padded with None or cut to n, with a note) and log_metric's
    values (their mean, on every sample) into extras."""
    for column, parts in logged.get("extra", {}).items():
        values = [v for part in parts for v in (part if isinstance(part, (list, tuple)) else [part])]
        if len(values) != n:
            print(f"reward: log_extra({column!r}, ...) got {len(values)} values for {n} samples", file=sys.stderr)
        extras[f"log_extra/{column}"] = (values + [None] * n)[:n]
    for name, values in logged.get("metric", {}).items():
        numbers = [reward.real_number(v) for v in values]
        numbers = [float(x) for x in numbers if x is not None and reward.is_finite(x)]
        if numbers:
            extras[f"log_metric/{name}"] = [sum(numbers) / len(numbers)] * n
