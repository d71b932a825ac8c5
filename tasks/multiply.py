"""The times-table task "multiply", the README's real-model example (SmolLM2-135M-Instruct), and its scorer.

    prompt  "What is 7 * 8?"   ->   answer "56"    (scored by the last number in the response)

Every product a x b for a, b in [low, high]. test_pairs factor pairs {a, b} are held out in both
orders, so "8 * 7" in training never gives away "7 * 8" in the test set. A pretrained chat model
knows many of these facts but answers with prose that often omits or misstates the product, so RL
has to improve what it computes, not only how it writes it.

The "3x2" variant (write_products) asks for a 3-digit times a 2-digit number, "What is 347 * 58?",
which a small model cannot compute in its head: the multi-turn tool-use example, where the model
learns to call a calculator. Factors that end in 0 are left out (347 * 50 is nearly a times table);
train_size and test_size distinct pairs are drawn with the seed, none of them in both splits.
"""

import json
import os
import random

from tasks.common import write_parquet
from tasks.gsm8k import gsm8k_score

MULTIPLY_SOURCE = "synthetic/multiply"


def multiply_rows(pairs, split, instruction=""):
    """The rows asking for a * b; `instruction`, if given, follows the question in the user message."""
    return [
        {
            "data_source": MULTIPLY_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {a} * {b}?" + (f" {instruction}" if instruction else "")}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write_multiply(out_dir, seed=0, low=2, high=12, test_pairs=25):
    """Write the multiply task's train.parquet and test.parquet to `out_dir`: the held-out factor
    pairs, in both orders, are the test set; every other a * b is training."""
    factor_pairs = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    if not 0 < test_pairs < len(factor_pairs):
        raise ValueError(
            f"test_pairs must be between 1 and {len(factor_pairs) - 1} (there are {len(factor_pairs)} factor pairs), got {test_pairs}"
        )
    random.Random(f"multiply-{seed}").shuffle(factor_pairs)
    held_out = set(factor_pairs[:test_pairs])
    questions = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(f"multiply-order-{seed}").shuffle(questions)
    test = [(a, b) for a, b in questions if (min(a, b), max(a, b)) in held_out]
    train = [(a, b) for a, b in questions if (min(a, b), max(a, b)) not in held_out]
    write_parquet(multiply_rows(train, "train"), os.path.join(out_dir, "train.parquet"))
    write_parquet(multiply_rows(test, "test"), os.path.join(out_dir, "test.parquet"))


# The worked examples a "3x2" prompt may start with (shots): each a question, the calculator call in
# tools.py's format, its result and the answer. SmolLM2-135M-Instruct writes almost no calls without
# them (P(first token is a call) ~0.2% even with one example, ~30% with two, ~77% with three).
DEMO_PAIRS = ((123, 45), (806, 17), (359, 62))


def demo_messages(shots):
    """The last `shots` worked examples of DEMO_PAIRS as chat messages (user, assistant, tool, assistant)."""
    messages = []
    for a, b in DEMO_PAIRS[len(DEMO_PAIRS) - shots :] if shots else ():
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        messages += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"The answer is {a * b}."},
        ]
    return messages


def write_products(out_dir, seed=0, train_size=4000, test_size=200, instruction="", shots=0):
    """Write the "3x2" task's train.parquet and test.parquet to `out_dir`: a * b for a 3-digit a and
    a 2-digit b, neither a multiple of 10 (810 * 81 = 65,610 pairs less the DEMO_PAIRS), train_size +
    test_size distinct pairs drawn with `seed`, the first test_size of them held out. `instruction`:
    text after the question in each user message, e.g. "Use the calculator.". `shots` (0 to 3): worked
    examples of a calculator call (demo_messages) before each question; their pairs are in neither split."""
    a_values = [a for a in range(100, 1000) if a % 10]
    b_values = [b for b in range(10, 100) if b % 10]
    every = [(a, b) for a in a_values for b in b_values if (a, b) not in DEMO_PAIRS]
    total = len(every)
    if train_size < 1 or test_size < 1 or train_size + test_size > total:
        raise ValueError(
            f"train_size and test_size must be at least 1 and add up to at most {total} pairs, got {train_size} + {test_size}"
        )
    if not 0 <= shots <= len(DEMO_PAIRS):
        raise ValueError(f"shots must be between 0 and {len(DEMO_PAIRS)}, got {shots}")
    pairs = random.Random(f"products-3x2-{seed}").sample(every, train_size + test_size)
    test, train = pairs[:test_size], pairs[test_size:]
    demos = demo_messages(shots)
    for rows, split in ((train, "train"), (test, "test")):
        rows = multiply_rows(rows, split, instruction)
        for row in rows:
            row["prompt"] = demos + row["prompt"]
        write_parquet(rows, os.path.join(out_dir, f"{split}.parquet"))


def multiply_score(solution_str, ground_truth):
    """1 if the last number in the response is the product, else 0: "7 * 8 = 56." scores, and so
    does prose that ends on the right number; a response cut off mid-number does not."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")
