"""Datasets -> parquet in verl's schema, and the loader that training and evaluation read it with
(one file, or a directory of shards).

    python data_prep.py gsm8k --input ../shared/data/gsm8k --out data/gsm8k
    python data_prep.py math --input MATH/ --out data/math    # MATH-format jsonl you bring (below)
    python data_prep.py digits --out data/digits          # the synthetic task the demo trains on
    python data_prep.py multiply --out data/multiply      # times tables: the real-model example's task

One row per problem, the same columns verl's own data scripts write, so files made here and files
made by verl are interchangeable:

    data_source   str    which reward scores this row, e.g. "openai/gsm8k"
    prompt        list   chat messages, [{"role": "user", "content": ...}]
    ability       str    e.g. "math"
    reward_model  dict   {"style": "rule", "ground_truth": ...}
    extra_info    dict   anything else ({"split", "index", "answer", "question"} for GSM8K)

MATH-format data (Hendrycks et al. 2021's fields, which MATH-500 and the lighteval mirror keep) is
jsonl, one problem a line: {"problem": str, "solution": str with the final answer in \\boxed{...},
optional "level", "type"}; other fields are ignored. The ground truth is the content of the
solution's last \\boxed{} (found exactly as reward.py finds the model's answer). --input is either
one .jsonl file, written to <out>/<file name>.parquet with that name as the split (test.jsonl ->
test.parquet), or a directory holding train.jsonl and/or test.jsonl, as for GSM8K (each one found
is converted).
"""

import argparse
import glob
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from reward import MATH_SOURCES, last_boxed

# ----------------------------------------------------------------------------------------------
# GSM8K (the grade-school-math jsonl release: {"question": ..., "answer": "...\n#### 18"})

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def jsonl_examples(jsonl_path, fields):
    """Yields ("<file>, line N", the line's JSON object) for each non-blank line, checked to be an
    object whose `fields` are strings; a bad line is a ValueError naming the file, line and field."""
    with open(jsonl_path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{jsonl_path}, line {line_no}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from e
            if not isinstance(example, dict):
                raise ValueError(f"{where}: expected a JSON object with {list(fields)}, got {example!r:.80}")
            for field in fields:
                if not isinstance(example.get(field), str):
                    raise ValueError(f"{where}: field {field!r} missing or not a string")
            yield where, example


def gsm8k_rows(jsonl_path, split):
    """Read one GSM8K jsonl file into rows of verl's schema (the same as verl's gsm8k.py)."""
    rows = []
    for where, example in jsonl_examples(jsonl_path, ("question", "answer")):
        final = re.search(r"#### (-?[0-9.,]+)", example["answer"])
        if final is None:
            raise ValueError(f"{where}: field 'answer' has no final '#### <number>' line")
        rows.append(
            {
                "data_source": "openai/gsm8k",
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
# MATH (jsonl rows {"problem", "solution", "level", "type"}; the answer is the last \boxed{})

# What verl's math_dataset.py writes: its old name "lighteval/MATH" is gone from the Hub, and this
# mirror is the name verl routes to its MATH reward, so our files and verl's are interchangeable.
# MATH-500 files can say "HuggingFaceH4/MATH-500" (--data-source) to be reported under that name.
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # verl's


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


def write_parquet(rows, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"wrote {len(rows)} rows to {path}")


# ----------------------------------------------------------------------------------------------
# The synthetic task "digits": the demo's and the tests' default data
#
#   prompt  "list 2 9 1 4 1 7 last"   ->   answer "7"        ("first" asks for the first digit)
#
# Small enough that a tiny random-init model learns it with GRPO in a few minutes on 2 CPU cores,
# yet the answer depends on the prompt: 2 x 10^6 distinct prompts, 10 answers, each ~10% of them.
# A random policy is right about 1 time in 400 (the digit, then EOS, out of 20 tokens), so GRPO first
# learns the format, then to copy the right digit. The test prompts never appear in training.

TASK_SOURCE = "synthetic/digits"
TASK_WORDS = [str(d) for d in range(10)] + ["list", "first", "last"]  # the tiny tokenizer's vocabulary


def digits_prompt(rng):
    digits = [rng.randrange(10) for _ in range(6)]
    which = rng.choice(["first", "last"])
    answer = digits[0] if which == "first" else digits[-1]
    return "list " + " ".join(map(str, digits)) + " " + which, str(answer)


def task_rows(split, count, seed, exclude=()):
    """`count` distinct prompts of the digits task, in verl's schema, none of them in `exclude`."""
    import random

    rng, seen, rows = random.Random(f"digits-{split}-{seed}"), set(exclude), []
    while len(rows) < count:
        content, answer = digits_prompt(rng)
        if content in seen:
            continue
        seen.add(content)
        rows.append(
            {
                "data_source": TASK_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": len(rows)},
            }
        )
    return rows


def write_task(out_dir, seed=0, train_size=20000, test_size=500):
    """Write the digits task's train.parquet and test.parquet (disjoint prompts) to `out_dir`."""
    test = task_rows("test", test_size, seed)
    train = task_rows("train", train_size, seed, exclude={r["prompt"][0]["content"] for r in test})
    write_parquet(train, os.path.join(out_dir, "train.parquet"))
    write_parquet(test, os.path.join(out_dir, "test.parquet"))


# ----------------------------------------------------------------------------------------------
# The times-table task "multiply": the README's real-model example (SmolLM2-135M-Instruct)
#
#   prompt  "What is 7 * 8?"   ->   answer "56"    (scored by the last number in the response)
#
# Every product a x b for a, b in [low, high]. test_pairs factor pairs {a, b} are held out in both
# orders, so "8 * 7" in training never gives away "7 * 8" in the test set. A pretrained chat model
# knows many of these facts but answers with prose that often omits or misstates the product, so RL
# has to improve what it computes, not only how it writes it.

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
    import random

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


# ----------------------------------------------------------------------------------------------
# The loader: every row is checked before training starts, not when a bad one is first sampled

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


class DataError(ValueError):
    """A dataset file that cannot be used, with the file, row and field at fault."""


def _row_problems(row):
    """What is wrong with one row, as (field, message) pairs; empty if it is usable."""
    problems = []
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        problems.append(("data_source", f"expected a non-empty string, got {row.get('data_source')!r}"))
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        problems.append(("prompt", f"expected a non-empty list of chat messages, got {prompt!r:.80}"))
    else:
        for j, msg in enumerate(prompt):
            if (
                not isinstance(msg, dict)
                or not isinstance(msg.get("role"), str)
                or not isinstance(msg.get("content"), str)
            ):
                problems.append((f"prompt[{j}]", f"expected {{'role': str, 'content': str}}, got {msg!r:.80}"))
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        problems.append(("reward_model.ground_truth", f"missing; reward_model is {reward_model!r:.80}"))
    return problems


SPLIT_NAMES = ("train", "test", "validation", "val", "dev")


def parquet_files(path):
    """The parquet files behind `path`: the file itself, or every *.parquet in a directory, in name
    order, as one dataset (how verl and HF datasets store shards: train-00000-of-00002.parquet, ...)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(
            f"{path}: no such file or directory. Make one with `python data_prep.py --help`, or pass verl's parquet."
        )
    files = sorted(glob.glob(os.path.join(path, "*.parquet")))
    if not files:
        raise DataError(
            f"{path}: a directory with no *.parquet files in it (shards in a subdirectory, e.g. data/, need that subdirectory's path)"
        )
    # verl writes train.parquet and test.parquet side by side: reading the directory as one dataset
    # would train on the test set, so a directory must hold one split's shards
    splits = {re.split(r"[-_.]", os.path.basename(f))[0] for f in files} & set(SPLIT_NAMES)
    if len(splits) > 1:
        raise DataError(
            f"{path}: holds files of several splits {sorted(splits)}; pass one file, or a directory with only one split's shards"
        )
    return files


def read_parquet(path):
    """One parquet file's rows, as dicts, after checking it has verl's columns."""
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; found {table.column_names}; expected verl's schema {list(REQUIRED_COLUMNS)} + ability, extra_info"
        )
    return table.to_pylist()


def load_dataset(path, skip_invalid=False, known_sources=None):
    """Read a parquet file, or a directory of parquet shards, in verl's schema into a list of row
    dicts, checking every row.

    Invalid rows are an error naming the file, row and field (the first 10 are listed), unless
    `skip_invalid`, which drops them and prints how many were dropped and why.
    `known_sources`: the data_sources that have a reward (the trainer passes reward.BUILTIN_SOURCES
    when no --reward-fn is given), so a row nothing can score fails here, not at the training step
    that first samples it. None: any data_source.
    Extra columns (verl writes some for other tasks) are kept as they are.
    """
    files = parquet_files(path)
    rows, where = [], []  # where[i]: (file, row in that file) of row i, so errors name the shard
    for file in files:
        file_rows = read_parquet(file)
        rows += file_rows
        where += [(file, i) for i in range(len(file_rows))]
    if not rows:
        raise DataError(f"{path}: has no rows")
    good, bad = [], []
    for i, row in enumerate(rows):
        problems = _row_problems(row)
        if known_sources is not None and not problems and row["data_source"] not in known_sources:
            problems.append(("data_source", f"no built-in reward for {row['data_source']!r}"))
        if problems:
            file, j = where[i]
            at = f"row {j}" if file == path else f"{file}, row {j}"
            bad.extend((at, field, msg) for field, msg in problems)
        else:
            good.append(row)
    if bad:
        listing = "\n".join(f"  {at}, field {field}: {msg}" for at, field, msg in bad[:10])
        n_rows = len(rows) - len(good)
        summary = f"{path}: {n_rows} of {len(rows)} rows are invalid:\n{listing}" + ("\n  ..." if len(bad) > 10 else "")
        if any(msg.startswith("no built-in reward") for _, _, msg in bad):
            summary += (
                f"\nBuilt-in rewards score the data_sources {sorted(known_sources)}; for others pass a reward "
                "file: --reward-fn path/to/file.py:function_name"
            )
        if not skip_invalid:
            raise DataError(summary)
        print(f"skipping invalid rows: {summary}")
        if not good:
            raise DataError(f"{path}: no valid rows left after skipping")
    return good


def load_prompts(path, tokenizer, known_sources=None, max_prompt_length=None):
    """load_dataset, then each row's prompt rendered with the tokenizer's chat template (and the
    generation prompt) into row["prompt_ids"]. Rows whose prompt is longer than max_prompt_length
    tokens are dropped; returns (rows, how many were dropped). All of them dropped is an error, and
    so is a tokenizer without a chat template (checked before the data is read). Prompts with
    words the tokenizer does not know (its unk token) are counted and reported, not dropped."""
    check_chat_template(tokenizer)
    rows = load_dataset(path, known_sources=known_sources)
    for row in rows:
        row["prompt_ids"] = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    warning = unknown_tokens_warning(path, rows, tokenizer)
    if warning:
        from distributed import print0  # every rank loads the data; one says so

        print0(warning)
    if max_prompt_length is None:
        return rows, 0
    kept = [r for r in rows if len(r["prompt_ids"]) <= max_prompt_length]
    if not kept:
        raise DataError(f"{path}: every prompt is longer than max_prompt_length={max_prompt_length} tokens")
    return kept, len(rows) - len(kept)


def check_chat_template(tokenizer):
    """DataError naming the model directory when the tokenizer has no chat template: prompts are chat
    messages, and transformers' own error for this is a traceback from inside apply_chat_template."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise DataError(
        f"model directory {tokenizer.name_or_path!r}: the tokenizer has no chat_template, and the prompts are chat "
        "messages rendered with it. Use a chat (instruct) model, or give this one a template: a Jinja template "
        'in chat_template.jinja in the model directory, or as the "chat_template" string in its tokenizer_config.json'
    )


def unknown_tokens_warning(path, rows, tokenizer):
    """A warning when prompts hold the tokenizer's unknown token (unk_token_id), i.e. text its
    vocabulary has no tokens for, which the model cannot read: how many, and the first one with the
    words that became unknown. None when there are none (byte-level tokenizers never have any)."""
    unk = tokenizer.unk_token_id
    hit = [i for i, row in enumerate(rows) if unk is not None and unk in row["prompt_ids"]]
    if not hit:
        return None
    first = rows[hit[0]]
    words = []
    for message in first["prompt"]:
        try:  # the words behind each unknown token, from a fast tokenizer's offsets
            enc = tokenizer(message["content"], add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            break
        words += [message["content"][a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t == unk]
    unknown = f", which has {sorted(set(words))} as {tokenizer.unk_token}" if words else ""
    return (
        f"warning: {path}: {len(hit)} of {len(rows)} prompts contain the tokenizer's unknown token "
        f"{tokenizer.unk_token!r} (words its vocabulary lacks, which the model cannot read), the first is row "
        f"{hit[0]}{unknown}: {first['prompt'][-1]['content']!r:.200}. Is {tokenizer.name_or_path!r} the "
        "tokenizer this data was made for?"
    )


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tasks = parser.add_subparsers(dest="task", required=True)
    g = tasks.add_parser("gsm8k", help="convert GSM8K's train.jsonl/test.jsonl")
    g.add_argument("--input", required=True, help="directory with train.jsonl and test.jsonl")
    g.add_argument("--out", default="data/gsm8k", help="directory to write train.parquet and test.parquet to")
    mp = tasks.add_parser("math", help="convert MATH-format jsonl (problem, solution with \\boxed{answer})")
    mp.add_argument("--input", required=True, help="a .jsonl file, or a directory with train.jsonl and/or test.jsonl")
    mp.add_argument("--out", default="data/math", help="directory to write <split>.parquet to")
    mp.add_argument(
        "--data-source",
        default=MATH_SOURCE,
        choices=sorted(MATH_SOURCES),
        help="the rows' data_source, which names them in validation metrics; all are scored by reward.math_score",
    )
    d = tasks.add_parser("digits", help="the synthetic task: copy the first or last digit of a list")
    d.add_argument("--out", default="data/digits", help="directory to write train.parquet and test.parquet to")
    d.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    d.add_argument("--train-size", type=int, default=20000, help="training prompts")
    d.add_argument("--test-size", type=int, default=500, help="held-out prompts, none of them in training")
    m = tasks.add_parser("multiply", help="times tables, a * b: the real-model example's task")
    m.add_argument("--out", default="data/multiply", help="directory to write train.parquet and test.parquet to")
    m.add_argument("--seed", type=int, default=0, help="which products are held out")
    m.add_argument("--low", type=int, default=2, help="smallest factor")
    m.add_argument("--high", type=int, default=12, help="largest factor")
    m.add_argument("--test-pairs", type=int, default=25, help="factor pairs held out (in both orders) as the test set")
    args = parser.parse_args(argv)

    if args.task == "gsm8k":
        for split in ("train", "test"):
            src = os.path.join(args.input, f"{split}.jsonl")
            if not os.path.isfile(src):
                parser.error(f"{src} not found; --input must be a directory holding GSM8K's train.jsonl and test.jsonl")
            write_parquet(gsm8k_rows(src, split), os.path.join(args.out, f"{split}.parquet"))
    if args.task == "math":
        try:
            inputs = math_inputs(args.input)
        except FileNotFoundError as e:
            parser.error(str(e))
        for src, split in inputs:
            write_parquet(math_rows(src, split, args.data_source), os.path.join(args.out, f"{split}.parquet"))
    if args.task == "digits":
        write_task(args.out, args.seed, args.train_size, args.test_size)
    if args.task == "multiply":
        write_multiply(args.out, args.seed, args.low, args.high, args.test_pairs)


if __name__ == "__main__":
    main()
