r"""MATH (Hendrycks et al. 2021), competition problems whose answer is the last \boxed{}: the data, and
its scorer, which compares answers as mathematics with math-verify.

The data is MATH-format jsonl you bring (Hendrycks et al.'s fields, which MATH-500 and the lighteval
mirror keep), one problem a line: {"problem": str, "solution": str with the final answer in
\boxed{...}, optional "level", "type"}; other fields are ignored. The ground truth is the content of
the solution's last \boxed{}, found exactly as the scorer finds the model's answer (last_boxed).
`python data_prep.py math --input` takes one .jsonl file, written to <out>/<file name>.parquet with
that name as the split (test.jsonl -> test.parquet), or a directory holding train.jsonl and/or
test.jsonl, as for GSM8K (each one found is converted).

math-verify runs in a worker process of its own, which is killed when an answer takes too long
(math_verify_worker.py says why, and holds the comparison it runs: math_verify_score).
"""

import os
import warnings

from tasks import math_verify_worker
from tasks.common import jsonl_examples
from tasks.math_verify_worker import last_boxed

# What verl's math_dataset.py writes: its old name "lighteval/MATH" is gone from the Hub, and this
# mirror is the name verl routes to its MATH reward, so our files and verl's are interchangeable.
# MATH-500 files can say "HuggingFaceH4/MATH-500" (--data-source) to be reported under that name.
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # verl's

# The data_sources verl's default_compute_score sends to its \boxed{} MATH scorer. verl's other
# math sources ("math_dapo", "aime*", the numina_* ones) expect other answer formats ("Answer: 42")
# and are not included: score those with --reward-fn.
MATH_SOURCES = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}


def math_rows(jsonl_path, split, data_source=MATH_SOURCE):
    """Read one MATH-format jsonl file into rows of verl's schema (the same as verl's
    math_dataset.py, plus the problem, solution, level and type in extra_info)."""
    rows = []
    for where, example in jsonl_examples(jsonl_path, ("problem", "solution")):
        answer = last_boxed(example["solution"])
        if not answer:
            raise ValueError(
                f"{where}: field 'solution' has no final answer in \\boxed{{...}} (the last \\boxed is missing, "
                f"empty or unclosed): ...{example['solution'][-80:]!r}"
            )
        # level/type as text: MATH writes "Level 5", MATH-500 writes 5, and a parquet column has one type
        optional = {k: None if example.get(k) is None else str(example[k]) for k in ("level", "type")}
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": example["problem"] + " " + MATH_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    **optional,
                    "problem": example["problem"],
                    "solution": example["solution"],
                },
            }
        )
    if not rows:
        raise ValueError(f"{jsonl_path}: no rows")
    return rows


def math_inputs(path):
    """The (jsonl file, split) pairs behind --input: a file is its own split (its name without
    .jsonl); a directory gives its train.jsonl and test.jsonl, whichever exist."""
    if os.path.isfile(path):
        return [(path, os.path.splitext(os.path.basename(path))[0])]
    found = [(os.path.join(path, f"{s}.jsonl"), s) for s in ("train", "test")]
    found = [(f, s) for f, s in found if os.path.isfile(f)]
    if not found:
        raise FileNotFoundError(
            f"{path}: expected a .jsonl file, or a directory holding train.jsonl and/or test.jsonl (MATH format: "
            '{"problem": ..., "solution": "... \\boxed{answer}"} per line)'
        )
    return found


# ----------------------------------------------------------------------------------------------
# The scorer: the answer in the last \boxed{}, compared with math-verify (math_verify_worker.py)

MATH_TIMEOUT = 5.0  # seconds for one response: parsing and comparing a sane answer takes milliseconds


def math_score(solution_str, ground_truth, timeout=MATH_TIMEOUT):
    r"""{"score": 1.0 or 0.0, "pred": the answer compared} for one response to a MATH problem
    (math_verify_score, in a worker process). `ground_truth` is the content of the reference
    solution's last \boxed{}, e.g. "\frac{1}{2}" or "0.5" (data_prep.py math).

    An answer that takes longer than `timeout` seconds scores 0 with a warning (the worker is
    killed, and the next call starts a new one in under a second); a ground truth math-verify
    cannot read raises ValueError.
    "pred" is what eval.py votes on for maj@k.
    """
    reply, problem = math_verify_worker.ask(str(solution_str), str(ground_truth), timeout)
    if reply is None:
        pred = last_boxed(str(solution_str))
        warnings.warn(f"math_score: {problem} on the answer {pred!r:.100}; scored 0", stacklevel=2)
        return {"score": 0.0, "pred": pred}
    if "error" in reply:
        raise ValueError(reply["error"])
    return reply
