"""Rewards: rule-based scores for the shipped data sources, and custom reward functions from a file.

Every reward function has verl's signature,

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

and returns either a float or a dict with a "score" key plus extra keys that the trainer logs as
metrics. A verl user's reward file works here unchanged: `--reward-fn my_reward.py:compute_score`.
"""

import importlib.util
import math
import os
import re
from decimal import Decimal, InvalidOperation

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
# Dispatch by data source (verl's `default_compute_score`)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in reward for a row's data_source. Unknown sources are an error, not a 0."""
    if data_source == GSM8K_SOURCE:
        return gsm8k_score(solution_str, ground_truth)
    if data_source == DIGITS_SOURCE:
        return digits_score(solution_str, ground_truth)
    if data_source == MULTIPLY_SOURCE:
        return multiply_score(solution_str, ground_truth)
    raise ValueError(
        f"no built-in reward for data_source {data_source!r}; built-in sources: {sorted(BUILTIN_SOURCES)}. "
        "For other data, pass a reward file: --reward-fn path/to/file.py:function_name"
    )


BUILTIN_SOURCES = {GSM8K_SOURCE, DIGITS_SOURCE, MULTIPLY_SOURCE}

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
    """A reward function raised or returned something that is not a score."""


def score_responses(reward_fn, data_sources, responses, ground_truths, extra_infos=None, indices=None):
    """Score every response with `reward_fn`, called with verl's keyword arguments.

    Returns (scores, extras): scores is a list of floats; extras maps each extra key of dict
    returns to a list with one value per sample (None where a sample lacked it).
    A reward function that raises stops the run with the sample index, data source and the
    exception: a silently-zero reward would quietly train the policy on a bug.
    """
    extra_infos = extra_infos if extra_infos is not None else [None] * len(responses)
    indices = indices if indices is not None else range(len(responses))
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    scores, extras = [], {}
    for i, (idx, ds, resp, gt, info) in enumerate(zip(indices, data_sources, responses, ground_truths, extra_infos)):
        try:
            out = reward_fn(data_source=ds, solution_str=resp, ground_truth=gt, extra_info=info)
        except Exception as e:
            raise RewardError(
                f"reward function {name} raised on sample {idx} (data_source={ds!r}): {type(e).__name__}: {e}"
            ) from e
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(
                    f"reward function {name} returned a dict without 'score' on sample {idx} (data_source={ds!r}): keys {sorted(out)}"
                )
            for key, value in out.items():
                if key != "score":
                    extras.setdefault(key, [None] * i).append(value)
            out = out["score"]
        for column in extras.values():  # keep every extras column one entry per sample
            column.extend([None] * (i + 1 - len(column)))
        try:
            value = float(out)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise RewardError(
                f"reward function {name} returned {out!r} on sample {idx} (data_source={ds!r}); expected a finite number"
            )
        scores.append(value)
    return scores, extras


def score_rows(reward_fn, rows, texts, first=0):
    """score_responses for rows of verl's schema and one response text each; `first` numbers the
    samples in error messages (their place in the whole batch, not in this rank's share)."""
    return score_responses(
        reward_fn,
        [r["data_source"] for r in rows],
        texts,
        [r["reward_model"]["ground_truth"] for r in rows],
        [r.get("extra_info") for r in rows],
        indices=range(first, first + len(rows)),
    )


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
