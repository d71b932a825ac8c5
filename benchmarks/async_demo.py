"""Does the demo stay learned at --max-staleness 1? README's first command (the tiny model, 200 steps,
lr 5e-4, vLLM) at S = 0 and S = 1, seeds 0-2, and S = 1 at half the learning rate; held-out accuracy
every 20 steps and its lowest over the last 50.

    python benchmarks/async_demo.py              # 9 runs, one thread each, two at a time: about 10 min

Stale samples delay the feedback of each update by a step; at a learning rate that large, the policy
can overshoot before its own samples show it.
"""

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import DEMO_MEASURED, print_table, read_metrics, write_json  # noqa: E402

METRIC = "val-core/synthetic/digits/reward/mean@1"


def run(run_dir, flags):
    """The demo with `flags` into run_dir, one thread; a run that already logged its last step is kept."""
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and read_metrics(run_dir)[-1]["step"] == 200:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    cmd += ["--out-dir", run_dir, "--rollout", "vllm", "--save-freq", "-1", "--no-save-model", "--resume", "never"]
    proc = subprocess.run(
        [*cmd, *DEMO_MEASURED, *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir} failed:\n{proc.stderr[-4000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work-dir", default="runs/bench_async_demo")
    a = p.parse_args()
    systems = {"S=0": ["--max-staleness", "0"], "S=1": ["--max-staleness", "1"]}
    systems["S=1, lr 2.5e-4"] = ["--max-staleness", "1", "--lr", "2.5e-4"]
    jobs = {
        f"{name}, seed {seed}": [*flags, "--seed", str(seed)] for name, flags in systems.items() for seed in a.seeds
    }
    dirs = {key: os.path.join(a.work_dir, key.replace(", ", "_").replace(" ", "").replace("=", "")) for key in jobs}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda key: run(dirs[key], jobs[key]), jobs))
    curves = {key: {r["step"]: r[METRIC] for r in read_metrics(d) if METRIC in r} for key, d in dirs.items()}
    steps = [s for s in sorted(curves[next(iter(curves))]) if s % 20 == 0]
    rows = [[s, *(f"{c[s]:.3f}" for c in curves.values())] for s in steps]
    lowest = {key: min(v for s, v in c.items() if s > 150) for key, c in curves.items()}
    rows.append(["min, steps 160-200", *(f"{v:.3f}" for v in lowest.values())])
    print_table("held-out accuracy of the demo (greedy, 500 questions)", ["step", *curves], rows)
    write_json(os.path.join(a.work_dir, "results.json"), dict(curves=curves, lowest=lowest))


if __name__ == "__main__":
    main()
