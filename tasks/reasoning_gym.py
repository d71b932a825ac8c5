"""reasoning-gym's procedural tasks (PyPI reasoning-gym: ~100 generators, each with its own verifier) as
data in verl's schema, and their scorer: reasoning-gym's own score_answer.

    python data_prep.py reasoning-gym --task chain_sum,leg_counting --size 2000 --out data/rgym

A row's data_source is "reasoning_gym/NAME"; its prompt is reasoning-gym's system prompt (the final answer
in <answer>...</answer>) and the entry's question; extra_info keeps what the verifier needs: the entry's
question, answer and metadata, and the config the task was built with (both as tagged JSON: encode). The
scorer takes the last <answer>...</answer> (reasoning-gym's extract_answer), rebuilds the task from the
row's config and calls its score_answer(answer, entry): partial credit stays partial, and a scorer that
raises is a reward error like any other. Train and test come from disjoint seeds (test: seed + TEST_SEED),
and no training question is also a test question.
"""

import dataclasses
import functools
import itertools
import json
import os
import random

from tasks.common import split_counts, write_parquet

PREFIX = "reasoning_gym/"  # data_source = PREFIX + task name
TEST_SEED = 10**8  # the test split's seeds start here above the training split's
SHOT_SEED = 2 * 10**8  # --shots' worked examples: seed + SHOT_SEED
LEVEL_SEED = 10**9  # a curriculum's rows: seed + LEVEL_SEED + ... (curriculum.py)
SKIP = ("composite",)  # reasoning-gym's mixer of other tasks: --task a,b --weights does that here


@functools.cache
def task_names():
    """Every reasoning-gym task data_prep can write, sorted."""
    from reasoning_gym.factory import DATASETS  # imported here: a second or two, for its users only

    return tuple(sorted(name for name in DATASETS if name not in SKIP))


def is_rgym_source(data_source):
    """Whether a row's data_source names a reasoning-gym task ("reasoning_gym/chain_sum")."""
    return (
        isinstance(data_source, str) and data_source.startswith(PREFIX) and data_source[len(PREFIX) :] in task_names()
    )


# ----------------------------------------------------------------------------------------------
# Values as JSON: reasoning-gym's metadata holds tuples and int-keyed dicts, which its scorers compare


def encode(value):
    """`value` as JSON text that decode() turns back into an equal value, tuples and non-str dict keys included."""
    return json.dumps(_tag(value))


def _tag(value):
    if isinstance(value, tuple):
        return {"__tuple__": [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _tag(v) for k, v in value.items()}
        return {"__items__": [[_tag(k), _tag(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} ({value!r:.60}) has no JSON form here")


def decode(text):
    """The value encode() wrote."""
    return _untag(json.loads(text))


def _untag(value):
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if isinstance(value, dict):
        if list(value) == ["__tuple__"]:
            return tuple(_untag(v) for v in value["__tuple__"])
        if list(value) == ["__items__"]:
            return {_untag(k): _untag(v) for k, v in value["__items__"]}
        return {k: _untag(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------
# The data


def parse_configs(specs, tasks):
    """{task: {key: value}} from --config NAME.key=value flags; a value is read as JSON (3, [1, 4], true),
    else kept as text. A task not in `tasks`, or a key its config has not, is a ValueError listing the valid ones."""
    from reasoning_gym.factory import DATASETS

    configs = {task: {} for task in tasks}
    for spec in specs:
        name_key, eq, text = spec.partition("=")
        task, dot, key = name_key.partition(".")
        if not eq or not dot:
            raise ValueError(f"--config {spec!r}: expected NAME.key=value, e.g. chain_sum.max_terms=3")
        if task not in configs:
            raise ValueError(f"--config {spec!r}: {task!r} is not one of the --task tasks {tasks}")
        fields = sorted(f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("seed", "size"))
        if key not in fields:
            raise ValueError(f"--config {spec!r}: {task}'s config has no key {key!r}; its keys: {fields}")
        try:
            configs[task][key] = json.loads(text)
        except json.JSONDecodeError:
            configs[task][key] = text
    return configs


def make_task(name, seed, size, config):
    """reasoning-gym's dataset `name` with `config`'s keys ({key: value}); a bad name or value is a ValueError
    naming it (reasoning-gym's own check is an assert)."""
    import reasoning_gym

    if name not in task_names():
        raise ValueError(f"unknown reasoning-gym task {name!r}; the tasks: {', '.join(task_names())}")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {name!r} with config {config}: {type(e).__name__}: {e}") from None


def entry_row(name, entry, split, index, config, before, level=None):
    """One reasoning-gym entry ({"question", "answer", "metadata"}) as a row of verl's schema; `before`: the
    messages before its question (the system prompt, worked examples)."""
    answer = entry["answer"]  # None for tasks with many right answers (the verifier checks them)
    return {
        "data_source": PREFIX + name,
        "prompt": list(before) + [{"role": "user", "content": entry["question"]}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": answer if isinstance(answer, str) else ""},
        "extra_info": {
            "split": split,
            "index": index,
            "question": entry["question"],
            "answer": encode(answer),
            "metadata": encode(entry["metadata"]),
            "config": encode(config),
            "level": level,
        },
    }


def task_entries(name, count, seed, config, exclude=(), distinct=True):
    """(the dataset, `count` of its entries): task `name` built with `config` and dataset seed `seed`, its entries
    0, 1, ... in order, skipping questions in `exclude` and, if `distinct`, questions already taken."""
    data, entries, tries = draw_entries(name, count, seed, config, exclude, distinct)
    if len(entries) < count:
        raise ValueError(
            f"reasoning-gym task {name!r} with config {config}: only {len(entries)} usable questions in "
            f"{tries} tries, fewer than {count}; ask for fewer, or widen its config (--config {name}.key=value)"
        )
    return data, entries


def draw_entries(name, count, seed, config, exclude=(), distinct=True):
    """task_entries' draw: (the dataset, at most `count` entries, how many it tried)."""
    limit = 10 * count + 100
    data, entries, seen = make_task(name, seed, limit, config), [], set(exclude)
    for idx in range(limit):
        if len(entries) == count:
            break
        entry = data[idx]
        if entry["question"] not in seen:
            seen.update([entry["question"]] if distinct else [])
            entries.append(entry)
    return data, entries, limit


def task_rows(name, count, seed, split, config, before, exclude=(), level=None):
    """`count` rows of task `name` (task_entries): the test split's questions distinct, the training split's
    none of `exclude` (the test questions), repeats allowed (a small task has few questions)."""
    entries = task_entries(name, count, seed, config, exclude, distinct=split == "test")[1]
    return [entry_row(name, e, split, i, config, before, level) for i, e in enumerate(entries)]


def level_config(name, level, config):
    """`config` ({key: value}) with the keys reasoning-gym's curriculum for task `name` sets at `level` (its
    global level: every attribute at that level, or its last) replaced by the curriculum's values."""
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition
    from reasoning_gym.factory import CURRICULA, create_curriculum

    if name not in CURRICULA:
        raise ValueError(f"reasoning-gym task {name!r} has no curriculum; the tasks that have one: {sorted(CURRICULA)}")
    curriculum = create_curriculum(name)
    if not 0 <= level <= max_level(name):
        raise ValueError(f"--level {level}: {name}'s curriculum has levels 0 to {max_level(name)}")
    curriculum.set_global_level(level)
    generated = curriculum.generate_configuration()
    keys = []
    for attr in curriculum.attributes.values():
        ranged = isinstance(attr, RangeAttributeDefinition)
        keys += [attr.lower_field_name, attr.upper_field_name] if ranged else [attr.field_name]
    return {**config, **{key: getattr(generated, key) for key in keys}}


def max_level(name):
    """The highest global level of task `name`'s curriculum: its longest attribute's last."""
    from reasoning_gym.factory import create_curriculum

    return max(len(attr.levels) for attr in create_curriculum(name).attributes.values()) - 1


def level_rows(name, level, step, seed, config, before, counts):
    """(train, test) rows of task `name` at curriculum `level`, `counts` = (train, test) of them, from dataset
    seeds that follow from `step` (seed + LEVEL_SEED + step; the test's TEST_SEED above): the same arguments
    give the same rows, which is what makes a resumed curriculum run draw the same prompts."""
    config = level_config(name, level, config)
    base = seed + LEVEL_SEED + step
    test = task_rows(name, counts[1], base + TEST_SEED, "test", config, before, level=level)
    exclude = {r["extra_info"]["question"] for r in test}
    return task_rows(name, counts[0], base, "train", config, before, exclude, level), test


def worked_examples(name, shots, seed, config, exclude=()):
    """`shots` worked examples of task `name` as chat messages, each its question and the answer in
    <answer>...</answer> (entries of dataset seed `seed`, beyond both splits' seeds): the same before every
    question of the task. A small model may never write the tags unprompted (SmolLM2-135M-Instruct did not).
    None of them is a question in `exclude` (the held-out ones: a worked example would show a test answer); a
    task with fewer such questions is a ValueError saying how many --shots it can give."""
    entries, tries = draw_entries(name, shots, seed, config, exclude)[1:] if shots else ([], 0)
    if len(entries) < shots:
        raise ValueError(
            f"--shots {shots}: {name} gave only {len(entries)} questions that are not held out, in {tries} tries; "
            f"use --shots {len(entries)} or fewer, or widen its config (--config {name}.key=value)"
        )
    if any(not isinstance(e["answer"], str) for e in entries):
        raise ValueError(f"--shots: {name} has no single right answer to show; use --shots 0")
    return [m for e in entries for m in ({"role": "user", "content": e["question"]},
                                         {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"})]  # fmt: skip


def write_reasoning_gym(
    out_dir, tasks, size, test_size, seed=0, weights=None, configs=(), prompt="default", level=None, shots=0
):
    """Write train.parquet (`size` rows over `tasks`, in proportion to `weights`, shuffled) and test.parquet
    (`test_size` rows of each task, the tasks in turn) to `out_dir`. configs: --config's NAME.key=value strings;
    prompt: a key of reasoning-gym's SYSTEM_PROMPTS, or "none" for the question alone; level: each task at that
    level of its curriculum (level_config), where --curriculum starts (curriculum.py); shots: worked examples
    before each question (worked_examples), none of them a question of the file. No task's training question is
    any task's test question; a question that two tasks both ask is counted and said (shared_questions)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    unknown = [t for t in tasks if t not in task_names()]
    if unknown or not tasks:
        raise ValueError(f"--task: unknown reasoning-gym task(s) {unknown}; the tasks: {', '.join(task_names())}")
    repeated = sorted({t for t in tasks if tasks.count(t) > 1})
    if repeated:
        raise ValueError(
            f"--task: {', '.join(repeated)} named more than once, which would write each of its questions as many "
            "times; name each task once (--weights sets how much of each)"
        )
    weights = [1.0] * len(tasks) if weights is None else list(weights)
    if len(weights) != len(tasks) or min(weights) <= 0:
        raise ValueError(f"--weights {weights}: expected {len(tasks)} positive numbers, one per --task")
    if prompt != "none" and prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"--system-prompt {prompt!r}: expected one of {sorted(SYSTEM_PROMPTS)} or 'none'")
    system = [{"role": "system", "content": SYSTEM_PROMPTS[prompt]}] if prompt != "none" else []
    config = parse_configs(configs, tasks)
    task_configs = [config[t] if level is None else level_config(t, level, config[t]) for t in tasks]
    # every task's test questions first: no task trains on, or shows as a worked example, another's test question
    held_out = [task_entries(t, test_size, seed + TEST_SEED, c)[1] for t, c in zip(tasks, task_configs)]
    test_questions = {e["question"] for entries in held_out for e in entries}
    train, tests = [], []
    for task, task_config, entries, count in zip(tasks, task_configs, held_out, split_counts(size, weights)):
        examples = worked_examples(task, shots, seed + SHOT_SEED, task_config, exclude=test_questions)
        before = system + examples
        tests.append([entry_row(task, e, "test", i, task_config, before, level) for i, e in enumerate(entries)])
        exclude = test_questions | {m["content"] for m in examples if m["role"] == "user"}
        train += task_rows(task, count, seed, "train", task_config, before, exclude, level)
    random.Random(f"reasoning-gym-{seed}").shuffle(train)
    # the tasks in turn, so that --val-max-prompts' first rows hold every task
    test = [row for turn in itertools.zip_longest(*tests) for row in turn if row is not None]
    for rows, name in ((train, "train.parquet"), (test, "test.parquet")):
        write_parquet(rows, os.path.join(out_dir, name))
        said = shared_questions(rows)
        if said:
            print(f"{os.path.join(out_dir, name)}: {said}")


def shared_questions(rows):
    """How many of `rows` ask a question that a row of another task asks too, as a sentence; None if none. Two
    tasks can share questions (their generators overlap): each row is then scored by its own task's verifier."""
    tasks = {}
    for row in rows:
        tasks.setdefault(row["extra_info"]["question"], set()).add(row["data_source"])
    shared = [row for row in rows if len(tasks[row["extra_info"]["question"]]) > 1]
    if not shared:
        return None
    names = sorted({source for row in shared for source in tasks[row["extra_info"]["question"]]})
    return (
        f"{len(shared)} of {len(rows)} rows ask a question that a row of another task also asks ({', '.join(names)}); "
        "each is scored by its own task's verifier"
    )


# ----------------------------------------------------------------------------------------------
# The scorer


ENCODED = ("answer", "metadata", "config")  # extra_info's fields that hold encode()'s JSON text
REWRITE = "write the file again with `python data_prep.py reasoning-gym`, or store tasks.reasoning_gym.encode(value)"


def row_problems(extra_info):
    """What a reasoning-gym row's extra_info lacks for the scorer, as (field, message) pairs (data_prep's row
    checks at start-up, so that a hand-edited file is named now, not as a reward error mid-run); empty if none."""
    if not isinstance(extra_info, dict):
        return [("extra_info", f"expected a dict with {['question', *ENCODED]}, got {extra_info!r:.80}")]
    problems = []
    for key in ("question", *ENCODED):
        if extra_info.get(key) is None:
            problems.append((f"extra_info.{key}", f"missing, and reasoning-gym's scorer needs it; {REWRITE}"))
        elif key in ENCODED and (problem := json_problem(extra_info[key])):
            problems.append((f"extra_info.{key}", problem))
    return problems


def json_problem(text):
    """Why `text` is not what encode() writes (JSON text), as a sentence; None if it is."""
    try:
        decode(text)
    except (TypeError, ValueError) as e:  # json.JSONDecodeError is a ValueError; TypeError: not text at all
        return f"not JSON text ({e}: {text!r:.60}); reasoning-gym's scorer reads it as encode() writes it: {REWRITE}"
    return None


@functools.lru_cache(maxsize=256)
def _scorer_task(name, config_json):
    return make_task(name, 0, 1, decode(config_json))


def rgym_score(data_source, solution_str, extra_info):
    """reasoning-gym's own score of a response, in [0, 1]: the task's score_answer(answer, entry), with the last
    <answer>...</answer> of the response (None if it has none) and the entry rebuilt from the row's extra_info."""
    from reasoning_gym.utils import extract_answer

    info = extra_info or {}
    missing = [k for k in ("question", "answer", "metadata", "config") if info.get(k) is None]
    if missing:
        raise ValueError(
            f"{data_source} row: extra_info lacks {missing}, which reasoning-gym's scorer needs; "
            "write the data with `python data_prep.py reasoning-gym`"
        )
    for key in ENCODED:
        if problem := json_problem(info[key]):
            raise ValueError(f"{data_source} row: extra_info.{key} is {problem}")
    task = _scorer_task(data_source[len(PREFIX) :], info["config"])
    entry = {"question": info["question"], "answer": decode(info["answer"]), "metadata": decode(info["metadata"])}
    return float(task.score_answer(extract_answer(solution_str), entry))
