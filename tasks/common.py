"""What the tasks' data writers share: reading a jsonl release line by line with errors that name
the line, writing rows of verl's schema to a parquet file, and splitting a count in proportion."""

import json
import os


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


def write_parquet(rows, path, quiet=False):
    """Write `rows` to `path` and say so (quiet=True: say nothing, as the demo writes its data)."""
    # imported here, not at the top: the scorers load the task files (reward.py) and write nothing
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    if not quiet:
        print(f"wrote {len(rows)} rows to {path}")


def split_counts(total, weights):
    """`total` split in proportion to `weights` (largest remainder): [3, 1] of 10 -> [8, 2]... exactly summing."""
    shares = [total * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts
