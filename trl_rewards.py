"""TRL's calling convention for reward functions, beside verl's (reward.py); each function's kind is found
by its parameters (is_batched). A TRL-style function scores a whole batch in one call:

    def accuracy_reward(completions, solution, **kwargs) -> list[float | None]

with prompts, completions (text, or [{"role": "assistant", "content": ...}] for chat prompts),
completion_ids, trainer_state (.global_step), log_extra(column, values), log_metric(name, value) and every
dataset column as keyword lists. It runs in the reward worker (reward_worker.py), one request per function
and batch, under the same --reward-timeout and --reward-errors rules as verl's. None means "does not apply":
a sample's score is sum_i w_i * s_i over the functions that returned a number (TRL's nansum); a sample no
function applies to is counted (reward_extra/reward_unscored/mean), named on stderr, logged as 0 and, as in
TRL, left out of its group's advantages (advantage.left_out_of_groups). Each function's values are logged as
TRL's rewards/<name>/mean and /std; log_extra's columns go to samples/*.jsonl. score_rows is the trainer's way
in: it hands verl-only reward functions to reward.score_rows unchanged. check_data, at start-up, names a function
the dataset cannot feed: a column it needs or that has one of our arguments' names, verl's on prompt-only rows."""

import asyncio
import functools
import inspect
import math
import sys
import types

import reward
from prompt_data import PROMPT_ONLY_SOURCE, VERL_COLUMNS
from user_errors import RewardError, describe, safe_repr

BATCH_ARGUMENTS = ("completions", "completion_ids", "prompts")  # any of them, and no solution_str: TRL's kind
NOT_COLUMNS = ("prompt", "prompt_ids")  # a row's keys that are not passed as columns (prompt_ids: data_prep's)
PASSED = BATCH_ARGUMENTS + ("trainer_state", "log_extra", "log_metric")  # what every call gets beside the columns


def is_batched(fn):
    """Whether `fn` (a function, a callable instance, an async function) takes TRL's batched arguments: a
    parameter named completions, completion_ids or prompts, and none named solution_str (verl's)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called verl's way, as before
        return False
    return "solution_str" not in params and any(p in params for p in BATCH_ARGUMENTS)


def function_names(fns):
    """TRL's name for each function (rewards/<name>/mean), as its get_callable_name gives it: a partial's (nested
    or not) function's __name__, a function's, a callable instance's (its class's __name__ attribute, else the
    class name); repeats get _2, _3, ..."""
    bases = []
    for fn in fns:
        while isinstance(fn, functools.partial):
            fn = fn.func
        bases.append(getattr(fn, "__name__", None) or type(fn).__name__)
    return reward.unique_names(bases)


def arguments(fn):
    """(needs, takes) of a TRL-style function called by keyword: the parameters it has no default for, and
    every parameter it accepts (None: it has **kwargs, and accepts anything). The signature Python checks at the
    call, not the __wrapped__ one: update_wrapper(partial(f, x=1), f) (open-r1's code_reward) names x as f's."""
    params = inspect.signature(fn, follow_wrapped=False).parameters.values()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    needs = [p.name for p in named if p.default is p.empty]
    takes = None if any(p.kind == p.VAR_KEYWORD for p in params) else [p.name for p in named]
    return needs, takes


def argument_problem(needs, takes, columns, data):
    """What is wrong with calling a function of arguments() (needs, takes) with PASSED and `columns` (the
    dataset's, named `data` in the message), or None: a needed argument that is neither, or one it does not
    take (TRL passes every column: a function without **kwargs fails on the first one it does not name)."""
    missing = [a for a in needs if a not in PASSED and a not in columns]
    if missing:
        return (
            f"needs the keyword argument(s) {missing}, which {data} has no column for (its columns: "
            f"{sorted(columns)}; TRL's arguments: {list(PASSED)}). Add the column, or give the parameter a default"
        )
    extra = [a for a in (*PASSED, *sorted(columns)) if takes is not None and a not in takes]
    if extra:
        return (
            f"has no **kwargs, and is called with {extra} too, as TRL calls it (every column of the dataset and "
            "all of TRL's arguments): add **kwargs to its parameters"
        )
    return None


def column_clash(columns, data):
    """What is wrong with `columns` (of `data`, for the message) named as one of TRL's own arguments (PASSED), or
    None: a TRL-style function gets ours under that name, so the column would be lost; TRL raises "got multiple
    values for keyword argument" instead."""
    clash = [c for c in PASSED if c in columns]
    if not clash:
        return None
    named = f"{'a column' if len(clash) == 1 else 'columns'} named {' and '.join(map(repr, clash))}"
    return (
        f"{data} has {named}, as TRL's own arguments to a reward function ({', '.join(PASSED)}): the function "
        "would get ours, never the dataset's values, and TRL refuses such a dataset (TypeError: got multiple values "
        f"for keyword argument {clash[0]!r}). Rename the {'column' if len(clash) == 1 else 'columns'}"
    )


def verl_on_prompt_only(what, columns, data):
    """The message for verl-signature functions (`what`) on prompt-only rows, which have nothing to pass them."""
    return (
        f"{what} verl's signature (data_source, solution_str, ground_truth, extra_info), and {data} is a "
        f"prompt-only dataset (no data_source and no reward_model column; its columns: {sorted(columns)}), so "
        "there is no ground_truth to pass: write it TRL's way, f(completions, **kwargs) -> list[float | None], "
        "which gets every column of the dataset as a keyword list (solution=[...])"
    )


def check_data(reward_fn, rows, data):
    """At start-up, before the engine and the model load: whether --reward-fn's functions (a RewardWorker) can
    score `rows`, the dataset `data` (its path). RewardError naming the spec (file and function) and what is
    missing: verl-signature functions alone on a prompt-only dataset, a column_clash beside TRL-style functions, or
    a TRL-style function's argument_problem.
    Other reward functions (the built-in compute_score) are checked by data_prep.load_prompts."""
    if not isinstance(reward_fn, reward.RewardWorker) or not rows:
        return
    info = reward_fn.info
    columns = sorted({k for r in rows for k in r if k not in NOT_COLUMNS})
    if not info:  # verl's functions alone: reward.score_rows reads data_source and reward_model
        if not all(c in rows[0] for c in VERL_COLUMNS):
            specs = ", ".join(reward_fn.specs)
            what = f"{specs}: {'this function has' if len(reward_fn.specs) == 1 else 'these functions have'}"
            raise RewardError(f"--reward-fn {verl_on_prompt_only(what, columns, data)}")
        return
    clash = column_clash(columns, data)
    if clash:
        raise RewardError(f"--reward-fn {', '.join(reward_fn.specs)}: {clash}")
    for spec, kind, needs_takes in zip(reward_fn.specs, info["kinds"], info["arguments"]):
        problem = argument_problem(*needs_takes, columns, data) if kind == "trl" else None
        if problem:
            raise RewardError(f"--reward-fn {spec}: this function {problem}")


# ----------------------------------------------------------------------------------------------
# The worker's side


def load_rewards(setup):
    """The reward worker's loader (reward_worker.Worker) for (specs, weights): verl's answer, reward.score_one, when
    every function is verl's (one as it is, several summed by reward.weighted_reward); else answer_batch, with
    (names, kinds, weights) sent back as the worker's info."""
    specs, weights = setup
    fns = [reward.load_reward_fn(s) for s in specs]
    kinds = ["trl" if is_batched(fn) else "verl" for fn in fns]
    for spec, fn, kind in zip(specs, fns, kinds):
        if kind == "verl":
            check_verl_arguments(spec, fn)
    if "trl" not in kinds:
        one = (
            fns[0]
            if len(fns) == 1 and weights is None
            else reward.weighted_reward(fns, weights, reward.reward_names(specs))
        )
        return functools.partial(reward.score_one, one), None
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ValueError(f"{len(weights)} reward weights for {len(fns)} reward functions; give one per --reward-fn")
    arguments_of = [arguments(fn) if kind == "trl" else None for fn, kind in zip(fns, kinds)]
    info = dict(names=function_names(fns), kinds=kinds, weights=weights, arguments=arguments_of)
    return functools.partial(answer_batch, fns, kinds), info


def answer_batch(fns, kinds, request):
    """The reply to (i, batch): fns[i] on the whole batch, ((values, problems, logged), None), where values holds
    a float or None per sample, problems {sample: what was wrong with its value}, logged what log_extra and
    log_metric received; (None, problem) when the call itself failed (raised, returned no list of the batch's
    length). A verl-kind function (beside TRL's) is called once per sample, as reward.score_one calls it.
    Each function gets its own copy of the batch: one that edits its lists in place changes nothing for the next."""
    i, batch = request[0], reward.own_copy(request[1])  # the requests of one batch share it, as they were sent
    fn, n = fns[i], len(batch["prompts"])
    if kinds[i] == "verl":
        values, problems = [], {}
        for j, sample in enumerate(batch["verl_samples"]):
            result, problem = reward.score_one(fn, sample)
            values.append(None if result is None else result[0])
            if problem:
                problems[j] = problem
        return (values, problems, {}), None
    logged = {"extra": {}, "metric": {}}
    kwargs = dict(batch["columns"])  # the dataset's columns; one named as ours is refused below (column_clash)
    kwargs.update(prompts=batch["prompts"], completions=batch["completions"], completion_ids=batch["completion_ids"])
    kwargs.update(trainer_state=types.SimpleNamespace(**batch["trainer_state"]))
    kwargs.update(log_extra=functools.partial(log_into, logged["extra"]))
    kwargs.update(log_metric=functools.partial(log_into, logged["metric"]))
    columns = batch["columns"]
    problem = column_clash(columns, "this batch") or argument_problem(*arguments(fn), columns, "this batch's rows")
    if problem:  # said before the call: Python's TypeError names neither the column nor the fix
        return None, problem
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
    for j, value in enumerate(out):  # each sample's own: one value that is no score must not spoil the others
        number, problem = batch_value(value)
        values.append(number)
        if problem:
            problems[j] = problem
    return (values, problems, logged), None


def batch_value(value):
    """(float or None, None) for one value of a TRL-style function's list, or (None, what is wrong with it): a str,
    NaN, 10**400 (which float() cannot hold), anything whose conversion raises."""
    if value is None:
        return None, None
    try:
        number = reward.real_number(value)
        if number is not None and reward.is_finite(number):
            return float(number), None
    except Exception:  # a numpy-like object whose .item() raises, and the like
        pass
    said = f"returned {safe_repr(value)} (a {type(value).__name__}) for it"
    return None, f"{said}; expected a finite real number (a float holds up to about 1.8e308), or None"


VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # reward.score_one passes them


def check_verl_arguments(spec, fn):
    """ValueError, at load, for a function of neither kind: one that needs an argument verl's call does not pass.
    The usual one is a factory given itself, --reward-fn trl.rewards:get_soft_overlong_punishment, not what it
    makes."""
    try:
        needs = arguments(fn)[0]
    except (TypeError, ValueError):  # no signature to read (a builtin): its call says what is wrong
        return
    if any(a not in VERL_ARGUMENTS for a in needs):
        raise ValueError(
            f"--reward-fn {spec}: this function takes {needs}, neither TRL's arguments (completions, completion_ids, "
            f"prompts) nor verl's {list(VERL_ARGUMENTS)}. If it makes the reward function (a factory such as "
            "get_soft_overlong_punishment), call it in a file of yours, overlong = "
            "get_soft_overlong_punishment(1024, 256), and pass --reward-fn that_file.py:overlong"
        )


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
):
    """reward.score_rows, for reward functions of either kind: TRL's (a RewardWorker whose info names them)
    get one call per function for the batch (batch_kwargs), verl's go to reward.score_rows as they are.
    step: trainer_state.global_step; response_ids: TRL's completion_ids (verl's functions see them in extra_info).
    Returns (scores, extras) as reward.score_rows does, plus rewards/<name> (each function's values, None where
    it returned None), reward_unscored (1.0 where none applied), log_extra/<column> and log_metric/<name>
    (run_log.rollout_metrics reads them)."""
    if not reward.is_trl(reward_fn):
        if rows and not all(c in rows[0] for c in VERL_COLUMNS):  # check_data says so at start-up
            name = getattr(reward_fn, "__name__", repr(reward_fn))
            columns = {k for r in rows for k in r if k not in NOT_COLUMNS}
            raise RewardError(f"reward function {verl_on_prompt_only(name + ' has', columns, 'this')}")
        return reward.score_rows(reward_fn, rows, texts, first, response_ids, truncated, errors, where, conversations)
    info, batch = reward_fn.info, batch_kwargs(rows, texts, response_ids, conversations, step)
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
        applied = [(name, w, v[j]) for name, w, v in zip(names, weights, values) if v[j] is not None]
        total, problem = reward.weighted_sum(applied)
        if problem and not failed[j]:  # each value is finite, their sum is not
            said = f"reward functions {', '.join(name for name, _, _ in applied)}"
            at = f"{said}, {reward.sample_place(where, first + j)}: {problem}"
            if errors == "raise":
                raise RewardError(f"{at}. {SKIP_HINT}")
            failed[j].append(at)
        scores.append(0.0 if failed[j] else total)
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


def function_metrics(parts, prefix=""):
    """{prefix}rewards/<name>/mean and /std (unbiased, as TRL's nanstd) of each function's values over the samples
    it applied to, from `parts` (every rank's extras, or their rewards/<name> columns): the training step's
    (run_log.rollout_metrics, one rank's) and validation's, logged as val-aux/rewards/<name>/mean."""
    values = {}
    for part in parts:
        for key, column in part.items():
            if key.startswith("rewards/"):
                values.setdefault(key, []).extend(float(v) for v in column if v is not None)
    metrics = {}
    for key, numbers in values.items():
        if numbers:
            mean = sum(numbers) / len(numbers)
            metrics[f"{prefix}{key}/mean"] = mean
            metrics[f"{prefix}{key}/std"] = math.sqrt(sum((v - mean) ** 2 for v in numbers) / max(len(numbers) - 1, 1))
    return metrics
