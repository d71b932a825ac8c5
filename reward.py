"""Rewards: rule-based scores for the shipped data sources, and custom reward functions from a file.

Every reward function has verl's signature,

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

and returns either a real number (int, float, bool, a numpy or torch scalar) or a dict with a "score" key
plus extra keys that the trainer logs as metrics (reward_extra/<key>/mean). A verl user's reward file
works here unchanged: `--reward-fn my_reward.py:compute_score`.

What a reward function sees in extra_info: the row's own extra_info (data_prep.py writes split and
index; verl's files hold more), plus, when the caller passes the generated token ids to score_rows
(the trainer does), three keys added to a copy of it (the row itself is never changed: a prompt's n samples share
one row, and rows are reused every epoch):

    response_ids      list[int]  the tokens the model wrote, the final EOS included
    response_length   int        len(response_ids), counted as verl and overlong_penalty count it
    truncated         bool       the response hit the length limit instead of stopping on its own

Several reward functions combine into one with weighted_reward (TRL's reward_weights):
score = sum_i w_i * s_i, each s_i kept as an extra key.

What a --reward-fn function may do, and what happens. load_reward_fns runs the functions in a worker
process of their own (reward_worker.py), one per rank, which lives as long as the run: state a file keeps
at module level (a cache, a loaded model, a counter) persists from call to call. Each call may take up to
--reward-timeout seconds. A call that raises, calls sys.exit(), ends the process (os._exit, a segfault),
runs past the timeout (in Python or in C), or returns something that is not a finite real number (None,
NaN, 10**400, the string "1.0", a dict without "score") is a reward error for that sample: by default
(--reward-errors raise) the run stops, naming the function, the step, the sample, its data_source and what
happened; with --reward-errors skip the sample scores 0 and is counted in the extra key "reward_error"
(the trainer logs reward/errors, and val-aux/reward/errors for validation). After an exit, a crash or a
time-out the worker is replaced, so module-level state starts again. Extra keys: numbers are logged as
their mean; a value that is not a finite number (NaN, inf) is left out of that mean and reported on
stderr; strings (maj@k's "pred") and other values are kept but not logged. The built-in rewards
(compute_score) run in this process; MATH's math-verify has its own worker (math_score).
"""

import atexit
import functools
import importlib.util
import json
import math
import numbers
import os
import re
import select
import subprocess
import sys
import threading
import traceback
import warnings
from decimal import Decimal, InvalidOperation

from reward_worker import RewardWorker

# ----------------------------------------------------------------------------------------------
# GSM8K

GSM8K_SOURCE = "openai/gsm8k"

# A number as models write it: optional sign and dollar, digits with or without thousands
# separators, optional decimals. "1,2,3" is three numbers; "3,000" is one.
NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"


def to_number(text):
    """'3,000' -> Decimal('3000'), '$18' -> 18, '18.00' -> 18.00 (== 18); None if not a number."""
    try:
        value = Decimal(str(text).strip().replace(",", "").replace("$", "").rstrip("."))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_gsm8k_answer(solution_str, method="strict"):
    """The model's final answer as a string, or None when it gave none.

    strict:   the number right after the last "####" (verl's format, asked for in the prompt).
    flexible: the last number anywhere in the response.
    """
    if method == "strict":
        at = solution_str.rfind("####")
        if at < 0:
            return None
        found = re.match(r"\s*(" + NUMBER + ")", solution_str[at + 4 :])
        return found.group(1) if found else None
    if method == "flexible":
        numbers = re.findall(NUMBER, solution_str)
        return numbers[-1] if numbers else None
    raise ValueError(f"unknown GSM8K answer extraction {method!r}; expected 'strict' or 'flexible'")


def gsm8k_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """`score` if the extracted answer equals the ground truth as a number, `format_score` if an
    answer was found but is wrong, 0 if none was found.

    Compared as numbers, so "3,000", "$18", "18.00" and "18." (end of a sentence) all count.
    """
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    predicted, expected = to_number(answer), to_number(ground_truth)
    if expected is None:  # a non-numeric ground truth: fall back to comparing text
        return score if answer.strip() == str(ground_truth).strip() else format_score
    return score if predicted == expected else format_score


# ----------------------------------------------------------------------------------------------
# The synthetic digits task (data_prep.py)

DIGITS_SOURCE = "synthetic/digits"


def digits_score(solution_str, ground_truth):
    """1 if the response is exactly the answer (surrounding spaces aside), else 0.

    Exact, not "contains": the trainer passes every token the model wrote but the final EOS, so
    an answer followed by junk tokens, or one that never stops, scores 0.
    """
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


# ----------------------------------------------------------------------------------------------
# The times-table task (data_prep.py multiply)

MULTIPLY_SOURCE = "synthetic/multiply"


def multiply_score(solution_str, ground_truth):
    """1 if the last number in the response is the product, else 0: "7 * 8 = 56." scores, and so
    does prose that ends on the right number; a response cut off mid-number does not."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")


# ----------------------------------------------------------------------------------------------
# MATH (Hendrycks et al. 2021): the answer in the last \boxed{}, compared with math-verify
#
# The data_sources verl's default_compute_score sends to its \boxed{} MATH scorer. verl's other
# math sources ("math_dapo", "aime*", the numina_* ones) expect other answer formats ("Answer: 42")
# and are not included: score those with --reward-fn.
MATH_SOURCES = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}

MATH_TIMEOUT = 5.0  # seconds for one response: parsing and comparing a sane answer takes milliseconds

# "1\,000" is a LaTeX thousands separator, which math-verify reads as a product (1 * 000 = 0)
THIN_SPACE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")


def last_boxed(text):
    r"""The content of the last \boxed{...} (or \fbox{...}) in `text`, or None if there is none.

    Braces are matched, so "\boxed{\frac{1}{2}}" gives "\frac{1}{2}"; escaped braces (\{ \}) are
    text, not grouping. The brace-less form "\boxed 5" gives what follows up to the next '$' or
    line end. The last box is the answer even when it cannot be read: an unclosed "\boxed{" (a
    response cut off mid-answer) gives None, never an earlier box.
    """
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    command = re.match(r"\\(?:boxed|fbox)(\s*)", text[at:])
    rest = text[at + command.end() :]
    if not rest.startswith("{"):
        if not command.group(1):  # "\boxedx" is some other command
            return None
        answer = re.split(r"[$\n]", rest, maxsplit=1)[0].strip()
        return answer or None
    depth = 0
    for token in re.finditer(r"\\.|[{}]|[^\\{}]+", rest, re.DOTALL):  # \x pairs first: "\{" is text
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return rest[1 : token.start()].strip()
    return None


def math_verify_score(solution_str, ground_truth):
    r"""(score, pred) for one response, with no time limit: the comparison math_score runs in its
    worker process. score is 1.0 if the answer equals the ground truth as mathematics, else 0.0;
    pred is the answer text that was compared (None if the response gave none).

    The answer is the last \boxed{...}; a response with no \boxed at all falls back to math-verify's
    own extraction (the last LaTeX or plain expression, "The final answer is $x$" first).
    math-verify then compares values, not strings: 0.5 = \frac{1}{2} = 1/2 = \dfrac12 = 50\%,
    {1,2} = {2,1}, [0,1) != (0,1), \sqrt{50} = 5\sqrt{2}, "x = 3" equals 3, decimals to 6 places.
    The one rule we add: a thin space between digit groups is dropped first (1\,000 = 1000).
    Units and degree signs are dropped ("5 \text{ cm}" = 5, "30^\circ" = 30), as the MATH
    benchmark's own answer normalization does; we keep that, so "5 m" also equals "5 cm".

    Garbage in the response scores 0. A ground truth math-verify cannot read is a ValueError: it is
    a data bug, and a silent 0 would train on it (every sample of that prompt scoring 0).
    """
    # imported here, not at the top: only math_score's worker process needs sympy
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    truth = str(ground_truth)
    truth = THIN_SPACE.sub("", last_boxed(truth) or truth)  # a whole reference solution works too
    # parsing_timeout=None, timeout_seconds=None: no signal.alarm (see math_score); math-verify's
    # own error handling stays on (raise_on_error=False), so bad input gives [] / False, not errors
    gold = parse("\\boxed{" + truth + "}", [LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        raise ValueError(
            f"math ground truth {ground_truth!r} is not an answer math-verify can read; expected the content of "
            "the reference solution's last \\boxed{}, e.g. '\\frac{1}{2}' (data_prep.py math writes it)"
        )
    try:
        answer = last_boxed(solution_str)
        if answer is not None:
            found = parse(
                "\\boxed{" + THIN_SPACE.sub("", answer) + "}",
                [LatexExtractionConfig(), ExprExtractionConfig()],
                parsing_timeout=None,
            )
        elif "\\boxed" in solution_str or "\\fbox" in solution_str:
            found = []  # the last box is unreadable: no answer, not a hunt for another one
        else:
            found = parse(solution_str, [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
            answer = found[-1] if found and isinstance(found[-1], str) else None  # the text it matched
        correct = bool(found) and verify(gold, found, timeout_seconds=None)
    except Exception:  # math-verify catches its own errors; this makes "never raises" ours to promise
        return 0.0, None
    return (1.0 if correct else 0.0), answer


def serve_math_worker():
    """The worker's loop: one JSON request [solution_str, ground_truth] per stdin line, one JSON
    reply per stdout line: {"score", "pred"} or {"error"}. Ends when stdin closes."""
    import logging

    import math_verify  # noqa: F401  (imported before "ready", so the first request is not charged for it)

    # its "Timeout is disabled" warning: the timeout is math_score's, which kills this process
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    print("ready", flush=True)
    for line in sys.stdin:
        solution_str, ground_truth = json.loads(line)
        try:
            score, pred = math_verify_score(solution_str, ground_truth)
            reply = {"score": score, "pred": pred}
        except ValueError as e:
            reply = {"error": str(e)}
        print(json.dumps(reply), flush=True)


# Why a worker process. math-verify 0.9.0's own timeouts (parse's parsing_timeout and verify's
# timeout_seconds, 5 s each by default) use signal.alarm: called outside the main thread (a reward
# run from a thread pool) they raise ValueError, they cancel any alarm the caller had set, and a
# signal only lands between Python bytecodes, never inside one long C call. Turned off
# (None), hostile answers hang: \boxed{9^{9^{9^{9}}}}, \boxed{(10^{10})!}, \boxed{(x+1)^{100000}}
# each ran past 20 s before we stopped them. So math_score runs math-verify, timeouts off, in a
# child process that it kills after `timeout` seconds: no signals, any thread, and every hang ends.
# One child per process (a forked process starts its own), started on first use, restarted after
# a kill; callers take turns.
_math_worker = {"pid": None, "process": None}
_math_lock = threading.Lock()


def _stop_math_worker():
    process = _math_worker["process"]
    if process is not None and _math_worker["pid"] == os.getpid():
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()
    _math_worker.update(pid=None, process=None)


atexit.register(_stop_math_worker)


def _start_math_worker():
    """This process's worker, started if there is none (or it died, or we are a forked child)."""
    process = _math_worker["process"]
    if process is not None and _math_worker["pid"] == os.getpid() and process.poll() is None:
        return process
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import reward; reward.serve_math_worker()"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":  # it failed to import; its traceback is on stderr
        process.kill()
        raise RuntimeError(
            "math_score's worker process could not start (its error is printed above); is math-verify installed? "
            "pip install -r requirements.txt"
        )
    _math_worker.update(pid=os.getpid(), process=process)
    return process


def math_score(solution_str, ground_truth, timeout=MATH_TIMEOUT):
    r"""{"score": 1.0 or 0.0, "pred": the answer compared} for one response to a MATH problem
    (math_verify_score, in a worker process). `ground_truth` is the content of the reference
    solution's last \boxed{}, e.g. "\frac{1}{2}" or "0.5" (data_prep.py math).

    An answer that takes longer than `timeout` seconds scores 0 with a warning (the worker is
    killed, and the next call starts a new one in under a second); a ground truth math-verify
    cannot read raises ValueError.
    "pred" is what eval.py votes on for maj@k.
    """
    request = json.dumps([str(solution_str), str(ground_truth)]) + "\n"
    with _math_lock:
        for _ in range(2):  # a worker found dead is replaced once; dying twice is this answer's doing
            process = _start_math_worker()
            try:
                process.stdin.write(request)
                process.stdin.flush()
                ready, _, _ = select.select([process.stdout], [], [], timeout)
                line = process.stdout.readline() if ready else ""
            except OSError:  # it had died before we wrote
                ready, line = True, ""
            if line:
                break
            _stop_math_worker()
            if not ready:
                break  # timed out: the same answer would time out again
    if not line:
        pred = last_boxed(str(solution_str))
        problem = f"gave up after {timeout} s" if not ready else "the worker died on it"
        warnings.warn(f"math_score: {problem} on the answer {pred!r:.100}; scored 0", stacklevel=2)
        return {"score": 0.0, "pred": pred}
    reply = json.loads(line)
    if "error" in reply:
        raise ValueError(reply["error"])
    return reply


# ----------------------------------------------------------------------------------------------
# Dispatch by data source (verl's `default_compute_score`)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in reward for a row's data_source: a float, or for MATH a dict {"score", "pred"}
    (verl's reward functions return either). Unknown sources are an error, not a 0."""
    if data_source == GSM8K_SOURCE:
        return gsm8k_score(solution_str, ground_truth)
    if data_source == DIGITS_SOURCE:
        return digits_score(solution_str, ground_truth)
    if data_source == MULTIPLY_SOURCE:
        return multiply_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    raise ValueError(
        f"no built-in reward for data_source {data_source!r}; built-in sources: {sorted(BUILTIN_SOURCES)}. "
        "For other data, pass a reward file: --reward-fn path/to/file.py:function_name"
    )


BUILTIN_SOURCES = {GSM8K_SOURCE, DIGITS_SOURCE, MULTIPLY_SOURCE} | MATH_SOURCES

# ----------------------------------------------------------------------------------------------
# Custom reward functions


def load_reward_fn(spec):
    """Load a reward function from 'path/to/file.py:function_name'.

    Without ':function_name' the function is `compute_score`, verl's default name.
    """
    path, _, name = spec.partition(":")
    name = name or "compute_score"
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward file {path!r} (from {spec!r}) does not exist; expected path/to/file.py:function_name"
        )
    module_spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward file {path!r} has no function {name!r}; its functions: {found}")
    return fn


class RewardError(RuntimeError):
    """A reward function raised, exited, crashed, timed out, or returned something that is not a score."""


def safe_repr(value, limit=80):
    """repr(value), cut to `limit` characters; never raises (a reward may return anything)."""
    try:
        text = repr(value)
    except Exception:  # a broken __repr__, or an int past Python's 4300-digit limit
        text = f"<a {type(value).__name__} that cannot be printed>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(e):
    """What an exception from a reward function says, for an error message: "raised KeyError: 'x'
    (my_reward.py:12, in f)" (the line it was raised at), or "called sys.exit(0)"."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({safe_repr(e.code)})"
    if isinstance(e, RewardError):  # weighted_score's, which already names the function
        return str(e)
    try:
        text = str(e)
    except Exception:
        text = "<a message that cannot be printed>"
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"raised {type(e).__name__}: {text[:500]}{at}"


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


def score_one(reward_fn, data_source, solution_str, ground_truth, extra_info=None):
    """(score, extras, None) for one sample, or (None, None, problem) where problem says what the reward
    function did instead: "raised KeyError: ...", "called sys.exit(0)", "returned '1.0' (a str); ...".
    Lets through only what is neither an Exception nor SystemExit (KeyboardInterrupt)."""
    try:
        out = reward_fn(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )
    except (Exception, SystemExit) as e:
        return None, None, describe(e)
    try:
        value, extras = read_score(out)
    except ValueError as e:
        return None, None, str(e)
    except Exception as e:  # a dict whose keys cannot be listed, and the like
        return None, None, f"returned {safe_repr(out)}, which cannot be read ({describe(e)})"
    return value, extras, None


def sample_place(where, index):
    """Where a sample is, for messages: "step 3, sample 17 of the batch", or "sample 17" with no `where`."""
    return f"{where}, sample {index} of the batch" if where else f"sample {index}"


def score_responses(
    reward_fn, data_sources, responses, ground_truths, extra_infos=None, indices=None, errors="raise", where=""
):
    """Score every response with `reward_fn`, called with verl's keyword arguments: in its worker process
    if it is a RewardWorker (load_reward_fns), else in this one.

    Returns (scores, extras): scores is a list of floats; extras maps each extra key of dict
    returns to a list with one value per sample (None where a sample lacked it, or where its value was a
    number that is not finite: those are reported on stderr, one line per call).

    errors="raise" (the default): a reward function that raises, exits, crashes, times out or returns
    something that is not a score stops the run (RewardError) naming the function, where (e.g. "step 3"),
    the sample's index (`indices`), its data source and the problem: a silently-zero reward would
    quietly train the policy on a bug.
    errors="skip" (--reward-errors skip): such a sample scores 0, extras["reward_error"] is 1.0 for
    it and 0.0 for the others (its mean is the error fraction, its sum the count), and one line
    per call, with the count and the first problem, goes to stderr.
    """
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
    extra_infos = extra_infos if extra_infos is not None else [None] * len(responses)
    indices = list(indices) if indices is not None else list(range(len(responses)))
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    samples = list(zip(data_sources, responses, ground_truths, extra_infos))
    if isinstance(reward_fn, RewardWorker):
        results = reward_fn.score(samples, stop_on_error=errors == "raise")
    else:
        results = []
        for sample in samples:
            results.append(score_one(reward_fn, *sample))
            if errors == "raise" and results[-1][2] is not None:
                break
    scores, extras, failed, not_finite = [], {}, [], []
    for i, (value, sample_extras, problem) in enumerate(results):
        said = f"reward function {name}, {sample_place(where, indices[i])} (data_source={safe_repr(samples[i][0])})"
        if problem is not None:
            if errors == "raise":
                raise RewardError(
                    f"{said}: {problem}. To score such samples 0 and count them, pass --reward-errors skip"
                )
            value, sample_extras = 0.0, {}
            failed.append(f"{said}: {problem}")
        for key, v in sample_extras.items():
            if isinstance(v, (int, float)) and not is_finite(v):
                not_finite.append(f"{said}: {key!r} = {safe_repr(v)}")
                v = None
            elif v is not None and not isinstance(v, (int, float, str)):
                warnings.warn(
                    f"reward function {name} returns {type(v).__name__} values in extra key {key!r}: kept in "
                    "extras, not logged (only numbers are: reward_extra/<key>/mean)",
                    stacklevel=2,
                )
            extras.setdefault(key, [None] * i).append(v)
        for column in extras.values():  # keep every extras column one entry per sample
            column.extend([None] * (i + 1 - len(column)))
        scores.append(value)
    if errors == "skip":
        extras["reward_error"] = [float(problem is not None) for _, _, problem in results]
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


def score_rows(reward_fn, rows, texts, first=0, response_ids=None, truncated=None, errors="raise", where=""):
    """score_responses for rows of verl's schema and one response text each. Error messages say
    "{where}, sample {i} of the batch": `where` names the batch ("step 3", "validation at step 2") and
    `first` is the place of this rank's first sample in it (every rank's samples count).

    With response_ids (one list of token ids per sample) and/or truncated (one bool per sample),
    each reward call gets a copy of its row's extra_info with "response_ids", "response_length" =
    len(response_ids) and "truncated" added (the module docstring). The row is not changed: a
    prompt's n samples share one row, and the next sample must not see this one's tokens.
    """
    infos = [r.get("extra_info") for r in rows]
    if response_ids is not None or truncated is not None:
        infos = [dict(info or {}) for info in infos]
        for i, info in enumerate(infos):
            if response_ids is not None:
                info.update(response_ids=list(response_ids[i]), response_length=len(response_ids[i]))
            if truncated is not None:
                info["truncated"] = bool(truncated[i])
    return score_responses(
        reward_fn,
        [r["data_source"] for r in rows],
        texts,
        [r["reward_model"]["ground_truth"] for r in rows],
        infos,
        indices=range(first, first + len(rows)),
        errors=errors,
        where=where,
    )


# ----------------------------------------------------------------------------------------------
# Several reward functions with weights (TRL's reward_weights)


def weighted_score(fns, weights, names, data_source, solution_str, ground_truth, extra_info=None):
    """verl's reward signature over several reward functions:

        score = sum_i weights[i] * s_i        s_i = fns[i]'s score

    Returns {"score": ..., names[i]: s_i, f"{names[i]}/{key}": each extra key of fns[i]}, so the
    trainer logs reward_extra/<name>/mean for every function. A function that raises or returns a
    non-score (score_one) raises RewardError naming it."""
    total, out = 0.0, {}
    for fn, weight, name in zip(fns, weights, names):
        value, extras, problem = score_one(fn, data_source, solution_str, ground_truth, extra_info)
        if problem is not None:
            raise RewardError(f"{name} {problem}")
        total += weight * value
        out[name] = value
        out.update({f"{name}/{key}": v for key, v in extras.items()})
    return {"score": total, **out}


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
        base = f"{os.path.splitext(os.path.basename(path))[0]}.{function or 'compute_score'}"
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def load_reward_fns_in_process(specs, weights=None):
    """The reward function for one or more --reward-fn specs, loaded into this process (the reward
    worker's): the function itself for one spec and no weights, else weighted_reward over all of them,
    named by reward_names."""
    if len(specs) == 1 and weights is None:
        return load_reward_fn(specs[0])
    return weighted_reward([load_reward_fn(s) for s in specs], weights, reward_names(specs))


def load_reward_fns(specs, weights=None, timeout=300.0):
    """The reward function for one or more --reward-fn specs, for score_rows and score_responses: a
    RewardWorker, which runs load_reward_fns_in_process(specs, weights) in a worker process and gives
    each call `timeout` seconds (--reward-timeout; the module docstring says what else it guards
    against). Error messages name it "file.function", or "1 * file.f + 0.5 * other.g" for several.
    Raises RuntimeError, with the file's error, if they cannot be loaded."""
    names = reward_names(specs)
    if len(specs) > 1 or weights is not None:  # weighted_reward's name
        names = [" + ".join(f"{w:g} * {n}" for w, n in zip(weights or [1.0] * len(names), names))]
    return RewardWorker(specs, weights, timeout, names[0])


def response_text(tokenizer, ids, eos_ids):
    """The text the reward sees: every token the model wrote except a final EOS (any of `eos_ids`,
    rollout.stop_token_ids). We keep the other special tokens (verl drops them): with them dropped,
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
