"""Reward functions written the way open-r1's src/open_r1/rewards.py writes its own (our code, not a copy): what a
TRL user's copy of that file asks of the trainer. Each reads a conversational completion as completion[0]["content"],
takes the dataset's `solution` column as a keyword list, swallows the rest with **kwargs, and returns one float or
None per completion. The factories return an inner function whose __name__ is what TRL logs (rewards/<name>/mean);
len_reward scales by the shortest and longest completion of the whole call, so the call must get the whole batch.
tests/test_trl_openr1.py runs them through the reward worker."""

import functools
import math
import re

from math_verify import parse, verify

THINK_ANSWER = re.compile(r"<think>\n(.+?)\n</think>\n<answer>\n(.+?)\n</answer>", re.DOTALL)
TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
STEP_MARKERS = re.compile(r"Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,", re.MULTILINE)


def contents(completions):
    return [completion[0]["content"] for completion in completions]


def accuracy_reward(completions, solution, **kwargs):
    """1.0 when math-verify finds the completion's answer equal to the gold solution; None where the gold does not
    parse (the sample is left out, as open-r1 does)."""
    rewards = []
    for text, gold in zip(contents(completions), solution):
        gold_parsed = parse(gold)
        rewards.append(float(verify(gold_parsed, parse(text))) if gold_parsed else None)
    return rewards


def format_reward(completions, **kwargs):
    """1.0 for exactly <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>."""
    return [1.0 if THINK_ANSWER.fullmatch(text) else 0.0 for text in contents(completions)]


def tag_count_reward(completions, **kwargs):
    """0.25 for each of format_reward's four tags that occurs exactly once."""
    return [sum(0.25 for tag in TAGS if text.count(tag) == 1) for text in contents(completions)]


def reasoning_steps_reward(completions, **kwargs):
    """min(1, steps / 3): "Step 1:", numbered lines, bullets and "First,", "Next," ... count as steps."""
    return [min(1.0, len(STEP_MARKERS.findall(text)) / 3) for text in contents(completions)]


def boxed(text):
    found = re.search(r"\\boxed\{([^}]*)\}", text)
    return found.group(1) if found else None


def len_reward(completions, solution, **kwargs):
    """Kimi 1.5's length reward over the whole call: lambda = 0.5 - (len - min_len) / (max_len - min_len), with the
    batch's shortest and longest completion (in characters); lambda when right, min(0, lambda) when wrong; all 0
    when every completion has the same length."""
    texts = contents(completions)
    lengths = [len(text) for text in texts]
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return [0.0] * len(texts)
    rewards = []
    for text, gold, length in zip(texts, solution, lengths):
        scaled = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(scaled if boxed(text) == gold else min(0.0, scaled))
    return rewards


def get_cosine_scaled_reward(
    max_len, min_value_wrong=-1.0, max_value_wrong=-0.5, min_value_correct=0.5, max_value_correct=1.0
):
    """A reward that scales right answers from max_value_correct (empty) down to min_value_correct (max_len
    characters or more) along a half cosine, and wrong ones from min_value_wrong up to max_value_wrong."""

    def cosine_scaled_reward(completions, solution, **kwargs):
        rewards = []
        for text, gold in zip(contents(completions), solution):
            right = boxed(text) == gold
            low, high = (min_value_correct, max_value_correct) if right else (max_value_wrong, min_value_wrong)
            cosine = math.cos(min(len(text) / max_len, 1.0) * math.pi)
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards

    return cosine_scaled_reward


def get_repetition_penalty_reward(ngram_size, max_penalty):
    """A reward of max_penalty * (the fraction of the completion's word n-grams that are repeats); 0 for a
    completion of fewer than ngram_size words."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")

    def repetition_penalty_reward(completions, **kwargs):
        rewards = []
        for text in contents(completions):
            words = text.lower().split()
            grams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            rewards.append(max_penalty * (1 - len(set(grams)) / len(grams)) if grams else 0.0)
        return rewards

    return repetition_penalty_reward


# what a user's training script does with the factories; --reward-fn this_file.py:cosine logs cosine_scaled_reward
cosine = get_cosine_scaled_reward(max_len=20)
repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)


def bonus_reward(completions, bonus, **kwargs):
    """`bonus` for a completion with a boxed answer: bound with functools.partial below, as open-r1 binds
    code_reward's options."""
    return [bonus if boxed(text) is not None else 0.0 for text in contents(completions)]


half_bonus = functools.partial(bonus_reward, bonus=0.5)  # TRL logs it as bonus_reward
wrapped_bonus = functools.update_wrapper(functools.partial(bonus_reward, bonus=2.0), bonus_reward)
nested_bonus = functools.partial(functools.partial(bonus_reward), bonus=1.0)


class LengthJudge:
    """A callable instance with no __name__: TRL logs its class name, a partial of it too."""

    def __call__(self, completions, scale, **kwargs):
        return [scale * len(text) for text in contents(completions)]


judge_by_length = functools.partial(LengthJudge(), scale=0.1)


def code_reward(completions, verification_info, **kwargs):
    """Needs the dataset's verification_info column, as open-r1's code rewards do."""
    return [1.0 for _ in completions]


def strict_reward(completions, solution):
    """No **kwargs: TRL passes every column and its own arguments, so this fails on the first it does not name."""
    return [0.0 for _ in completions]
