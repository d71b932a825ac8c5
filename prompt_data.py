"""TRL's prompt-only datasets, read as they are: a "prompt" column holding text or a list of chat messages,
and any other columns, which go to the reward functions (trl_rewards.py) as keyword lists.

    {"prompt": [{"role": "system", "content": ...}, {"role": "user", "content": ...}], "solution": "72"}
    {"prompt": "Question: ... Answer:", "solution": "72"}

Stored as jsonl (one object a line), parquet (a file, or a directory of one split's shards), or a
`datasets` save_to_disk directory (*.arrow files in Arrow's IPC stream format, with dataset_info.json
and state.json): read with `datasets` when it is installed, else with pyarrow. A file with verl's
columns (data_source, reward_model) is verl's, not this: data_prep.load_dataset reads it. A text prompt
is tokenized as it stands, a message list rendered with the chat template (data_prep.load_prompts), as
TRL does. Such rows have no data_source: validation names them PROMPT_ONLY_SOURCE."""

import glob
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

PROMPT_ONLY_SOURCE = "prompt_only"  # val-core/prompt_only/reward/mean@n: the rows name no data_source
VERL_COLUMNS = ("data_source", "reward_model")  # either one makes a file verl's (data_prep.REQUIRED_COLUMNS)
SPLIT_NAMES = ("train", "test", "validation", "val", "dev")


class DataError(ValueError):
    """A dataset file that cannot be used, with the file, row and field at fault."""


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


def storage(path):
    """How `path` is stored: "jsonl" (a .jsonl or .json file), "arrow" (a save_to_disk directory), else "parquet"
    (which data_prep.parquet_files checks, and says what is wrong with)."""
    if os.path.isfile(path) and path.endswith((".jsonl", ".json")):
        return "jsonl"
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_info.json", "dataset_dict.json")
    ):
        return "arrow"
    return "parquet"


def read_jsonl(path):
    """The rows of a jsonl file, one JSON object a line (blank lines skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not JSON ({e}); expected one JSON object a line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {n} is a {type(row).__name__}; expected a JSON object")
            rows.append(row)
    return rows


def arrow_files(path):
    """The *.arrow files of a save_to_disk directory, in state.json's order (else by name)."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise DataError(f"{path}: a DatasetDict of the splits {splits}; pass one split's directory, e.g. {path}/train")
    try:
        with open(os.path.join(path, "state.json")) as f:
            files = [os.path.join(path, d["filename"]) for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        files = sorted(glob.glob(os.path.join(path, "*.arrow")))
    if not files:
        raise DataError(f"{path}: a save_to_disk directory with no *.arrow files")
    return files


def read_arrow(path):
    """The rows of a save_to_disk directory: with `datasets` when it is installed, else each *.arrow file
    (Arrow's IPC stream format, as `datasets` writes it) with pyarrow."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        try:
            return datasets.load_from_disk(path).to_list()
        except Exception as e:  # fall through: pyarrow's reading says which file is bad
            print(f"warning: datasets.load_from_disk({path!r}) failed ({type(e).__name__}: {e}); reading with pyarrow")
    rows = []
    for file in arrow_files(path):
        try:
            with pa.OSFile(file, "rb") as f:
                rows += pa.ipc.open_stream(f).read_all().to_pylist()
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{file}: not a readable Arrow stream file ({type(e).__name__}: {e})") from e
    return rows


def read_rows(path):
    """(rows, where): every row of `path` in any storage, and where[i] = (file, row in that file)."""
    kind = storage(path)
    if kind == "jsonl":
        rows = read_jsonl(path)
        return rows, [(path, i) for i in range(len(rows))]
    if kind == "arrow":
        rows = read_arrow(path)
        return rows, [(path, i) for i in range(len(rows))]
    rows, where = [], []
    for file in parquet_files(path):
        try:
            part = pq.read_table(file).to_pylist()
        except Exception as e:
            raise DataError(f"{file}: not a readable parquet file ({type(e).__name__}: {e})") from e
        rows += part
        where += [(file, i) for i in range(len(part))]
    return rows, where


def columns(path):
    """The column names of `path` (every row's keys, for jsonl, where a row may have keys the others lack; the
    first file's schema otherwise), or None where it cannot be read: data_prep.load_dataset then says what is
    wrong."""
    kind = storage(path)
    try:
        if kind == "jsonl":
            return list(dict.fromkeys(key for row in read_jsonl(path) for key in row))
        if kind == "arrow":
            with pa.OSFile(arrow_files(path)[0], "rb") as f:
                return pa.ipc.open_stream(f).schema.names
        return pq.read_schema(parquet_files(path)[0]).names
    except (DataError, OSError, IndexError, pa.ArrowInvalid):
        return None if kind == "parquet" else []


def is_prompt_only(path, column="prompt"):
    """Whether `path` is a prompt-only dataset: a prompt column (`column`, --prompt-column), and none of verl's.
    jsonl and save_to_disk hold only these: verl's schema is read from parquet (DataError, saying so, for verl's
    columns there)."""
    names = columns(path)
    if names is None:
        return False
    verl = [c for c in VERL_COLUMNS if c in names]
    if storage(path) != "parquet" and verl:
        first = ""
        if storage(path) == "jsonl":  # a typed column (Arrow) is in every row
            at = next(i for i, row in enumerate(read_jsonl(path)) if any(c in row for c in verl))
            first = f" (first in row {at})"
        raise DataError(
            f"{path}: has verl's column(s) {verl}{first}, and verl's schema is read from parquet (data_prep.py "
            "writes it); for TRL's prompt-only format drop them and keep a 'prompt' column"
        )
    return storage(path) != "parquet" or (column in names and not verl)


def prompt_problem(prompt, text):
    """What is wrong with one prompt, or None; `text`: whether the dataset's prompts are text (its first row's)."""
    if text:  # only whitespace is no text: 0 tokens for many tokenizers, and no engine generates from none
        if not isinstance(prompt, str) or not prompt.strip():
            return f"expected non-empty text, as row 0's prompt is, got {prompt!r:.80}"
        return None
    if not isinstance(prompt, list) or not prompt:
        return f"expected a non-empty list of chat messages, as row 0's prompt is, got {prompt!r:.80}"
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            return f"message {j}: expected {{'role': str, 'content': str}}, got {msg!r:.80}"
    return None


def load_prompt_only(path, column="prompt", system=""):
    """The rows of a prompt-only dataset, each checked: its prompt is text or a list of {"role", "content"}
    messages, the same kind as row 0's (TRL reads one or the other). Every bad row is named (the first 10).
    As open-r1's script builds them: with another `column` (--prompt-column), row["prompt"] is its text as the
    user's turn; with a `system` prompt (--system-prompt), that system message comes first."""
    rows, where = read_rows(path)
    if not rows:
        raise DataError(f"{path}: has no rows")
    missing = [i for i, row in enumerate(rows) if column not in row]
    text = isinstance(rows[0].get(column), str)  # row 0's kind: text, or chat messages
    build = column != "prompt" or system  # open-r1's: the prompt made from the column, after the system message
    bad = []
    for i, row in enumerate(rows):
        problem = f"missing; a prompt-only dataset needs a {column!r} column" if i in missing else None
        problem = problem or prompt_problem(row.get(column), text)
        if problem:
            file, j = where[i]
            bad.append(f"  {'' if file == path else file + ', '}row {j}, field {column}: {problem}")
        elif build:
            turns = [{"role": "user", "content": row[column]}] if text else row[column]
            row["prompt"] = ([{"role": "system", "content": system}] if system else []) + turns
    if bad:
        listing = "\n".join(bad[:10]) + ("\n  ..." if len(bad) > 10 else "")
        raise DataError(f"{path}: {len(bad)} of {len(rows)} rows of this prompt-only dataset are invalid:\n{listing}")
    return rows
