"""One rank on the CPU: the transformers engine on the policy's own weights (the default) against the same
engine with its own copy, synced every step (--no-engine-shares-policy, as before commit c023533), and against
the vLLM engine, on the demo's work (or --model/--train-data's), the three interleaved round by round.

    python benchmarks/hf_engine_cpu.py [--rounds 3] [--steps 12] [--warmup 2] [--json out.json]

Each run is train_grpo.py in a fresh process (no validation or checkpoints); the table has each setting's
medians over the kept steps of all rounds, and the ratios of the shared engine's step to the others'. Other
load on the machine shows as "other load" (common.run_process): above a few percent the times are disturbed.
"""

import argparse
import json
import os
import statistics
import sys

from common import DEMO_MEASURED, REPO, fresh_dir, print_table, run_process, write_json

SETTINGS = {  # name: train_grpo.py's flags
    "shared": ["--rollout=hf"],  # the transformers engine on the policy's own weights
    "copy": ["--rollout=hf", "--no-engine-shares-policy"],  # the same engine with its own copy, synced
    "vllm": ["--rollout=vllm"],
}
PHASES = ("step", "gen", "update_actor", "update_weights")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "hf_engine_cpu"))
    p.add_argument("--json", default="")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which of them, comma-separated")
    args, extra = p.parse_known_args()  # anything else goes to train_grpo.py (e.g. --model, --train-data)
    demo = [] if any(a.split("=")[0] == "--model" for a in extra) else DEMO_MEASURED  # the demo as it was measured
    flags = [*demo, f"--max-steps={args.steps}", "--test-freq=-1", "--save-freq=-1", "--no-save-model", *extra]
    chosen = {name: SETTINGS[name] for name in args.settings.split(",")}
    times = {name: {k: [] for k in PHASES} for name in chosen}
    loads = {name: [] for name in chosen}
    for r in range(args.rounds):
        for name, setting in chosen.items():
            run_dir = fresh_dir(os.path.join(args.work_dir, f"{name}_{r}"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
            cmd += ["train_grpo.py", f"--out-dir={run_dir}/out", *setting, *flags]
            ok, error, load = run_process(cmd, run_dir, os.cpu_count())
            if not ok:
                raise SystemExit(f"{name}, round {r + 1}: {error} (log: {run_dir}/log.txt)")
            loads[name].append(load)
            rows = [json.loads(line) for line in open(f"{run_dir}/out/metrics.jsonl")]
            for m in rows:
                if m.get("step", 0) > args.warmup and "timing_s/step" in m:
                    for k in PHASES:
                        times[name][k].append(m[f"timing_s/{k}"])
            print(f"round {r + 1}, {name}: {statistics.median(times[name]['step']):.3f} s/step so far", flush=True)
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    rows = [[name] + [f"{med[name][k]:.3f}" for k in PHASES] + [f"{max(loads[name]):.0%}"] for name in chosen]
    first = next(iter(chosen))
    note = ", ".join(f"{name}'s step / {first}'s: {med[name]['step'] / med[first]['step']:.2f}x" for name in chosen)
    print_table(
        f"median seconds over steps > {args.warmup} of {args.rounds} rounds",
        ["setting", *PHASES, "other load"],
        rows,
        note=note,
    )
    if args.json:
        write_json(args.json, dict(medians=med, times=times, other_load=loads, flags=flags))


if __name__ == "__main__":
    main()
