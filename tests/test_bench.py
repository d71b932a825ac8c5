"""benchmarks/: the shared statistics (common.py), the checks of bench_vs_trl.py and sweep_ours.py and
their runners. The benchmarks themselves need TRL (benchmarks/requirements-bench.txt) and a quiet
machine, so the suite does not run them."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_vs_trl as bench  # noqa: E402
import common  # noqa: E402
import runners  # noqa: E402
import sweep_ours  # noqa: E402


def test_the_peer_is_pinned():
    pins = runners.pinned_peer()
    assert pins["trl"] == "1.16.0" and "torch" not in pins  # torch is ours: requirements-cpu.txt pins it


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (bench, ["--hidden", "100"], "--hidden must be a positive multiple of 64"),
        (bench, ["--group-size", "1"], "--group-size must be at least 2"),
        (bench, ["--steps", "5", "--warmup", "5"], "--steps (5) must be larger than --warmup (5)"),
        (bench, ["--trl-engines", "generate,sglang"], "unknown ['sglang']"),
        (bench, ["--trl-passes", "3"], "every --trl-passes value must divide the completions per step, 128"),
        (sweep_ours, ["--sweep-n", "4,eight"], "expected comma-separated integers"),
        (sweep_ours, ["--sweep-n", "1"], "every --sweep-n value must be at least 2"),
        (sweep_ours, ["--steps", "5"], "--steps (5) must be larger than --warmup (5)"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(script, argv, message, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert message in capsys.readouterr().err


def test_statistics_of_kept_steps():
    run = {"records": [{"step": s, "step_s": float(s)} for s in range(1, 8)]}
    kept = [r["step_s"] for r in common.kept(run, warmup=2)]
    assert kept == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert common.stats(kept) == dict(median=5.0, p25=4.0, p75=6.0, min=3.0, max=7.0, count=5)


def test_matmul_weights_count_the_tied_head_apart_and_not_the_lookup(tmp_path):
    from models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "m"), ["a", "b", "c"], hidden=128, layers=2, heads=2, intermediate=512)
    vocab = 7 + 3  # the special tokens and the words
    per_layer = 4 * 128 * 128 + 3 * 128 * 512  # q, k, v, o and the gated MLP
    assert common.matmul_params(model) == (2 * per_layer, vocab * 128)


def test_update_mfu_is_model_flops_over_time_over_the_machine_rate():
    steps = [{"step": s, "prompt_tokens": 1000, "gen_tokens": 3000, "update_s": 2.0} for s in range(1, 5)]
    out = common.update_mfu([{"records": steps}], warmup=1, n_matmul=(1_000_000, 0), rate=24e9)
    assert out["tokens"] == 4000 and out["gflop"] == 24.0 and out["gflops"] == 12.0 and out["mfu"] == 0.5
    # the head multiplies only the answer's tokens: 6 x 2M x 3000 more FLOPs, not 6 x 2M x 4000
    out = common.update_mfu([{"records": steps}], warmup=1, n_matmul=(1_000_000, 2_000_000), rate=24e9)
    assert out["gflop"] == 24.0 + 36.0 and out["gflops"] == 30.0 and out["mfu"] == 1.25
    # shared prompts: the update computes each prompt once per group (here 250 of the 1000 tokens)
    shared = [dict(s, update_prompt_tokens=250) for s in steps]
    out = common.update_mfu([{"records": shared}], warmup=1, n_matmul=(1_000_000, 0), rate=24e9)
    assert out["tokens"] == 3250 and out["gflop"] == 19.5


def test_the_gsm8k_setups_say_how_to_build_what_they_need(tmp_path):
    args = bench.parse_args(["--setup", "smollm2", "--gsm8k", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="python data_prep.py gsm8k"):
        runners.prepare_inputs(args)


def test_bf16_is_asked_of_both_sides_and_fp16_refused(capsys):
    assert bench.parse_args([]).dtype == "fp32"
    assert bench.parse_args(["--dtype", "bf16"]).dtype == "bf16"
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_bf16_step_counts_each_shared_prompt_once_per_group(tmp_path):
    import bf16_step

    from models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "m"), ["a", "b", "c"], hidden=128, layers=2, heads=2, intermediate=512)
    blocks, head = 2 * (4 * 128 * 128 + 3 * 128 * 512), 10 * 128
    row = {"prompt_length/mean": 40.0, "response_length/mean": 10.0}
    # 8 prompts x 8 answers: the blocks see 8 x 40 prompt tokens and 64 x 10 answer tokens, the head the answers
    assert bf16_step.update_flops(model, row, 8, 8) == 6 * (blocks * (8 * 40 + 64 * 10) + head * 64 * 10)


def test_bf16_parity_reads_the_validations_and_the_time_to_a_gain(tmp_path):
    import json

    import bf16_parity
    from common import SMOLLM2_METRIC as METRIC

    rows = [{"step": 0, METRIC: 0.2}]
    rows += [{"step": s, "timing_s/step": 10.0} | ({METRIC: a} if a is not None else {}) for s, a in
             [(1, None), (2, 0.45), (3, None), (4, 0.55)]]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = common.held_out_curve(str(tmp_path))
    assert points == [(0, 0.0, 0.2), (2, 20.0, 0.45), (4, 40.0, 0.55)]
    assert bf16_parity.time_to_gain(points, 0.30) == 40.0 and bf16_parity.time_to_gain(points, 0.5) is None


def test_gpu_benchmark_splits_a_step_into_its_phases():
    import gpu

    run = {"records": [dict(step=s, step_s=4.0, gen_s=3.0, reward_s=0.0, update_s=0.5, sync_s=0.5) for s in (1, 2, 3)]}
    run["records"][0]["step_s"] = 99.0  # the warm-up step is dropped
    rows = {row[0]: row[1:] for row in gpu.phase_table(run, warmup=1)}
    assert rows["gen"] == ["3.000", "75%"] and rows["update"] == ["0.500", "12%"] and rows["whole step"][0] == "4.000"
    assert gpu.peak({"records": [dict(rss_gb=1.0), dict(rss_gb=3.0)]}) == 3.0
    args = gpu.parse_args(["--like", "x", "--gsm8k", "y", "--skip", "trl"])
    assert (args.steps, args.prompts, args.group_size, args.response_length) == (10, 16, 8, 128)


@pytest.mark.slow
def test_the_gpu_step_script_dry_runs_on_the_cpu(tmp_path, gsm8k_head):
    """benchmarks/gpu.py on a tiny Qwen-vocabulary model on the CPU, so the script a GPU session runs in one
    call has run before: ours (the engine on the policy's own weights, one step profiled) and the baseline (its
    own copy, synced every step) train on GSM8K prompts, eval.py scores ours' final model, and the JSON holds
    each run's phases, the profile's table and the engine-vs-trainer gap. TRL is not installed here, and the
    --compile-blocks run is ours with one more flag (tests/test_checkpoint.py runs it in the trainer)."""
    import json
    import subprocess

    from conftest import QWEN_DIR, need

    need(QWEN_DIR)
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "benchmarks/gpu.py", "--like", QWEN_DIR, "--gsm8k", str(gsm8k_head), "--json", str(out)]
    cmd += ["--work-dir", str(tmp_path / "work"), "--hidden", "128", "--layers", "2", "--dtype", "fp32"]
    cmd += ["--steps", "3", "--other-steps", "2", "--warmup", "1", "--prompts", "4", "--group-size", "2"]
    cmd += ["--response-length", "8", "--skip", "trl,compile"]
    proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["ok"] == {"ours": True, "baseline": True, "eval": True}, results["ok"]
    ours, baseline = results["summary"]["ours"], results["summary"]["baseline"]
    assert ours["weights_shared"] and not baseline["weights_shared"]
    assert ours["engine_gap_max"] < 1e-3 and baseline["engine_gap_max"] < 1e-3  # both sample the trainer's policy
    assert ours["phases_s"]["sync_s"] < min(0.05, baseline["phases_s"]["sync_s"])  # nothing to copy or check
    profile = results["runs"]["ours"]["profile"]
    assert profile["step"] == 2 and any("update_actor" in line for line in profile["table"])
    assert [r["step"] for r in results["runs"]["ours"]["records"]] == [1, 3]  # the profiled step left out
    assert results["summary"]["speedup_vs_baseline"] > 0


@pytest.mark.slow
def test_the_gpu_update_script_dry_runs_every_stage_on_the_cpu(tmp_path, gsm8k_head):
    """benchmarks/gpu_update.py --dry-run: a tiny model on the CPU through every stage, so the script a GPU
    session runs in one call has run before. Each head geometry matches the materialised logits, every
    update setting and the profile ran, and the paths stage ran its kill and resume (the runs a GPU adds:
    grad checkpointing, LoRA, --offload params, go through the same code): the resumed run logs what the
    uninterrupted run logged, value for value."""
    import json
    import subprocess

    from conftest import QWEN_DIR, need

    need(QWEN_DIR)
    out = tmp_path / "gpu_update.json"
    cmd = [sys.executable, "benchmarks/gpu_update.py", "--dry-run", "--like", QWEN_DIR, "--gsm8k", str(gsm8k_head)]
    cmd += ["--json", str(out), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert set(stages) == {"matmul", "head", "update", "ablations", "profile", "paths"}
    for name, g in stages["head"]["geometries"].items():
        assert "error" not in g and g["max_diff"]["logp"] < 1e-5 and g["max_diff"]["entropy"] < 1e-5, name
        assert g["max_diff"]["grad_weight"] <= 0.01 * g["grad_scale"]["grad_weight"], name  # bf16's rounding
    assert {"forward", "backward", "clip", "overflow", "step"} == set(stages["update"]["new"]["phases_s"])
    assert all("update_s" in row for row in stages["ablations"].values()) and len(stages["ablations"]) == 7
    assert stages["profile"]["new"]["top"] and stages["profile"]["old"]["top"]
    paths = stages["paths"]
    assert all(paths[k]["ok"] for k in ("whole-a", "killed", "resumed")), paths
    assert paths["killed"]["steps"] == [1] and paths["resumed"]["resumed_from_checkpoint"]
    assert paths["resumed"]["steps"] == [1, 2, 3] and paths["resumed vs whole-a"]["differ"] == 0


@pytest.mark.slow
def test_the_gpu_compile_script_dry_runs_every_setting_on_the_cpu(tmp_path, gsm8k_head):
    """benchmarks/gpu_compile.py --dry-run: the head's passes compiled (traced, the eager backend) give the
    in-place passes' numbers, every setting's update runs with the graphs it compiles, and the trainer runs
    with and without --compile-blocks."""
    import json
    import subprocess

    from conftest import QWEN_DIR, need

    need(QWEN_DIR)
    out = tmp_path / "gpu_compile.json"
    cmd = [sys.executable, "benchmarks/gpu_compile.py", "--dry-run", "--like", QWEN_DIR, "--gsm8k", str(gsm8k_head)]
    proc = subprocess.run(cmd + ["--json", str(out)], cwd=common.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert all(v < 1e-5 * max(1.0, stages["head"]["scale"][k]) for k, v in stages["head"]["max_diff"].items())
    rows = stages["update"]
    assert all("update_s" in row for row in rows.values()) and len(rows) == 5, rows
    assert rows["in-place head"]["graphs"] == 0 and rows["shipped"]["graphs"] >= 2
    assert rows["shipped + blocks"]["graphs"] > rows["shipped"]["graphs"]
    trainer = stages["trainer"]  # --compile-blocks in the trainer, against without: 2 steps each
    assert trainer["plain"]["ok"] and trainer["compile-blocks"]["ok"], trainer
    assert len(trainer["compile-blocks"]["updates_s"]) == 2 and trainer["update_ratio"] > 0, trainer


def test_the_suite_census_logs_each_process_and_counts_it_by_kind(tmp_path):
    """benchmarks/suite_census.py's hook, in a real child process, and its counts."""
    import json
    import subprocess

    import suite_census

    log = str(tmp_path / "census.jsonl")
    env = suite_census.install_hook(str(tmp_path), log)
    env.update(RANK="0", PYTEST_CURRENT_TEST="tests/test_x.py::test_y (call)")
    (tmp_path / "train.py").write_text("sum(range(10**6))")
    subprocess.run([sys.executable, "-c", "sum(range(10**6))"], env=env, check=True)
    subprocess.run([sys.executable, str(tmp_path / "train.py")], env=env, check=True)  # as a rank's script
    records = [json.loads(line) for line in open(log)]
    assert len(records) == 2 and all(r["cpu"] > 0 and r["rank"] == "0" for r in records)
    records.append(dict(argv=["/x/torch/distributed/run.py", "--standalone"], test="", rank=None, cpu=1.5, vllm=False))
    counts = suite_census.census(records)
    assert counts["torchrun"] == (1, 1.5) and counts["rank: train.py"][0] == 1 and "other: -c" in counts
    assert list(suite_census.by_test(records)) == ["tests/test_x.py::test_y"]
