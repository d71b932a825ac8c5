"""The times-table task "multiply", the README's real-model example (SmolLM2-135M-Instruct), and its scorer.

    prompt  "What is 7 * 8?"   ->   answer "56"    (scored by the last number in the response)

Every product a x b for a, b in [low, high]. test_pairs factor pairs {a, b} are held out in both
orders, so "8 * 7" in training never gives away "7 * 8" in the test set. A pretrained chat model
knows many of these facts but answers with prose that often omits or misstates the product, so RL
has to improve what it computes, not only how it writes it.
"""

import os
import random

from tasks.common import write_parquet
from tasks.gsm8k import gsm8k_score

MULTIPLY_SOURCE = "synthetic/multiply"


def multiply_rows(pairs, split):
    return [
        {
            "data_source": MULTIPLY_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
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


def multiply_score(solution_str, ground_truth):
    """1 if the last number in the response is the product, else 0: "7 * 8 = 56." scores, and so
    does prose that ends on the right number; a response cut off mid-number does not."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")
