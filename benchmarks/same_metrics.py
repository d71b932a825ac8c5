"""Whether two runs logged the same numbers: every field of metrics.jsonl, step by step, except the
ones that measure time or the machine (timing_s/*, perf/throughput and perf/max_memory_allocated_gb,
which is the process's peak memory on CPU) or where a process started (perf/first_step_after_start: a
resumed run has one more). A restructure that keeps behaviour passes it.

    torchrun --nproc_per_node=1 train_grpo.py --max-steps 30 --out-dir runs/before   # at the old commit
    torchrun --nproc_per_node=1 train_grpo.py --max-steps 30 --out-dir runs/after    # at the new one
    python benchmarks/same_metrics.py runs/before runs/after
"""

import json
import sys

MACHINE = ("timing_s/", "perf/throughput", "perf/max_memory_allocated_gb", "perf/first_step_after_start")


def records(run_dir):
    with open(f"{run_dir}/metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return [{k: v for k, v in m.items() if not k.startswith(MACHINE)} for m in lines]


def differences(a, b):
    """(step, field, value in a, value in b) for every field that differs; a missing line or field counts."""
    out = [(None, "lines", len(a), len(b))] if len(a) != len(b) else []
    for x, y in zip(a, b):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                out.append((x.get("step"), key, x.get(key), y.get(key)))
    return out


if __name__ == "__main__":
    a, b = records(sys.argv[1]), records(sys.argv[2])
    diff = differences(a, b)
    for step, key, x, y in diff[:20]:
        print(f"step {step}: {key}: {x} != {y}")
    fields = sum(len(m) for m in a)
    print(f"{len(a)} lines, {fields} values compared: " + ("identical" if not diff else f"{len(diff)} differ"))
    sys.exit(1 if diff else 0)
