"""Datasets -> parquet in verl's schema, and the loader that training and evaluation read it with (one file,
or a directory of shards; TRL's prompt-only datasets too: prompt_data.py). Each task's writer and scorer: tasks/.

    python data_prep.py gsm8k --input ../shared/data/gsm8k --out data/gsm8k
    python data_prep.py math --input MATH/ --out data/math    # MATH-format jsonl you bring (tasks/math.py)
    python data_prep.py digits --out data/digits          # the synthetic task the demo trains on
    python data_prep.py multiply --out data/multiply      # times tables: the real-model example's task
    python data_prep.py multiply --digits 3x2 --shots 2 --out data/products   # 347 * 58, for the calculator
    python data_prep.py reasoning-gym --task chain_sum --out data/rgym   # its tasks: tasks/reasoning_gym.py
One row per problem, in the columns verl's own data scripts write (so their files work here too):
    data_source   str    which reward scores this row, e.g. "openai/gsm8k"
    prompt        list   chat messages, [{"role": "user", "content": ...}]
    ability       str    e.g. "math"
    reward_model  dict   {"style": "rule", "ground_truth": ...}
    extra_info    dict   anything else ({"split", "index", "answer", "question"} for GSM8K; tools_kwargs)
"""

import argparse
import os

import pyarrow.parquet as pq

from chat_template import bound_chat_template
from prompt_data import DataError, is_prompt_only, load_prompt_only, parquet_files, read_rows
from tasks.common import write_parquet
from tasks.digits import TASK_WORDS, write_digits
from tasks.gsm8k import gsm8k_rows
from tasks.math import MATH_SOURCE, MATH_SOURCES, math_inputs, math_rows
from tasks.multiply import write_multiply, write_products
from tasks.reasoning_gym import PREFIX as RGYM_PREFIX
from tasks.reasoning_gym import row_problems as rgym_row_problems
from tasks.reasoning_gym import write_reasoning_gym

# ----------------------------------------------------------------------------------------------
# The loader: every row is checked before training starts, not when a bad one is first sampled

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


def _row_problems(row, need_truth=True):
    """What is wrong with one row, as (field, message) pairs; empty if it is usable. need_truth=False (pure
    distillation, --no-reward): the row may have no reward_model.ground_truth."""
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
    if need_truth and (not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None):
        problems.append(("reward_model.ground_truth", f"missing; reward_model is {reward_model!r:.80}"))
    return problems


def read_parquet(path, required=REQUIRED_COLUMNS):
    """One parquet file's rows, as dicts, after checking it has verl's columns (`required`); none for a file of
    no rows (load_dataset says so)."""
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    if not table.num_rows:  # an empty list written as parquet has no columns either: say what is wrong
        return []
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; found {table.column_names}; expected verl's schema {list(REQUIRED_COLUMNS)} + ability, extra_info"
        )
    return table.to_pylist()


def load_dataset(path, skip_invalid=False, known_sources=None, schemas=None, need_truth=True):
    """Read a parquet file, or a directory of parquet shards, in verl's schema into a list of row
    dicts, checking every row.

    Invalid rows are an error naming the file, row and field (the first 10 are listed), unless
    `skip_invalid`, which drops them and prints how many were dropped and why.
    `known_sources`: the data_sources that have a reward (the trainer passes reward.BUILTIN_SOURCES
    when no --reward-fn is given), so a row nothing can score fails here, not at the training step
    that first samples it, and so does a reasoning-gym row whose extra_info its verifier cannot read. None: any
    data_source.
    `schemas`: the loaded tools' (tools.start_tools; [] without --tools), which each row's
    extra_info.tools_kwargs must fit (tools.kwargs_problems): its tools loaded, its arguments theirs.
    None: not checked.
    Extra columns (verl writes some for other tasks) are kept as they are.
    need_truth=False (--no-reward): rows need no reward_model column or ground truth; a row without one gets
    reward_model.ground_truth None.
    """
    files = parquet_files(path)
    rows, where = [], []  # where[i]: (file, row in that file) of row i, so errors name the shard
    for file in files:
        file_rows = read_parquet(file, REQUIRED_COLUMNS if need_truth else ("data_source", "prompt"))
        rows += file_rows
        where += [(file, i) for i in range(len(file_rows))]
    if not rows:
        raise DataError(f"{path}: has no rows, so nothing to train or validate on; write it again with at least one")
    if schemas is not None:
        import tools  # here, not at the top: this file's command line needs no tools
    good, bad = [], []
    for i, row in enumerate(rows):
        problems = _row_problems(row, need_truth)
        if not need_truth:  # the trainer's samples and scores read reward_model.ground_truth
            given = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {"style": "none"}
            row["reward_model"] = {"ground_truth": None, **given}
        if known_sources is not None and not problems and row["data_source"] not in known_sources:
            problems.append(("data_source", f"no built-in reward for {row['data_source']!r}"))
        if known_sources is not None and not problems and row["data_source"].startswith(RGYM_PREFIX):
            problems += rgym_row_problems(row.get("extra_info"))  # what reasoning-gym's verifier reads
        if schemas is not None:
            problems += tools.kwargs_problems(row.get("extra_info"), schemas)
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


# Prompts rendered per call of the chat template (each call is bounded in time: chat_template.py)
RENDER_BATCH = 256


def load_prompts(path, tokenizer, known_sources=None, max_prompt_length=None, schemas=None, need_truth=True,
                 prompt_column="prompt", system_prompt=""):  # fmt: skip
    """load_dataset (or, for TRL's prompt-only datasets, prompt_data.load_prompt_only), then each row's prompt
    rendered with the tokenizer's chat template (and the generation prompt; with `schemas`, the tools:
    tools.render_prompt) into row["prompt_ids"]; a text prompt (prompt-only datasets) is tokenized as it
    stands, as TRL does. A prompt that renders to no tokens is an error naming its file and row
    (check_prompt_tokens). Rows whose prompt is longer than max_prompt_length tokens are dropped (those that
    cannot fit by their characters alone before any renders: cannot_fit); returns (rows, how many were dropped).
    All of them dropped is an error, and so is a tokenizer without a chat template for chat prompts (checked
    before verl's data is read). Prompts with words the tokenizer does not know
    (its unk token) are counted and reported, not dropped. A prompt-only dataset has no data_source to pick a
    built-in reward: with `known_sources` (no --reward-fn) it is refused. need_truth=False (--no-reward):
    verl rows need no ground truth (load_dataset).
    From here on, each of the tokenizer's renders is bounded in time (bound_chat_template)."""
    prompt_only = is_prompt_only(path, prompt_column)
    if not prompt_only and (prompt_column != "prompt" or system_prompt):
        raise DataError(f"{path}: verl's schema; --prompt-column and --system-prompt are for TRL's prompt-only data")
    if prompt_only and known_sources is not None:
        raise DataError(
            f"{path}: a prompt-only dataset (TRL's: a 'prompt' column and no data_source), so no built-in reward "
            "can score it; pass your reward functions: --reward-fn path/to/file.py:function (TRL's batched "
            "functions work as they are), or an installed module's: --reward-fn trl.rewards:think_format_reward"
        )
    if prompt_only:
        rows = load_prompt_only(path, prompt_column, system_prompt)  # open-r1's: built from the column (and system)
        chat = not isinstance(rows[0]["prompt"], str)
        if chat:
            check_chat_template(tokenizer)
        elif schemas:
            raise DataError(f"{path}: --tools needs chat-message prompts; this dataset's prompts are text")
    else:
        check_chat_template(tokenizer)
    bound_chat_template(tokenizer)
    if not prompt_only:  # schemas []: no tools_kwargs
        rows = load_dataset(path, known_sources=known_sources, schemas=schemas or [], need_truth=need_truth)
    # before any template renders: a prompt of megabytes renders for minutes. These rows get no prompt_ids
    unfit, said = set(), None
    if max_prompt_length is not None:
        unfit, said = cannot_fit(path, rows, tokenizer, max_prompt_length)
    chats = []  # rendered below in batches of RENDER_BATCH: 2.2-2.6x faster than one call per row
    for i, row in enumerate(rows):
        if i in unfit:
            continue
        if isinstance(row["prompt"], str):  # TRL's text prompt: no chat template
            row["prompt_ids"] = tokenizer(row["prompt"])["input_ids"]
        elif schemas:  # the tools' schemas without the arguments the row passes itself (verl's tools_kwargs)
            import tools

            row_schemas = tools.row_schemas(schemas, (row.get("extra_info") or {}).get("tools_kwargs"))
            row["prompt_ids"] = tools.render_prompt(tokenizer, row["prompt"], row_schemas)
        else:
            chats.append(row)
    render_chats(chats, tokenizer)
    check_prompt_tokens(path, rows)
    warning = unknown_tokens_warning(path, rows, tokenizer)
    if warning:
        from distributed import print0  # every rank loads the data; one says so

        print0(warning)
    if max_prompt_length is None:
        return rows, 0
    kept = [r for i, r in enumerate(rows) if i not in unfit and len(r["prompt_ids"]) <= max_prompt_length]
    if not kept:
        raise DataError(
            f"{path}: every prompt is longer than max_prompt_length={max_prompt_length} tokens"
            + (f"; {said}: shorten the prompts, or raise --max-prompt-length" if said else "")
        )
    return kept, len(rows) - len(kept)


def cannot_fit(path, rows, tokenizer, max_prompt_length):
    """(the positions of the rows whose prompt cannot fit in max_prompt_length tokens, a sentence naming the first
    of them or None): more characters, whitespace aside, than that many of the tokenizer's longest tokens hold (a
    token is at most that long; many tokenizers give whitespace none). load_prompts drops them with the other
    prompts that are too long, but before the chat template renders them, which for a prompt of megabytes
    (--shots 100000) takes minutes and then stops as if the template looped."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    limit = max_prompt_length * longest
    sizes = [prompt_characters(row["prompt"]) for row in rows]
    over = [i for i, size in enumerate(sizes) if size > limit]
    if not over:
        return set(), None
    file, j = read_rows(path)[1][over[0]]  # (file, row in that file): every row was loaded, in this order
    at = f"row {j}" if file == path else f"{file}, row {j}"
    said = (
        f"{at}'s prompt has {sizes[over[0]]:,} characters (whitespace aside), more than max_prompt_length="
        f"{max_prompt_length} tokens of at most {longest} characters (the tokenizer's longest token) can hold, {limit:,}"
    )
    return set(over), said


def prompt_characters(prompt):
    """A prompt's characters, whitespace aside: its text, or its chat messages' contents."""
    texts = [prompt] if isinstance(prompt, str) else [message["content"] for message in prompt]
    return sum(len(text) - sum(map(text.count, " \t\n\r")) for text in texts)


def render_chats(rows, tokenizer):
    """Sets each row's prompt_ids: its chat messages through the tokenizer's chat template, RENDER_BATCH rows a call."""
    for i in range(0, len(rows), RENDER_BATCH):
        batch = rows[i : i + RENDER_BATCH]
        ids = tokenizer.apply_chat_template(
            [list(row["prompt"]) for row in batch], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for row, prompt_ids in zip(batch, ids):
            row["prompt_ids"] = prompt_ids


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


def check_prompt_tokens(path, rows):
    """DataError naming each row (the first 10) whose prompt rendered to no tokens, e.g. empty messages under a
    template that adds nothing around them: no engine generates from nothing (vLLM: "The decoder prompt cannot
    be empty"; transformers: a reshape error), and neither would name the row. A row without prompt_ids was not
    rendered (cannot_fit)."""
    empty = [i for i, row in enumerate(rows) if "prompt_ids" in row and not row["prompt_ids"]]
    if not empty:
        return
    where = read_rows(path)[1]  # (file, row in that file) of each row: every row was loaded, in this order
    listing = []
    for i in empty[:10]:
        file, j = where[i]
        listing.append(f"  {'' if file == path else file + ', '}row {j}, field prompt: {rows[i]['prompt']!r:.80}")
    raise DataError(
        f"{path}: {len(empty)} of {len(rows)} prompts render to no tokens (chat messages with the chat template, "
        "text as it stands), and the engine needs at least one to generate from:\n"
        + "\n".join(listing)
        + ("\n  ..." if len(empty) > 10 else "")
    )


def unknown_tokens_warning(path, rows, tokenizer):
    """A warning when prompts hold the tokenizer's unknown token (unk_token_id), i.e. text its
    vocabulary has no tokens for, which the model cannot read: how many, and the first one with the
    words that became unknown. None when there are none (byte-level tokenizers never have any)."""
    unk = tokenizer.unk_token_id
    hit = [i for i, row in enumerate(rows) if unk is not None and unk in row.get("prompt_ids", ())]
    if not hit:
        return None
    first = rows[hit[0]]
    messages = first["prompt"] if isinstance(first["prompt"], list) else [{"content": first["prompt"]}]  # TRL's text
    words = []
    for message in messages:
        try:  # the words behind each unknown token, from a fast tokenizer's offsets
            enc = tokenizer(message["content"], add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            break
        words += [message["content"][a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t == unk]
    unknown = f", which has {sorted(set(words))} as {tokenizer.unk_token}" if words else ""
    return (
        f"warning: {path}: {len(hit)} of {len(rows)} prompts contain the tokenizer's unknown token "
        f"{tokenizer.unk_token!r} (words its vocabulary lacks, which the model cannot read), the first is row "
        f"{hit[0]}{unknown}: {messages[-1]['content']!r:.200}. Is {tokenizer.name_or_path!r} the "
        "tokenizer this data was made for?"
    )


# ----------------------------------------------------------------------------------------------
# The trainer's inputs


def demo_inputs(args, rank):
    """The demo makes its own inputs, on rank 0: the tiny model for --model tiny, the synthetic task
    for an empty --train-data or --val-data. Points args at them. A collective (it waits for rank 0).
    The trainer's setup, imported here so that this file's command line stays light."""
    import torch.distributed as dist

    from distributed import print0

    task = not args.train_data or not args.val_data  # the config line shows where each input is
    if args.model == "tiny":
        what = "the digits task " if task else ""
        print0(
            f"demo: a tiny model learns {what}from scratch, so config.DEMO_OVERRIDES replaces some of verl's defaults"
        )
    elif task:
        print0("demo: the digits task (tasks/digits.py): name the first or last of six digits")
    if args.model == "tiny":
        from models import build_tiny_model

        args.model = os.path.join(args.out_dir, "tiny_model")
        if rank == 0:
            build_tiny_model(args.model, TASK_WORDS, seed=args.seed)
    if task:
        task_dir = os.path.join(args.out_dir, "data")
        if rank == 0:
            write_digits(task_dir, seed=args.seed, quiet=True)
        args.train_data = args.train_data or os.path.join(task_dir, "train.parquet")
        args.val_data = args.val_data or os.path.join(task_dir, "test.parquet")
    dist.barrier()


# ----------------------------------------------------------------------------------------------
# Command line


def at_least(least):
    """An argparse type: a whole number >= `least`, so that a negative size (or, least 1, an empty training file)
    is the flag's error, before anything is drawn."""

    def count(text):
        if not text.removeprefix("-").isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text}")
        return int(text)

    return count


def out_problem(out):
    """Why --out `out` cannot be the directory the files are written to (a file is in its way), or None."""
    path = os.path.abspath(out)
    while not os.path.exists(path):  # the first part of it that exists must be a directory
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"--out {out}: {path} is a file, not a directory; give a directory to write the parquet files to"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tasks = parser.add_subparsers(dest="task", required=True)
    g = tasks.add_parser("gsm8k", help="convert GSM8K's train.jsonl/test.jsonl")
    g.add_argument("--input", required=True, help="directory with train.jsonl and test.jsonl")
    g.add_argument("--out", default="data/gsm8k", help="directory to write train.parquet and test.parquet to")
    mp = tasks.add_parser(
        "math",
        help="convert MATH-format jsonl (problem, solution with \\boxed{answer})",
        description='MATH-format jsonl, one problem a line: {"problem": str, "solution": str with the final answer '
        'in \\boxed{...}, optional "level", "type"}; other fields are ignored. The ground truth is the content of '
        "the solution's last \\boxed{}. --input is one .jsonl file (its name is the split: test.jsonl -> "
        "test.parquet) or a directory holding train.jsonl and/or test.jsonl.",
    )
    mp.add_argument("--input", required=True, help="a .jsonl file, or a directory with train.jsonl and/or test.jsonl")
    mp.add_argument("--out", default="data/math", help="directory to write <split>.parquet to")
    mp.add_argument(
        "--data-source",
        default=MATH_SOURCE,
        choices=sorted(MATH_SOURCES),
        help="the rows' data_source, which names them in validation metrics; all are scored by tasks.math.math_score",
    )
    d = tasks.add_parser("digits", help="the synthetic task: copy the first or last digit of a list")
    d.add_argument("--out", default="data/digits", help="directory to write train.parquet and test.parquet to")
    d.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    d.add_argument("--train-size", type=at_least(1), default=20000, help="training prompts")
    d.add_argument("--test-size", type=at_least(0), default=500, help="held-out prompts, none of them in training")
    m = tasks.add_parser("multiply", help="times tables, a * b: the real-model example's task")
    m.add_argument("--out", default="data/multiply", help="directory to write train.parquet and test.parquet to")
    m.add_argument("--seed", type=int, default=0, help="which products are held out")
    m.add_argument("--low", type=int, default=2, help="smallest factor")
    m.add_argument("--high", type=int, default=12, help="largest factor")
    m.add_argument("--test-pairs", type=int, default=25, help="factor pairs held out (in both orders) as the test set")
    m.add_argument(
        "--digits",
        choices=["3x2"],
        help="3x2: a 3-digit times a 2-digit number (What is 347 * 58?), for the calculator tool; takes "
        "--train-size, --test-size, --instruction and --shots instead of --low, --high and --test-pairs",
    )
    m.add_argument("--train-size", type=at_least(1), default=4000, help="--digits 3x2: training pairs")
    m.add_argument(
        "--test-size", type=at_least(1), default=200, help="--digits 3x2: held-out pairs, none of them in training"
    )
    m.add_argument(
        "--instruction", default="", help='--digits 3x2: text after each question, e.g. "Use the calculator."'
    )
    m.add_argument(
        "--shots",
        type=int,
        default=0,
        help="--digits 3x2: worked examples of a calculator call before each question (0-3)",
    )
    r = tasks.add_parser(
        "reasoning-gym",
        help="reasoning-gym's procedural tasks, scored by their own verifiers (tasks/reasoning_gym.py)",
        description="reasoning-gym's tasks (pip install reasoning-gym): train.parquet from seeds --seed, --seed + 1, "
        "...; test.parquet (--test-size rows per task) from disjoint seeds, none of its questions in training.",
    )
    r.add_argument(
        "--task",
        dest="task_names",
        required=True,
        help="NAME[,NAME...]: reasoning-gym task names, e.g. chain_sum,leg_counting",
    )
    r.add_argument(
        "--size", type=at_least(1), default=2000, help="training rows, over the tasks in proportion to --weights"
    )
    r.add_argument("--test-size", type=at_least(0), default=100, help="held-out rows of each task")
    r.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    r.add_argument("--out", default="data/reasoning_gym", help="directory to write train.parquet and test.parquet to")
    r.add_argument("--weights", help="W[,W...]: one weight per --task (default: equal)")
    r.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME.key=value",
        help="a task's config value (JSON, else text), e.g. chain_sum.max_terms=3; repeat for several",
    )
    r.add_argument(
        "--system-prompt",
        default="default",
        help="reasoning-gym's system prompt asking for <answer>...</answer>: default, direct, simple, DeepSeekZero, "
        "chain_of_draft; or none (the question alone)",
    )
    r.add_argument(
        "--shots",
        type=at_least(0),
        default=0,
        help="worked examples (question, <answer>answer</answer>) first; none is a question of the files",
    )
    r.add_argument("--level", type=int, help="each task at this level of reasoning-gym's curriculum (--curriculum)")
    args = parser.parse_args(argv)
    if out_problem(args.out):
        parser.error(out_problem(args.out))

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
        write_digits(args.out, args.seed, args.train_size, args.test_size)
    if args.task == "multiply" and args.digits == "3x2":
        write_products(args.out, args.seed, args.train_size, args.test_size, args.instruction, args.shots)
    elif args.task == "multiply":
        write_multiply(args.out, args.seed, args.low, args.high, args.test_pairs)
    if args.task == "reasoning-gym":
        try:
            weights = [float(w) for w in args.weights.split(",")] if args.weights else None
            tasks = [t for t in args.task_names.split(",") if t]
            how = dict(configs=args.config, prompt=args.system_prompt, level=args.level, shots=args.shots)
            write_reasoning_gym(args.out, tasks, args.size, args.test_size, args.seed, weights, **how)
        except ValueError as e:
            parser.error(str(e))


if __name__ == "__main__":
    main()
