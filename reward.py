"""The reward: verl's compute_score (the built-in reward of each shipped task, tasks/), and reward functions of
your own (--reward-fn FILE.py:NAME) in a worker process. A sample's reward, from the training loop on:

    rollout.score_samples -> score_responses -> score_one -> compute_score(data_source, solution_str,
                                                             ground_truth, extra_info=None) -> float | dict
    (with --reward-fn, score_one runs in the reward worker: RewardWorker.call sends it the batch, reward_worker.py)

A reward returns a real number or a dict with a "score" and extra keys, logged as reward_extra/<key>/mean. A
verl user's reward file works here unchanged. TRL's batched functions, f(completions, **kwargs), have their own
file (trl_rewards.py), whose loader the worker runs for both kinds. Several functions combine as weighted_reward
(TRL's reward_weights). What a function may do, and what happens when it raises, exits, hangs or returns
something else: load_reward_fns.
"""

import functools
import importlib.util
import math
import numbers
import os
import pickle
import sys
import warnings
from decimal import Decimal

from reward_worker import Worker
from tasks.digits import DIGITS_SOURCE, digits_score
from tasks.gsm8k import GSM8K_SOURCE, gsm8k_score
from tasks.math import MATH_SOURCES, math_score
from tasks.multiply import MULTIPLY_SOURCE, multiply_score
from tasks.reasoning_gym import PREFIX as RGYM_PREFIX
from tasks.reasoning_gym import is_rgym_source, rgym_score
from user_errors import RewardError, describe, safe_repr

# ----------------------------------------------------------------------------------------------
# Dispatch by data source (verl's `default_compute_score`)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in reward for a row's data_source: a float, or for MATH a dict {"score", "pred"}
    (verl's reward functions return either). Unknown sources are an error, not a 0. reasoning-gym's
    tasks ("reasoning_gym/NAME") are scored by their own verifier, from the row's extra_info."""
    if data_source == GSM8K_SOURCE:
        return gsm8k_score(solution_str, ground_truth)
    if data_source == DIGITS_SOURCE:
        return digits_score(solution_str, ground_truth)
    if data_source == MULTIPLY_SOURCE:
        return multiply_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    if is_rgym_source(data_source):
        return rgym_score(data_source, solution_str, extra_info)
    raise ValueError(
        f"no built-in reward for data_source {data_source!r}; built-in sources: {sorted(BUILTIN_SOURCES)} "
        f"and {RGYM_PREFIX}<task> for reasoning-gym's tasks. "
        "For other data, pass a reward file: --reward-fn path/to/file.py:function_name"
    )


class Sources(frozenset):
    """The built-in data_sources: these, and "reasoning_gym/NAME" for every reasoning-gym task NAME."""

    def __contains__(self, data_source):
        return super().__contains__(data_source) or is_rgym_source(data_source)


BUILTIN_SOURCES = Sources({GSM8K_SOURCE, DIGITS_SOURCE, MULTIPLY_SOURCE} | MATH_SOURCES)

# ----------------------------------------------------------------------------------------------
# Custom reward functions


def load_reward_fn(spec):
    """Load a reward function from 'path/to/file.py:function_name', or from an installed module,
    'module.path:function_name' (a spec with no file part, e.g. trl.rewards:think_format_reward).

    Without ':function_name' the function is `compute_score`, verl's default name.
    """
    path, _, name = spec.partition(":")
    name = name or "compute_score"
    if is_module_spec(spec):
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise ImportError(f"--reward-fn {spec}: cannot import module {path!r} ({e}); is it installed?") from e
    elif not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward file {path!r} (from {spec!r}) does not exist; expected path/to/file.py:function_name"
        )
    else:
        module_spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward file {path!r} has no function {name!r}; its functions: {found}")
    return fn


def is_module_spec(spec):
    """Whether a --reward-fn spec names an installed module ('trl.rewards:f': dotted names, no file part)
    rather than a file ('path/to/file.py:f'); an existing file wins."""
    path = spec.partition(":")[0]
    return not os.path.isfile(path) and not path.endswith(".py") and all(p.isidentifier() for p in path.split("."))


def real_number(value):
    """`value` as a Python bool, int or float if it is a real number: a bool, int, float, Fraction or
    Decimal, a numpy scalar, or a 0-d numpy array or torch tensor holding one. None for anything else:
    a str ("1.0" is text, not a score), None, a complex number, a list."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy scalars, 0-d arrays and tensors
        value = value.item()
    if isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, (bool, int, float)):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
    return value if isinstance(value, (bool, int, float)) else None


def is_finite(number):
    """Whether a bool, int or float is finite as a float (10**400 is not: float() cannot hold it)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def read_score(out):
    """(score, extras) from what a reward function returned: a real number (real_number), or a dict with
    such a "score" and extra keys. Extras that are numbers come back as Python numbers, NaN included
    (score_responses reports it). Raises ValueError saying what was wrong with anything else: None, NaN,
    10**400, "1.0", a dict without "score"."""
    extras = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"returned a dict without 'score' (its keys: {safe_repr(list(out))})")
        for key, value in out.items():
            if key != "score":
                number = real_number(value)
                extras[key] = value if number is None else number
        out = out["score"]
    number = real_number(out)
    if number is None:
        raise ValueError(
            f"returned {safe_repr(out)} (a {type(out).__name__}); expected a real number (int, float, bool, "
            "a numpy or torch scalar), or a dict with a 'score'"
        )
    if not is_finite(number):
        raise ValueError(f"returned {safe_repr(out)}; expected a finite number (a float holds up to about 1.8e308)")
    return float(number), extras


def score_one(reward_fn, sample):
    """One sample's reward: reward_fn called with verl's keyword arguments, sample = (data_source, solution_str,
    ground_truth, extra_info). Returns ((score, extras), None), or (None, problem) where problem says what the
    reward function did instead: "raised KeyError: ...", "called sys.exit(0)", "returned '1.0' (a str); ...".
    Lets through only what is neither an Exception nor SystemExit (KeyboardInterrupt). The reward worker's
    answer to a request too (reward_worker.Worker), so a sample is scored the same in either process."""
    data_source, solution_str, ground_truth, extra_info = sample
    try:
        out = reward_fn(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )
    except (Exception, SystemExit) as e:
        return None, describe(e)
    try:
        return read_score(out), None
    except ValueError as e:
        return None, str(e)
    except Exception as e:  # a dict whose keys cannot be listed, and the like
        return None, f"returned {safe_repr(out)}, which cannot be read ({describe(e)})"


def sample_place(where, index):
    """Where a sample is, for messages: "step 3, sample 17 of the batch", or "sample 17" with no `where`."""
    return f"{where}, sample {index} of the batch" if where else f"sample {index}"


def score_responses(
    reward_fn, data_sources, responses, ground_truths, extra_infos=None, indices=None, errors="raise", where=""
):
    """Score every response with `reward_fn` (score_one, verl's keyword arguments): in its worker process if it is
    a RewardWorker (load_reward_fns), else in this one. Returns (scores: a float per sample, extras: each extra key
    of dict returns -> one value per sample), with what was wrong checked by checked_scores: errors="raise" (the
    default) stops the run at a reward function that raises, exits, crashes, times out or returns no score;
    errors="skip" (--reward-errors skip) scores such a sample 0 and counts it."""
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
    extra_infos = extra_infos if extra_infos is not None else [None] * len(responses)
    samples = list(zip(data_sources, responses, ground_truths, extra_infos))
    if isinstance(reward_fn, RewardWorker):
        results = reward_fn.call(samples, stop_on_error=errors == "raise")
    else:
        results = []
        for sample in samples:
            results.append(score_one(reward_fn, sample))  # ((score, extras), None) or (None, problem)
            if errors == "raise" and results[-1][1] is not None:
                break
    indices = list(indices) if indices is not None else list(range(len(responses)))
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    return checked_scores(results, samples, name=name, indices=indices, errors=errors, where=where)


def checked_scores(results, samples, *, name, indices, errors, where):
    """score_responses' (scores, extras) from score_one's results, one per sample (fewer when a "raise" stopped).
    extras maps each extra key to one value per sample: None where a sample lacked it, or where its value was a
    number that is not finite (reported on stderr, one line per call). A failed sample raises RewardError naming
    the function, where (e.g. "step 3"), the sample's index (`indices`), its data source and the problem (a
    silently-zero reward would quietly train the policy on a bug); with errors="skip" it scores 0,
    extras["reward_error"] is 1.0 for it and 0.0 for the others (its mean is the error fraction, its sum the
    count), and one line per call, with the count and the first problem, goes to stderr."""
    scores, extras, failed, not_finite = [], {}, [], []

    def said(i):  # the sample, for messages
        return f"reward function {name}, {sample_place(where, indices[i])} (data_source={safe_repr(samples[i][0])})"

    for i, (value, problem) in enumerate(results):
        if problem is not None:
            if errors == "raise":
                raise RewardError(
                    f"{said(i)}: {problem}. To score such samples 0 and count them, pass --reward-errors skip"
                )
            value = (0.0, {})
            failed.append(f"{said(i)}: {problem}")
        score, sample_extras = value
        for key, v in sample_extras.items():
            if isinstance(v, (int, float)) and not is_finite(v):
                not_finite.append(f"{said(i)}: {key!r} = {safe_repr(v)}")
                v = None
            elif v is not None and not isinstance(v, (int, float, str)):
                warnings.warn(
                    f"reward function {name} returns {type(v).__name__} values in extra key {key!r}: kept in "
                    "extras, not logged (only numbers are: reward_extra/<key>/mean)",
                    stacklevel=3,
                )
            extras.setdefault(key, [None] * i).append(v)
        for column in extras.values():  # keep every extras column one entry per sample
            column.extend([None] * (i + 1 - len(column)))
        scores.append(score)
    if errors == "skip":
        extras["reward_error"] = [float(problem is not None) for _, problem in results]
        if failed:
            print(
                f"reward errors: {len(failed)} of {len(scores)} samples scored 0 (--reward-errors skip); the first: {failed[0]}",
                file=sys.stderr,
            )
    if not_finite:
        print(
            f"reward extras: {len(not_finite)} values are not finite numbers and are left out of reward_extra/<key>/mean; "
            f"the first: {not_finite[0]}",
            file=sys.stderr,
        )
    return scores, extras


def score_rows(
    reward_fn, rows, texts, first=0, response_ids=None, truncated=None, errors="raise", where="", conversations=None
):
    """score_responses for rows of verl's schema and one response text each. Error messages say
    "{where}, sample {i} of the batch": `where` names the batch ("step 3", "validation at step 2") and
    `first` is the place of this rank's first sample in it (every rank's samples count).

    What a reward function sees in extra_info: the row's own extra_info (data_prep.py writes split and
    index; verl's files hold more), plus, with response_ids (one list of token ids per sample) and/or
    truncated (one bool per sample), three keys added to a copy of it:

        response_ids      list[int]  the tokens the model wrote, the final EOS included
        response_length   int        len(response_ids), counted as verl and overlong_penalty count it
        truncated         bool       the response hit the length limit instead of stopping on its own

    and, multi-turn (conversations: one list of messages per sample), where the text scored is the
    model's last turn:

        conversation      list[dict] the messages after the prompt: the model's turns and the tools' results
        num_turns         int        the model's turns

    The row itself is never changed: a prompt's n samples share one row (the next sample must not see
    this one's tokens), and rows are reused every epoch.
    """
    inputs = row_inputs(rows, texts, first, response_ids, truncated, conversations)
    return score_responses(reward_fn, **inputs, errors=errors, where=where)


def row_inputs(rows, texts, first=0, response_ids=None, truncated=None, conversations=None):
    """score_responses' inputs for rows of verl's schema and one response text each (score_rows)."""
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    return dict(data_sources=[r["data_source"] for r in rows], responses=texts, ground_truths=truths,
                extra_infos=sample_infos(rows, response_ids, truncated, conversations),
                indices=range(first, first + len(rows)))  # fmt: skip


def sample_infos(rows, response_ids=None, truncated=None, conversations=None):
    """Each sample's extra_info, as score_rows describes it: the row's own, or a copy with the added keys."""
    infos = [r.get("extra_info") for r in rows]
    if response_ids is not None or truncated is not None or conversations is not None:
        infos = [dict(info or {}) for info in infos]
        for i, info in enumerate(infos):
            if response_ids is not None:
                info.update(response_ids=list(response_ids[i]), response_length=len(response_ids[i]))
            if truncated is not None:
                info["truncated"] = bool(truncated[i])
            if conversations is not None:
                info["conversation"] = [dict(m) for m in conversations[i]]
                info["num_turns"] = sum(m["role"] == "assistant" for m in conversations[i])
    return infos


# ----------------------------------------------------------------------------------------------
# Several reward functions with weights (TRL's reward_weights)


def weighted_score(fns, weights, names, data_source, solution_str, ground_truth, extra_info=None):
    """verl's reward signature over several reward functions:

        score = sum_i weights[i] * s_i        s_i = fns[i]'s score

    Returns {"score": ..., names[i]: s_i, f"{names[i]}/{key}": each extra key of fns[i]}, so the
    trainer logs reward_extra/<name>/mean for every function. A function that raises or returns a
    non-score (score_one), or a sum that is not a finite number (weighted_sum), raises RewardError naming it.
    Each function gets its own copy of ground_truth and extra_info: one that edits them in place must not
    change what the next one sees (own_copy)."""
    terms, out = [], {}
    for fn, weight, name in zip(fns, weights, names):
        result, problem = score_one(fn, (data_source, solution_str, *own_copy((ground_truth, extra_info))))
        if problem is not None:
            raise RewardError(f"{name} {problem}")
        value, extras = result
        terms.append((name, weight, value))
        out[name] = value
        out.update({f"{name}/{key}": v for key, v in extras.items()})
    total, problem = weighted_sum(terms)
    if problem is not None:
        raise RewardError(problem)
    return {"score": total, **out}


def weighted_sum(terms):
    """(sum_i w_i * s_i, None) over terms [(name, w_i, s_i)], each s_i finite; or (None, what is wrong) when the
    sum is not finite (10 * 1e308 is inf), naming every function, weight and score: not the learning rate's fault."""
    total = sum((w * s for _, w, s in terms), 0.0)
    if is_finite(total):
        return total, None
    said = " + ".join(f"{w:g} * {name} ({s:g})" for name, w, s in terms)
    return None, (
        f"the weighted sum {said} is {total}, not a finite number; lower --reward-weights, or scale the scores down"
    )


def own_copy(value):
    """A deep copy of `value` (the arguments of one reward function of several, as TRL builds each one's anew). It
    equals copy.deepcopy(value) for what a reward function gets, which crossed the worker's pipe as a pickle, and
    is faster: a batch of 2,048 responses of 300 tokens in 0.04 s, against 0.13 s."""
    return pickle.loads(pickle.dumps(value))


def weighted_reward(fns, weights=None, names=None):
    """One reward function (verl's signature) that scores with every one of `fns` and returns the
    weighted sum (weighted_score). weights: one float per function, default all 1.0; names: how
    each function's score is logged, default its __name__ (they must be unique)."""
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    names = [getattr(fn, "__name__", f"reward_{i}") for i, fn in enumerate(fns)] if names is None else list(names)
    if not fns:
        raise ValueError("weighted_reward needs at least one reward function")
    if len(weights) != len(fns):
        raise ValueError(
            f"{len(weights)} reward weights {weights} for {len(fns)} reward functions {names}; give one weight per --reward-fn"
        )
    if len(names) != len(fns) or len(set(names)) != len(names) or "score" in names:
        raise ValueError(f"reward names {names} must be {len(fns)} distinct names, none of them 'score'")
    fn = functools.partial(weighted_score, fns, weights, names)
    fn.__name__ = " + ".join(f"{w:g} * {n}" for w, n in zip(weights, names))  # for error messages
    return fn


def reward_names(specs):
    """A short, unique name per reward spec 'path/to/file.py:function': "file.function", and
    "file.function_2", ... for repeats. Names contain no '/', so reward_extra/<name>/mean reads as one
    function's mean."""
    names = []
    for spec in specs:
        path, _, function = spec.partition(":")
        file = path.rpartition(".")[2] if is_module_spec(spec) else os.path.splitext(os.path.basename(path))[0]
        names.append(f"{file}.{function or 'compute_score'}")
    return unique_names(names)


def unique_names(bases):
    """Each name as it is, a repeat as name_2, name_3, ...: one logged key per reward function."""
    names = []
    for base in bases:
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def load_reward_fns(specs, weights=None, timeout=300.0):
    """The reward function for one or more --reward-fn specs, for score_rows and score_responses: a
    RewardWorker, whose worker process loads them (trl_rewards.load_rewards: one verl function as it is, several
    summed by weighted_reward, TRL's batched ones called their way) and gives each call `timeout` seconds
    (--reward-timeout). Error messages name it "file.function", or
    "1 * file.f + 0.5 * other.g" for several. Raises RuntimeError, with the file's error, if they
    cannot be loaded.

    What a --reward-fn function may do, and what happens. The worker process (reward_worker.py), one per
    rank, lives as long as the run: state a file keeps at module level (a cache, a loaded model, a
    counter) persists from call to call. A call that raises, calls sys.exit(), ends the process (os._exit,
    a segfault), runs past the timeout (in Python or in C), or returns something that is not a finite
    real number (None, NaN, 10**400, the string "1.0", a dict without "score") is a reward error for that
    sample: by default (--reward-errors raise) the run stops, naming the function, the step, the sample,
    its data_source and what happened; with --reward-errors skip the sample scores 0 and is counted in the
    extra key "reward_error" (the trainer logs reward/errors, and val-aux/reward/errors for validation).
    After an exit, a crash or a time-out the worker is replaced, so module-level state starts again.
    Extra keys: numbers are logged as their mean; a value that is not a finite number (NaN, inf) is left
    out of that mean and reported on stderr; strings (maj@k's "pred") and other values are kept but not
    logged.
    """
    names = reward_names(specs)
    if len(specs) > 1 or weights is not None:  # weighted_reward's name
        names = [" + ".join(f"{w:g} * {n}" for w, n in zip(weights or [1.0] * len(names), names))]
    return RewardWorker(specs, weights, timeout, names[0])


class RewardWorker(Worker):
    """Reward functions ('path/to/file.py:function' specs, summed with `weights` as load_reward_fns
    does) run in this process's worker: call(samples) returns score_one's answer for each, ((score, extras),
    None) or (None, problem). `name` is how error messages call them."""

    what, timeout_flag = "reward worker", "--reward-timeout"

    def __init__(self, specs, weights=None, timeout=300.0, name="reward function"):
        self.specs, self.weights, self.__name__ = list(specs), weights, name
        load_error = f"--reward-fn {','.join(self.specs)}: could not load the reward functions"
        # the worker's loader: verl's functions answered by score_one, TRL's batched ones their way. Named by a
        # string because the worker process imports it; trl_rewards.py imports this file, not the other way round
        super().__init__("trl_rewards:load_rewards", (self.specs, weights), timeout, load_error)

    def waiting_on(self, request):
        """'reward function f (my_reward.py)', or 'reward functions f (a.py), g (b.py)' for several; a batched
        request (function index, batch: trl_rewards.score_rows) names its function."""
        specs = [self.specs[request[0]]] if len(request) == 2 and isinstance(request[1], dict) else self.specs
        names = [f"{fn} ({os.path.basename(path)})" for path, _, fn in (s.partition(":") for s in specs)]
        return f"reward function{'s' if len(names) > 1 else ''} {', '.join(names)}"


def is_trl(reward_fn):
    """Whether TRL-style functions are among the reward functions (a RewardWorker whose info names them)."""
    return isinstance(reward_fn, RewardWorker) and bool(getattr(reward_fn, "info", None))


def response_text(tokenizer, ids, eos_ids):
    """The text the reward sees: every token the model wrote except a final EOS (any of `eos_ids`,
    engine.stop_token_ids). We keep the other special tokens (verl drops them): with them dropped,
    our tiny policy learned to pad its answer with <pad> and <bos> instead of ever stopping, and
    still got full reward."""
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# DAPO's soft overlong punishment


def overlong_penalty(response_lengths, max_response_length, buffer_len, penalty_factor):
    """A reward penalty <= 0 per response for running into the last `buffer_len` tokens of the
    length budget (DAPO, Yu et al. 2025, as verl's DAPORewardManager adds it to the score):

        expected_len = max_response_length - buffer_len
        exceed       = length - expected_len
        penalty      = min(-exceed / buffer_len * penalty_factor, 0)

    0 up to expected_len, then linear down to -penalty_factor at max_response_length. As in verl,
    `length` counts every response token including the final EOS (verl sums the response's
    attention mask), and the penalty is not bounded below for lengths past max_response_length.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"overlong buffer_len must be in (0, max_response_length={max_response_length}], got {buffer_len}"
        )
    expected_len = max_response_length - buffer_len
    return [min(-(length - expected_len) / buffer_len * penalty_factor, 0.0) for length in response_lengths]
