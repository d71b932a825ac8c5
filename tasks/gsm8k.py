"""GSM8K (Cobbe et al. 2021), grade-school math word problems: the data, and its scorer.

The data is the grade-school-math jsonl release, {"question": ..., "answer": "...\\n#### 18"} per line
(`python data_prep.py gsm8k --input DIR` converts DIR/train.jsonl and DIR/test.jsonl). The prompt asks
for the final answer after "####", as verl's gsm8k.py does, and the ground truth is the number there.
The scorer compares the model's answer with it as a number.
"""

import re
from decimal import Decimal, InvalidOperation

from tasks.common import jsonl_examples

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(jsonl_path, split):
    """Read one GSM8K jsonl file into rows of verl's schema (the same as verl's gsm8k.py)."""
    rows = []
    for where, example in jsonl_examples(jsonl_path, ("question", "answer")):
        final = re.search(r"#### (-?[0-9.,]+)", example["answer"])
        if final is None:
            raise ValueError(f"{where}: field 'answer' has no final '#### <number>' line")
        rows.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": example["question"] + " " + GSM8K_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final.group(1).replace(",", "")},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "answer": example["answer"],
                    "question": example["question"],
                },
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# The scorer

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
