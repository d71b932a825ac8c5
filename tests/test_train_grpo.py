"""train_grpo.py end to end: the real script under torchrun on CPU with the tiny model.

Slow (each vLLM run starts an engine), so marked; CI runs them all.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import check_saved_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a short run of the demo: tiny model, digits task, small batches
SMALL = (
    "--max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16".split()
)


def train(out_dir, *flags, ranks=1, check=True, env=None, console=False):
    """Run train_grpo.py under torchrun; returns the completed process (console=True: stderr joins stdout, in
    the order a terminal shows them)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "train_grpo.py",
        "--out-dir",
        str(out_dir),
        *flags,
    ]
    err = subprocess.STDOUT if console else subprocess.PIPE
    how = dict(cwd=REPO, stdout=subprocess.PIPE, stderr=err, timeout=600, env={**os.environ, **(env or {})})
    proc = subprocess.run(cmd, **how, text=not console)  # text=True would turn a carriage return into a newline
    if console:
        proc.stdout = proc.stdout.decode(errors="replace")
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train_grpo.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{(proc.stderr or '')[-5000:]}"
        )
    return proc


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "final_model", "model.safetensors"))


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """The same short run on the vLLM engine with 1 rank and with 2 ranks; 1 rank runs every
    sequence whole (--no-share-prompts), 2 ranks each group's prompt once (the default)."""
    root = tmp_path_factory.mktemp("vllm")
    for ranks in (1, 2):
        shared = "--share-prompts" if ranks == 2 else "--no-share-prompts"
        proc = train(root / f"ranks{ranks}", *SMALL, "--rollout", "vllm", shared, ranks=ranks, console=True)
        (root / f"ranks{ranks}.log").write_text(proc.stdout, newline="")  # stdout and stderr, as the console shows them
    return root


VERL_METRICS = [
    *[f"critic/{k}/{s}" for k in ("score", "advantages") for s in ("mean", "max", "min")],
    *[f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")],
    *[f"prompt_length/{s}" for s in ("mean", "max", "min")],
    *[f"actor/{k}" for k in ("pg_loss", "kl_loss", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl", "lr")],
    *[f"timing_s/{k}" for k in ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights", "step")],
    *[f"perf/{k}" for k in ("throughput", "total_num_tokens", "max_memory_allocated_gb")],
    "frac_reward_zero_std",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
]


@pytest.mark.slow
def test_a_run_writes_config_metrics_samples_and_model(vllm_runs):
    run = vllm_runs / "ranks1"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # validation before training: only validation metrics, the headline among them
    assert "val-core/synthetic/digits/reward/mean@1" in rows[0] and all(
        k == "step" or k.startswith("val-") for k in rows[0]
    )
    for row in rows[1:]:
        missing = [k for k in VERL_METRICS if k not in row]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert row["training/rollout_logprob_diff_max"] <= 1e-4  # engine and trainer agree (fp32)
    assert "val-core/synthetic/digits/reward/mean@1" in rows[2]
    log_text = (vllm_runs / "ranks1.log").read_text()
    assert "demo: a tiny model learns the digits task from scratch" in log_text
    assert "validation samples, step 0:" in log_text and "ground_truth" in log_text  # the sample table
    # a quiet console: none of vLLM's INFO lines, at start-up or at each weight sync
    assert " INFO " not in log_text and "Reloading and processing weights" not in log_text
    assert "RotaryEmbedding: Failed to load weights" not in log_text and "prefix cache" not in log_text
    config = json.load(open(run / "config.json"))
    assert config["max_steps"] == 2 and config["lr"] == 3e-4  # the demo's override, recorded
    assert (run / "samples" / "val_step_2.jsonl").exists() and (run / "samples" / "train.jsonl").exists()
    # the health report closes every run; two steps of a random policy are judged as such
    assert f"health report: {run / 'report' / 'report.md'}:" in log_text
    report = (run / "report" / "report.md").read_text()
    assert "| final `val-core/synthetic/digits/reward/mean@1` |" in report and (run / "report" / "reward.png").exists()
    # the saved model is the trained policy: it moved away from the initial weights
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(run / "tiny_model").state_dict()
    trained = final_weights(run)
    assert any(not torch.equal(trained[k], start[k]) for k in trained)


def console_lines(text):
    """The console as a terminal shows it: within a line, each carriage return goes back to its start and the
    text after it overwrites what was there (a progress bar's redraws are one line); trailing blanks dropped."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        lines.append(shown.rstrip())
    return lines[:-1] if lines and not lines[-1] else lines


# The demo's console (SMALL's run), line by line: the run's story, on rank 0 alone, and no third-party warning.
# Health warnings come and go with the run's numbers (and the machine's load: step times), so they are left out.
STORY = [
    r"demo: a tiny model learns the digits task from scratch, so config\.DEMO_OVERRIDES replaces some of verl's defaults",
    r"compute dtype: fp32 \(.+\)",
    r"config: model=\S+/tiny_model train_data=.+; the other flags have their defaults \(all of them: \S+/config\.json\)",
    r"rollout engine: VLLMEngine, KV cache of [\d,]+ tokens",
    r"validation samples, step 0:",
    r"prompt +\| response +\| ground_truth \| score",
    r"-{100,}",
    *[r"\.\.\..+ \| .+ \| \d +\| \d\.\d{3}"] * 3,
    r"step 0: val-core/synthetic/digits/reward/mean@1=\d\.\d{4}",
    r"step 2: val-core/synthetic/digits/reward/mean@1=\d\.\d{4}",
    r"Training Progress: 100%\|.+\| 2/2 \[.+\]",
    r"saved the policy to \S+/final_model",
    r"health report: \S+/report\.md: (healthy|watch|problem) \(\d+ problem, \d+ watch, \d+ healthy\)",
]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_console_tells_the_runs_story(vllm_runs, ranks):
    """Everything the demo prints, stdout and stderr, at 1 and 2 ranks: no vLLM, torch or FSDP warning (console.py
    keeps those off unless --verbose), no line twice from two ranks. The config's line may wrap."""
    with open(vllm_runs / f"ranks{ranks}.log", newline="") as f:  # carriage returns kept
        lines = console_lines(f.read())
    story = []
    for line in lines:
        if line.startswith("  ") and story and story[-1].startswith("config: "):
            story[-1] += " " + line.strip()  # the config line, wrapped
        elif not line.startswith("health: "):
            story.append(line)
    assert len(story) == len(STORY), "\n".join(lines)
    for line, pattern in zip(story, STORY):
        assert re.fullmatch(pattern, line), f"{line!r} is not {pattern!r}; the console:\n" + "\n".join(lines)
    assert len(lines) <= 30


@pytest.mark.slow
def test_one_and_two_ranks_give_the_same_update(vllm_runs):
    """And shared prompts the same as whole sequences: under FSDP2 the prompt's forward and the
    responses' forward both reach the sharded weights' gradients."""
    one, two = metrics(vllm_runs / "ranks1"), metrics(vllm_runs / "ranks2")
    for a, b in zip(one[1:], two[1:]):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    w1, w2 = final_weights(vllm_runs / "ranks1"), final_weights(vllm_runs / "ranks2")
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_saved_model_loads_in_transformers_and_vllm_alike(vllm_runs):
    assert (
        check_saved_model(vllm_runs / "ranks2" / "final_model", [f"list 1 2 3 4 5 {d} last" for d in range(4)]) <= 1e-4
    )


@pytest.mark.slow
def test_transformers_engine_off_policy_with_reference_on_two_ranks_wandb_and_tensorboard(tmp_path):
    # ppo_epochs 2 and two mini-batches: old log-probs are recomputed; kl_coef > 0 loads the reference
    flags = [
        *SMALL,
        *"--rollout hf --ppo-epochs 2 --mini-batch-size 4 --micro-batch-size 8 --kl-coef 0.01 --tis-cap 2.0 --grad-checkpointing --lr-schedule cosine --warmup-steps 0 --min-lr-ratio 0.1 --val-n 2 --val-temperature 1.0".split(),
    ]
    loggers = ["--logger", "console,jsonl,wandb,tensorboard", "--wandb-project", "grpo-test"]
    proc = train(tmp_path, *flags, *loggers, ranks=2, env={"WANDB_MODE": "offline"})
    # wandb, offline: a run directory to `wandb sync` later, and our metrics in its summary
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run written"
    assert "Run summary" in proc.stdout + proc.stderr and "actor/grad_norm" in proc.stdout + proc.stderr
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json")), (
        "no samples table in wandb"
    )
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # two validation samples per prompt: mean@2 headlines, the rest as in verl
    assert "val-core/synthetic/digits/reward/mean@2" in rows[0] and "val-aux/synthetic/digits/reward/pass@2" in rows[2]
    assert rows[1]["timing_s/old_log_prob"] > 0 and rows[1]["timing_s/ref"] > 0
    assert rows[2]["actor/kl_loss"] > 0  # after one update the policy differs from the reference
    assert rows[1]["training/rollout_logprob_diff_max"] <= 1e-4
    # cosine from the peak towards 10% of it over 2 steps: step 2 is halfway, 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert rows[1]["actor/lr"] == pytest.approx(3e-4) and rows[2]["actor/lr"] == pytest.approx(3e-4 * 0.55)
    assert rows[1]["perf/total_num_tokens"] == rows[1]["prompt_length/mean"] * 32 + rows[1]["response_length/mean"] * 32
    # TensorBoard, read back from its event files: every scalar under metrics.jsonl's name, with its
    # value; histograms of both ranks' 32 samples; the config and the validation samples as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}
    ).Reload()
    for row in rows:
        for name, value in row.items():
            if name != "step":
                logged = {e.step: e.value for e in events.Scalars(name)}
                assert logged[row["step"]] == pytest.approx(value, rel=1e-6), name
    for name in ("critic/score", "critic/advantages", "response_length"):
        assert [h.step for h in events.Histograms(name)] == [1, 2] and events.Histograms(name)[
            0
        ].histogram_value.num == 32
    assert {"config/text_summary", "val/generations/text_summary"} <= set(events.Tags()["tensors"])


# ----------------------------------------------------------------------------------------------
# The GRPO family: the options verl and TRL users switch between (README: "Recipes")

# the demo on vLLM with DAPO's dynamic sampling and overlong punishment, REINFORCE++ and masked
# truncation. With a buffer of 3 of the 4 response tokens, a group is informative when its lengths
# differ: about half of the random policy's groups are, so steps need a second generation batch.
FAMILY = [*SMALL, "--max-steps", "3", "--test-freq", "3", "--rollout", "vllm", "--filter-groups"]
FAMILY += (
    "--max-gen-batches 2 --overlong-buffer-len 3 --adv-estimator reinforce_plus_plus_baseline --mask-truncated".split()
)


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    for ranks in (1, 2):
        train(root / f"ranks{ranks}", *FAMILY, ranks=ranks)
    return root


@pytest.mark.slow
def test_dynamic_sampling_and_reinforce_pp_train_the_same_batch_on_one_and_two_ranks(family_runs):
    one, two = metrics(family_runs / "ranks1"), metrics(family_runs / "ranks2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3]
    for a, b in zip(one[1:], two[1:]):
        for key in ("filter/kept_groups", "filter/dropped_groups", "filter/gen_batches", "response_length/mean"):
            assert a[key] == b[key], key
        for key in (
            "critic/score/mean",
            "reward_extra/overlong_penalty/mean",
            "critic/advantages/max",
            "actor/pg_loss",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # only informative groups are trained on; when the rollouts ran out, they repeat to fill the batch
        kept, batches = a["filter/kept_groups"], a["filter/gen_batches"]
        assert a["frac_reward_zero_std"] == 0 and 0 < kept <= 8 and (kept == 8 or batches == 2)
        assert a["reward_extra/overlong_penalty/mean"] < 0
    assert any(r["filter/gen_batches"] == 2 for r in one[1:])  # a step that needed more prompts
    assert any(r["filter/kept_groups"] < 8 for r in one[1:])  # and one whose rollouts ran out


@pytest.mark.slow
def test_gspo_with_rloo_trains_and_reports_verls_keys(tmp_path):
    flags = [*SMALL, "--rollout", "hf", "--loss-mode", "gspo", "--clip-low", "3e-4", "--clip-high", "4e-4"]
    train(tmp_path, *flags, "--adv-estimator", "rloo", "--test-freq", "-1")
    rows = metrics(tmp_path)  # no validation: steps 1 and 2 only
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/pg_clipfrac_lower"] == 0 for r in rows)  # no dual clip
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in rows)


def test_a_masked_response_counts_for_nothing_in_the_update(tmp_path):
    """--mask-truncated zeroes a truncated response's mask: train_grpo.update_policy then makes the
    update it makes without that response at all (in-process, a world of one rank)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import train_grpo
    from config import Args
    from models import build_tiny_model
    from policy import make_batch
    from tasks.digits import TASK_WORDS

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    path = build_tiny_model(str(tmp_path / "m"), TASK_WORDS)
    args = Args(group_size=2, mini_batch_size=2, micro_batch_size=2, entropy_coef=0.0, grad_clip=1e9)
    prompts, responses = [[3, 4, 5], [3, 6], [7, 8, 9, 4], [5]], [[10, 11], [12, 13, 14, 15], [10], [11, 12, 13]]

    def update(rows, keep):
        model = AutoModelForCausalLM.from_pretrained(path)
        batch = make_batch([prompts[i] for i in rows], [responses[i] for i in rows], pad_id=0)
        batch["response_mask"] = batch["response_mask"] * torch.tensor(keep)[:, None]  # what --mask-truncated does
        batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[rows][:, None] * batch["response_mask"]
        batch["engine_logp"] = torch.zeros_like(batch["response_mask"])
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        train_grpo.update_policy(model, optimizer, batch, step=1, args=args, world=1, device=torch.device("cpu"))
        return dict(model.named_parameters())

    masked, without = update([0, 1, 2, 3], [1, 0, 1, 1]), update([0, 2, 3], [1, 1, 1])
    base = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert any(not torch.equal(masked[k], base[k]) for k in base)  # the update did something
    for name in base:
        torch.testing.assert_close(masked[name], without[name], rtol=0, atol=1e-6, msg=name)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# bad input fails clearly (single process, no engine needed before the failure)


def run_plain(tmp_path, *flags):
    cmd = [sys.executable, "train_grpo.py", "--out-dir", str(tmp_path / "run"), "--rollout", "hf", *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_missing_model_path(tmp_path):
    proc = run_plain(tmp_path, "--model", str(tmp_path / "no_such_model"))
    assert proc.returncode != 0 and "no_such_model" in proc.stderr and "no such directory" in proc.stderr


@pytest.mark.slow
def test_unreadable_and_empty_data(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    proc = run_plain(tmp_path, "--train-data", str(junk))
    assert proc.returncode != 0 and "junk.parquet: not a readable parquet file" in proc.stderr
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table(
            {
                "data_source": pa.array([], pa.string()),
                "prompt": pa.array([], pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                "reward_model": pa.array([], pa.struct([("ground_truth", pa.string())])),
            }
        ),
        empty,
    )
    proc = run_plain(tmp_path, "--train-data", str(empty))
    assert proc.returncode != 0 and "empty.parquet: has no rows" in proc.stderr


@pytest.mark.slow
def test_a_data_source_without_a_reward_stops_the_run_at_load(tmp_path):
    # before: the run trained until a step first sampled such a row, then named "sample 240"
    from tasks.common import write_parquet
    from tasks.digits import digits_rows

    rows = digits_rows("train", 8, seed=0)
    write_parquet(rows + [dict(rows[0], data_source="my/puzzles")], str(tmp_path / "mine.parquet"))
    proc = run_plain(
        tmp_path, "--train-data", str(tmp_path / "mine.parquet"), "--prompt-batch-size", "8", "--mini-batch-size", "8"
    )
    assert proc.returncode != 0 and "mine.parquet: 1 of 9 rows are invalid" in proc.stderr
    assert (
        "row 8, field data_source: no built-in reward for 'my/puzzles'" in proc.stderr and "--reward-fn" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_prompts_longer_than_the_limit_are_counted_or_fatal(tmp_path):
    from tasks.common import write_parquet
    from tasks.digits import digits_rows

    rows = digits_rows("train", 8, seed=0)
    long_row = dict(rows[0], prompt=[{"role": "user", "content": "list " + "1 " * 40 + "last"}])
    write_parquet(rows + [long_row] * 3, str(tmp_path / "mixed.parquet"))
    flags = [
        "--train-data",
        str(tmp_path / "mixed.parquet"),
        *"--max-steps 1 --prompt-batch-size 8 --mini-batch-size 8 --group-size 2 --test-freq -1".split(),
    ]
    proc = run_plain(tmp_path, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train data: dropped 3 of 11 prompts longer than max_prompt_length=32 tokens" in proc.stdout
    proc = run_plain(tmp_path / "again", "--max-prompt-length", "5")  # a new run directory: these are other flags
    assert proc.returncode != 0 and "every prompt is longer than max_prompt_length=5" in proc.stderr


@pytest.mark.slow
def test_early_stopping_keeps_the_best_policy(tmp_path):
    # lr 0: validation never improves, so patience 1 stops after the first step's validation
    metric = "val-core/synthetic/digits/reward/mean@1"
    flags = [
        *SMALL,
        *"--max-steps 5 --rollout hf --lr 0 --test-freq 1 --save-freq -1 --early-stop-metric".split(),
        metric,
        "--early-stop-patience",
        "1",
    ]
    proc = train(tmp_path, *flags)
    assert "early stop at step 1" in proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]
    assert (tmp_path / "best_model" / "model.safetensors").exists() and (tmp_path / "final_model").exists()
    proc = train(tmp_path / "typo", *SMALL, "--rollout", "hf", "--early-stop-metric", "val-core/nope", check=False)
    assert proc.returncode != 0 and "--early-stop-metric val-core/nope: no such validation metric" in proc.stderr


@pytest.mark.slow
def test_without_engine_logprobs_the_gap_is_not_logged(tmp_path):
    flags = [*SMALL, *"--max-steps 1 --rollout hf --no-val-before-train --test-freq -1 --save-freq -1".split()]
    train(tmp_path, *flags, "--no-engine-logprobs")
    (row,) = metrics(tmp_path)
    assert "actor/pg_loss" in row and not [k for k in row if k.startswith("training/rollout_")]
    proc = train(tmp_path / "tis", *flags, "--no-engine-logprobs", "--tis-cap", "2", check=False)
    assert proc.returncode != 0 and "--tis-cap needs the engine's log-probs" in proc.stderr


@pytest.mark.slow
def test_a_huge_learning_rate_is_reported_as_a_problem(tmp_path):
    """The demo at 100x its learning rate: the first updates wreck the policy, and both the live
    warnings and the end-of-run report say so (health.py, report.py)."""
    flags = "--lr 0.05 --max-steps 6 --test-freq 3 --val-max-prompts 32 --save-freq -1 --prompt-batch-size 16"
    proc = train(tmp_path, *flags.split(), "--mini-batch-size", "16")
    assert "health: step" in proc.stdout and "actor/entropy fell" in proc.stdout
    assert "health report:" in proc.stdout and ": problem (" in proc.stdout
    report = (tmp_path / "report" / "report.md").read_text()
    assert report.startswith("# Run health") and "Overall: **problem**" in report
    assert "| update size (largest one-step entropy drop) |" in report
    line = next(x for x in report.splitlines() if x.startswith("| update size"))
    assert "**PROBLEM** | <= 50% (more, in a run that did not learn: the learning rate is too high) |" in line


def test_large_cpu_tensors_get_huge_pages():
    """train_grpo.py asks torch to put large CPU tensors in 2 MiB pages: a [151,936, 128] fp32 tensor
    (the Qwen vocabulary's gradient at a small hidden size) then costs tens of page faults instead of
    one per 4 KiB page (19k). The control turns the variable off."""
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[madvise]" not in open(thp).read():
        pytest.skip("the kernel gives huge pages always or never, not on request: nothing to compare")
    code = (
        "import resource, train_grpo, torch\n"
        "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(5): torch.ones(151936, 128)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)"
    )

    def faults(thp_env):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        env.update(thp_env)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    with_huge_pages = faults({})  # what train_grpo.py sets for itself
    control = faults({"THP_MEM_ALLOC_ENABLE": "0"})
    assert control > 5 * 151936 * 128 * 4 // 4096 * 0.9  # 4 KiB pages: one fault each
    assert with_huge_pages < control / 20, (with_huge_pages, control)


def test_a_micro_batch_that_cannot_fit_is_reported_before_the_first_rollout(tmp_path, capsys):
    """check_update_memory: the largest micro-batch's activations against the free memory, printed
    with a --micro-batch-tokens that fits; nothing when it fits."""
    from transformers import AutoModelForCausalLM

    import memory
    from cli import parse_args
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    trained = list(model.parameters())
    free = memory.free_memory_gib(torch.device("cpu"), 1)
    if free is None:
        pytest.skip("no /proc/meminfo: the free memory cannot be read")
    args = parse_args(["--micro-batch-size", "16", "--max-prompt-length", "32", "--max-response-length", "32"])
    memory.check_update_memory(args, model, trained, world=1, ranks_here=1, device=torch.device("cpu"))
    assert capsys.readouterr().out == ""  # 16 x 64 tokens of a tiny model
    # per token about 100 KiB here: a micro-batch of 4M x 64 tokens needs far more than any machine has
    args = parse_args(["--micro-batch-size", "4000000", "--max-prompt-length", "32", "--max-response-length", "32"])
    args.share_prompts = False  # 4M sequences of 64 tokens
    memory.check_update_memory(args, model, trained, world=1, ranks_here=1, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert out.startswith("memory: the update's largest micro-batch (256000000 tokens)"), out
    fits = int(out.split("--micro-batch-tokens ")[1].rstrip(".\n"))
    # with shared prompts a micro-batch holds a whole group: 8 answers of 1M tokens cannot fit
    args = parse_args(["--max-prompt-length", "32", "--max-response-length", "1000000", "--group-size", "8"])
    memory.check_update_memory(args, model, trained, world=1, ranks_here=1, device=torch.device("cpu"))
    assert "--grad-checkpointing" in capsys.readouterr().out
    memory.check_update_memory(
        args, model, trained, world=1, ranks_here=1, device=torch.device("cpu"), kv_cache_gib=1.5
    )
    assert "The rollout engine's KV cache takes 1.5 GiB of this rank's memory" in capsys.readouterr().out
    per_token = float(out.split(" KiB of activations per token")[0].rsplit("(", 1)[1]) / 2**20
    assert 64 <= fits and fits * per_token <= free
