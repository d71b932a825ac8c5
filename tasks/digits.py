"""The synthetic task "digits", the demo's and the tests' default data, and its scorer.

    prompt  "list 2 9 1 4 1 7 last"   ->   answer "7"        ("first" asks for the first digit)

Small enough that a tiny random-init model learns it with GRPO in a few minutes on 2 CPU cores,
yet the answer depends on the prompt: 2 x 10^6 distinct prompts, 10 answers, each ~10% of them.
A random policy is right about 1 time in 400 (the digit, then EOS, out of 20 tokens), so GRPO first
learns the format, then to copy the right digit. The test prompts never appear in training.
"""

import os
import random

from tasks.common import write_parquet

DIGITS_SOURCE = "synthetic/digits"
TASK_WORDS = [str(d) for d in range(10)] + ["list", "first", "last"]  # the tiny tokenizer's vocabulary


def digits_prompt(rng):
    digits = [rng.randrange(10) for _ in range(6)]
    which = rng.choice(["first", "last"])
    answer = digits[0] if which == "first" else digits[-1]
    return "list " + " ".join(map(str, digits)) + " " + which, str(answer)


def digits_rows(split, count, seed, exclude=()):
    """`count` distinct prompts of the digits task, in verl's schema, none of them in `exclude`."""
    rng, seen, rows = random.Random(f"digits-{split}-{seed}"), set(exclude), []
    while len(rows) < count:
        content, answer = digits_prompt(rng)
        if content in seen:
            continue
        seen.add(content)
        rows.append(
            {
                "data_source": DIGITS_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": len(rows)},
            }
        )
    return rows


def write_digits(out_dir, seed=0, train_size=20000, test_size=500, quiet=False):
    """Write the digits task's train.parquet and test.parquet (disjoint prompts) to `out_dir` (quiet: silently)."""
    test = digits_rows("test", test_size, seed)
    train = digits_rows("train", train_size, seed, exclude={r["prompt"][0]["content"] for r in test})
    write_parquet(train, os.path.join(out_dir, "train.parquet"), quiet)
    write_parquet(test, os.path.join(out_dir, "test.parquet"), quiet)


def digits_score(solution_str, ground_truth):
    """1 if the response is exactly the answer (surrounding spaces aside), else 0.

    Exact, not "contains": the trainer passes every token the model wrote but the final EOS, so
    an answer followed by junk tokens, or one that never stops, scores 0.
    """
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
