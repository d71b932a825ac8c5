"""health.py: live warnings from logged rows; report.py: the end-of-run report from a run directory.

The rows here are synthetic, shaped like train_grpo.py's metrics.jsonl; the real runs are in
test_train_grpo.py (a healthy short run, and one made unhealthy on purpose).
"""

import json
import math
import os

import pytest

import bands
import eval as evaluate
import health
import report

VAL = "val-core/synthetic/digits/reward/mean@1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_row(step, **over):
    """One healthy training step; `over` replaces any metric."""
    row = {
        "step": step,
        "actor/grad_norm": 0.5,
        "actor/kl_loss": 0.001,
        "actor/entropy": 0.8,
        "actor/pg_loss": 0.01,
        "actor/ppo_kl": 0.0,
        "critic/score/mean": 0.5,
        "critic/score/max": 1.0,
        "critic/advantages/min": -1.5,
        "critic/advantages/max": 1.5,
        "frac_reward_zero_std": 0.3,
        "response_length/mean": 3.0,
        "response_length/max": 4.0,
        "response_length/min": 1.0,
        "timing_s/step": 1.0,
        "timing_s/gen": 0.4,
        "timing_s/update_actor": 0.5,
        "timing_s/update_weights": 0.02,
        "perf/throughput": 1000.0,
        "perf/total_num_tokens": 1000.0,
        "perf/max_memory_allocated_gb": 2.0,
    }
    row.update(over)
    return row


def feed(monitor, rows):
    return [w for r in rows for w in monitor.update(r)]


def test_bands_parse_and_reject_unknown_names():
    b = bands.parse_bands("kl_max=0.05, target=0.9,val-falls=2")
    assert (b.kl_max, b.target, b.val_falls) == (0.05, 0.9, 2) and isinstance(b.val_falls, int)
    assert bands.parse_bands("").grad_norm_max == math.inf and math.isnan(bands.parse_bands("").target)
    with pytest.raises(ValueError, match="kl_maxx=1.*one of val_falls"):
        bands.parse_bands("kl_maxx=1")
    with pytest.raises(ValueError, match="'high' is not a number"):
        bands.parse_bands("kl_max=high")


def test_a_healthy_run_raises_no_warning():
    monitor = health.Monitor(bands.Bands(), total_steps=100)
    rows = [{"step": 0, VAL: 0.1}] + [step_row(s) for s in range(1, 101)]
    rows += [{"step": 100, VAL: 0.45}]  # validation reward rose; train reward 0.5: gap 10%
    assert feed(monitor, rows) == []


@pytest.mark.parametrize(
    "over, expected",
    [
        (dict(**{"actor/grad_norm": 1.5}), "actor/grad_norm 1.5 > 1.0 (--health-bands grad_norm_max)"),
        (dict(**{"actor/kl_loss": 0.05}), "actor/kl_loss 0.05 > 0.03"),
        (dict(**{"actor/entropy": 0.05}), "actor/entropy 0.05 < 0.1"),
        (dict(**{"frac_reward_zero_std": 1.0}), "every group's rewards are equal"),
        (dict(**{"timing_s/step": 3.5}), "timing_s/step 3.5 s is 3.5x its recent median"),
        (dict(**{"actor/grad_norm": float("nan")}), "actor/grad_norm is nan"),
    ],
)
def test_each_signal_warns_once_when_it_leaves_its_band(over, expected):
    # one signal at a time; the grad norm's level is judged only against a band the user sets
    monitor = health.Monitor(bands.parse_bands("entropy_drop=1,grad_norm_max=1"), total_steps=100)
    feed(monitor, [step_row(s) for s in range(1, 11)])
    # out of band for 5 steps: one warning, not five
    warnings = feed(monitor, [step_row(s, **over) for s in range(11, 16)])
    assert len(warnings) == 1 and warnings[0].startswith("step 11: ") and expected in warnings[0], warnings


def test_a_warning_repeats_only_after_the_signal_was_healthy_for_quiet_steps():
    monitor = health.Monitor(bands.parse_bands("quiet=5"), total_steps=100)
    bad = {"actor/kl_loss": 0.1}
    rows = [
        step_row(1, **bad),
        *[step_row(s) for s in range(2, 5)],
        step_row(5, **bad),
    ]  # back after 3 healthy steps: quiet
    rows += [*[step_row(s) for s in range(6, 12)], step_row(12, **bad)]  # back after 6 healthy steps: warns again
    assert [w.split(":")[0] for w in feed(monitor, rows)] == ["step 1", "step 12"]


def test_grad_norm_jump_is_relative_to_the_recent_median():
    monitor = health.Monitor(bands.parse_bands("grad_norm_max=100"), total_steps=100)
    rows = [step_row(s, **{"actor/grad_norm": 0.1}) for s in range(1, 21)] + [step_row(21, **{"actor/grad_norm": 0.8})]
    assert feed(monitor, rows) == ["step 21: actor/grad_norm 0.8 jumped 8x its recent median 0.1 (band: < 5.0x)"]


def test_a_grad_norm_after_a_run_of_zeros_is_not_an_infinite_jump(recwarn):
    monitor = health.Monitor(bands.parse_bands(""), total_steps=100)
    rows = [step_row(s, **{"actor/grad_norm": 0.0}) for s in range(1, 21)] + [step_row(21, **{"actor/grad_norm": 0.15})]
    assert feed(monitor, rows) == []  # was "jumped infx its recent median 0", with a division-by-zero warning
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_non_finite_metrics_warn_live_and_make_the_report_a_problem(tmp_path):
    from run_log import json_line

    rows = [{"step": 0, VAL: 0.1}] + [step_row(s) for s in range(1, 8)]
    rows += [step_row(s, **{"actor/entropy": math.nan, "actor/pg_loss": math.inf}) for s in range(8, 11)]
    warnings = feed(health.Monitor(bands.parse_bands(""), total_steps=10), rows)
    assert any("actor/entropy, actor/pg_loss not finite" in w for w in warnings), warnings
    run = tmp_path / "run"
    write_run(run, rows, max_steps=10)
    (run / "metrics.jsonl").write_text("".join(json_line(r) for r in rows))  # as the trainer writes them
    assert all(json.loads(line, parse_constant=lambda c: pytest.fail(c)) for line in open(run / "metrics.jsonl"))
    path, counts = report.write_report(str(run))
    found = verdicts(open(path).read())
    for check in (
        "entropy (actor/entropy)",
        "update size (largest one-step entropy drop)",
        "non-finite metrics (NaN, inf)",
        "policy loss (actor/pg_loss)",
    ):
        assert found[check] == "problem", (check, open(path).read())
    assert counts["overall"] == "problem"


def test_a_sudden_entropy_drop_points_at_the_learning_rate():
    monitor = health.Monitor(bands.Bands(), total_steps=100)
    rows = [
        step_row(1, **{"actor/entropy": 2.0}),
        step_row(2, **{"actor/entropy": 1.2}),
        step_row(3, **{"actor/entropy": 0.5}),
    ]
    assert feed(monitor, rows) == [
        "step 3: actor/entropy fell 58% in one step (1.2 -> 0.5): unless the reward rises with it, the learning rate is too high"
    ]


def test_high_entropy_warns_only_late_in_training():
    monitor = health.Monitor(bands.Bands(), total_steps=100)
    early = feed(monitor, [step_row(s, **{"actor/entropy": 2.0}) for s in range(1, 51)])
    late = feed(monitor, [step_row(51, **{"actor/entropy": 2.0})])
    assert early == [] and len(late) == 1 and "late in training (step 51 of 100)" in late[0]


def test_validation_falling_three_times_in_a_row_and_the_train_val_gap():
    monitor = health.Monitor(bands.Bands(), total_steps=100)
    rows = [step_row(s, **{"critic/score/mean": 0.9}) for s in range(1, 11)]
    rows += [{"step": 10, VAL: v} for v in (0.85, 0.8, 0.75)]  # falling, but only twice, and gap < 20%
    assert feed(monitor, rows) == []
    warnings = feed(monitor, [{"step": 10, VAL: 0.6}])  # the third fall; gap (0.9 - 0.6) / 0.9 = 33%
    assert len(warnings) == 2
    assert "fell 3 validations in a row: 0.85 > 0.8 > 0.75 > 0.6" in warnings[0]
    assert "train reward 0.9 is 33% above" in warnings[1] and "over-fitting" in warnings[1]


def test_the_gap_is_not_judged_while_train_reward_is_near_zero():
    monitor = health.Monitor(bands.Bands(), total_steps=100)
    rows = [step_row(s, **{"critic/score/mean": 0.02}) for s in range(1, 11)] + [{"step": 10, VAL: 0.0}]
    assert feed(monitor, rows) == []


def write_run(run_dir, rows, **config):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.json").write_text(
        json.dumps({**dict(max_steps=100, kl_coef=0.001, lr=1e-6, model="m"), **config})
    )
    (run_dir / "samples").mkdir(exist_ok=True)
    samples = [
        dict(step=100, prompt=f"q{i} | x", response=f"a{i}", ground_truth=str(i), score=float(i % 2)) for i in range(10)
    ]
    (run_dir / "samples" / "val_step_100.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def verdicts(report_text):
    """check name -> verdict, from the report's tables."""
    out = {}
    for line in report_text.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 4 and cells[2] in ("healthy", "**watch**", "**PROBLEM**", "n/a"):
            out[cells[0]] = cells[2].strip("*").lower()
    return out


def test_report_of_a_healthy_run(tmp_path):
    rows = [{"step": 0, VAL: 0.1}]
    for s in range(1, 101):
        rows.append(step_row(s, **{"critic/score/mean": 0.1 + 0.4 * s / 100, "actor/entropy": 0.9 - 0.4 * s / 100}))
        if s % 20 == 0:
            rows[-1][VAL] = 0.1 + 0.35 * s / 100
    write_run(tmp_path / "run", rows)
    path, counts = report.write_report(str(tmp_path / "run"))
    text = open(path).read()
    assert counts == dict(problem=0, watch=0, healthy=14, overall="healthy"), text
    for section in (
        "## Task effect",
        "## Convergence",
        "## Stability",
        "## Efficiency",
        "## Live warnings (0)",
        "## Best and worst samples",
        "## Plots",
    ):
        assert section in text
    assert f"| final `{VAL}` | 0.450 at step 100 (first 0.100, best 0.450 at step 100) | healthy |" in text
    assert "| q1 \\| x | a1 | 1 |" in text  # a sample, with its '|' escaped for the table
    assert "after 100 steps of 100; model `m`" in text
    for name in report.PLOTS:
        assert (tmp_path / "run" / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name[:-4]}]({name})" in text


def test_report_of_a_run_sized_by_epochs_says_so(tmp_path):
    write_run(tmp_path / "run", [{"step": 0, VAL: 0.1}, step_row(1), step_row(2)], max_steps=-1, epochs=2)
    path, _ = report.write_report(str(tmp_path / "run"))
    text = open(path).read()
    assert "after 2 steps (2 epochs planned); model `m`" in text  # not "of -1"
    # its only validation is the one before training: nothing to compare the train reward with
    assert "| train vs validation | no training step up to step 0 | n/a |" in text


def test_report_of_a_collapsing_run_names_its_problems(tmp_path):
    rows = [{"step": 0, VAL: 0.3}]
    for s in range(1, 101):
        late = s > 50
        rows.append(
            step_row(
                s,
                **{
                    "critic/score/mean": 0.6 if late else 0.4,
                    "actor/entropy": 0.01 if late else 0.8,
                    "actor/grad_norm": 30.0 if late else 0.5,
                    "actor/kl_loss": 0.2 if late else 0.001,
                    "frac_reward_zero_std": 1.0 if late else 0.3,
                    "timing_s/step": 4.0 if late else 1.0,
                },
            )
        )
        if s % 10 == 0:
            rows[-1][VAL] = 0.5 if s <= 50 else 0.5 - 0.05 * (s - 50) / 10
    rows[-1]["actor/skipped_updates"] = 1
    write_run(tmp_path / "run", rows)
    path, counts = report.write_report(str(tmp_path / "run"))
    got = verdicts(open(path).read())
    assert counts["overall"] == "problem"
    expected = {
        f"final `{VAL}`": "problem",
        "validation trend": "problem",
        "train vs validation": "problem",
        "entropy (actor/entropy)": "problem",
        "update size (largest one-step entropy drop)": "problem",
        "KL to the reference (actor/kl_loss)": "problem",
        "grad norm (actor/grad_norm)": "watch",  # its jump; its level is not judged (a healthy demo's grows 30x)
        "advantages": "problem",
        "skipped updates (non-finite or runaway)": "problem",
        "step time (timing_s/step)": "watch",  # slower is not failing
    }
    assert {k: got[k] for k in expected} == expected, got


def test_report_reads_a_run_killed_mid_write_and_names_a_corrupt_line(tmp_path, capsys):
    rows = [step_row(s) for s in range(1, 6)]
    write_run(tmp_path / "run", rows)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "actor/gr')  # the process died while writing
    report.write_report(str(tmp_path / "run"))
    assert "the last line is incomplete" in capsys.readouterr().out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join([lines[0], "not json", *lines[1:5]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        report.write_report(str(tmp_path / "run"))


def test_eval_report_command(tmp_path, capsys):
    write_run(
        tmp_path / "run", [step_row(s, **{"actor/kl_loss": 0.05}) for s in range(1, 11)], health_bands="kl_max=0.1"
    )
    evaluate.main(["report", str(tmp_path / "run")])  # the run's own bands: KL 0.05 is within 0.1
    out = capsys.readouterr().out
    assert "| KL to the reference (actor/kl_loss) | mean 0.05, max 0.05 | healthy | mean and max <= 0.1 |" in out
    evaluate.main(["report", str(tmp_path / "run"), "--bands", "kl_max=0.01"])
    assert "| mean and max <= 0.01 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no metrics.jsonl here"):
        evaluate.main(["report", str(tmp_path / "nothing")])


def test_a_resumed_runs_first_step_with_its_start_up_is_not_a_slow_step(tmp_path):
    """Each process's first step includes its start-up (the engine's warm-up): train_grpo marks it
    perf/first_step_after_start, and neither the live check nor the report judges its time."""
    rows = [{"step": 0, VAL: 0.1}]
    for s in range(1, 21):
        start = s in (1, 20)  # a new run, and the same run resumed for its last step
        rows.append(step_row(s, **({"timing_s/step": 6.0, health.FIRST_STEP: 1.0} if start else {})))
    rows[-1][VAL] = 0.45
    assert feed(health.Monitor(bands.Bands(), 20), rows) == []
    write_run(tmp_path / "run", rows)
    path, _ = report.write_report(str(tmp_path / "run"))
    assert verdicts(open(path).read())["step time (timing_s/step)"] == "healthy"
    for row in rows:  # unmarked, the same times are a spike and a slow end
        row.pop(health.FIRST_STEP, None)
    assert any("timing_s/step 6 s is 6.0x" in w for w in feed(health.Monitor(bands.Bands(), 20), rows))
    write_run(tmp_path / "unmarked", rows)
    path, _ = report.write_report(str(tmp_path / "unmarked"))
    assert verdicts(open(path).read())["step time (timing_s/step)"] == "watch"


def test_an_engine_gap_far_past_the_dtypes_rounding_is_a_problem_live_and_in_the_report(tmp_path):
    """training/rollout_logprob_diff_max 1.4 nats: the engine's log-probs are not the policy's, in fp32
    (normal: 1e-6). In bf16 its rounding alone reaches 0.6 (docs/precision.md); with --max-staleness the
    gap also holds the updates since the samples were drawn, so it is not judged."""
    gap = {"training/rollout_logprob_diff_max": 1.4, "training/rollout_probs_diff_mean": 0.014}
    fine = {"training/rollout_logprob_diff_max": 1e-6, "training/rollout_probs_diff_mean": 5e-9}
    fp32 = health.Monitor(bands.Bands(), total_steps=100, config={"dtype": "fp32"})
    assert feed(fp32, [step_row(s, **fine) for s in range(1, 4)]) == []
    warnings = feed(fp32, [step_row(4, **gap)])
    assert len(warnings) == 1 and "the engine's log-probs are not the policy's" in warnings[0]
    assert "1.4 nats" in warnings[0] and "<= 0.01" in warnings[0], warnings
    bf16 = {"training/rollout_logprob_diff_max": 0.6, "training/rollout_probs_diff_mean": 8.3e-3}
    assert feed(health.Monitor(bands.Bands(), 100, {"dtype": "bf16"}), [step_row(1, **bf16)]) == []
    assert feed(health.Monitor(bands.Bands(), 100, {"dtype": "fp32"}), [step_row(1, **bf16)]) != []
    assert feed(health.Monitor(bands.Bands(), 100, {"dtype": "fp32", "max_staleness": 1}), [step_row(1, **gap)]) == []

    rows = [{"step": 0, VAL: 0.1}] + [step_row(s, **(gap if s == 3 else fine)) for s in range(1, 6)]
    write_run(tmp_path / "run", rows)
    path, counts = report.write_report(str(tmp_path / "run"))
    text = open(path).read()
    assert verdicts(text)["engine-vs-trainer gap (training/rollout_*)"] == "problem", text
    assert "largest log-prob gap 1.4 nats" in text and "1 of 5 steps above" in text and "in fp32" in text
    assert "the engine's log-probs are not the policy's" in text  # the live warning, replayed


# SmolLM2-135M-Instruct with README's multiply flags (--lr 1e-5 --kl-coef 0, --grad-clip 1.0), 3 steps, recorded
# on a 2-core AMD EPYC: the grad norm was above the clip at every step while held-out reward rose 0.188 -> 0.312.
SMOL = "val-core/synthetic/multiply/reward/mean@1"
SMOLLM2_3_STEPS = [
    {"step": 0, SMOL: 0.1875},
    *[
        step_row(s, **{"actor/grad_norm": gn, "actor/entropy": ent, "critic/score/mean": score, "actor/kl_loss": 0.0,
                       "frac_reward_zero_std": zs, "critic/advantages/max": 2.47, "critic/advantages/min": lo})
        for s, gn, ent, score, zs, lo in [(1, 1.0377, 1.918, 0.1094, 0.5, -0.54), (2, 1.4744, 1.739, 0.2031, 0.125, -0.72),
                                          (3, 1.0034, 1.7027, 0.1719, 0.375, -0.94)]
    ],
]  # fmt: skip
SMOLLM2_3_STEPS[-1][SMOL] = 0.3125


def test_a_grad_norm_above_the_clip_is_not_a_problem(tmp_path):
    """With --grad-clip 1.0 a norm above 1 is the clip doing its job: ordinary for GRPO on a real model
    (SmolLM2: medians 1.0-1.9 in runs that learned; distillation: 5-8). The report used to say PROBLEM
    when the median passed 1.0, and the live warning told the user to lower an lr that was fine."""
    write_run(tmp_path / "smol", SMOLLM2_3_STEPS, max_steps=3, kl_coef=0.0, lr=1e-5, grad_clip=1.0)
    path, counts = report.write_report(str(tmp_path / "smol"))
    text = open(path).read()
    assert counts["problem"] == 0 and verdicts(text)["grad norm (actor/grad_norm)"] == "healthy", text
    assert "median 1.04, max 1.47; 3 of 3 steps clipped (above --grad-clip 1), 0 jumps" in text
    assert not [w for w in feed(health.Monitor(bands.Bands(), 3), SMOLLM2_3_STEPS) if "grad_norm" in w]
    # distillation toward a trained teacher (README's OPD runs: medians 4.95-6.93, held-out 0.22 -> 0.83)
    rows = [{"step": 0, VAL: 0.22}] + [step_row(s, **{"actor/grad_norm": 5.0 + (s % 3)}) for s in range(1, 19)]
    rows[-1][VAL] = 0.83
    write_run(tmp_path / "opd", rows, max_steps=18)
    path, counts = report.write_report(str(tmp_path / "opd"))
    assert verdicts(open(path).read())["grad norm (actor/grad_norm)"] == "healthy" and counts["problem"] == 0
    # a level the user knows for their model still gives a watch
    write_run(tmp_path / "opd", rows, max_steps=18, health_bands="grad_norm_max=4")
    path, _ = report.write_report(str(tmp_path / "opd"))
    assert verdicts(open(path).read())["grad norm (actor/grad_norm)"] == "watch"


def test_a_short_run_has_no_late_in_training(tmp_path):
    """In a 3-step run step 2 was "late in training", and SmolLM2's entropy of 1.74 (nats per token, 49k
    words) was "not sharpening" after 2 updates that raised the reward. A run shorter than
    late_min_steps (20) is not judged on what its second half should look like."""
    assert feed(health.Monitor(bands.Bands(), 3), SMOLLM2_3_STEPS) == []
    write_run(tmp_path / "smol", SMOLLM2_3_STEPS, max_steps=3, kl_coef=0.0, lr=1e-5)
    path, counts = report.write_report(str(tmp_path / "smol"))
    assert verdicts(open(path).read())["entropy (actor/entropy)"] == "healthy"
    assert counts == dict(problem=0, watch=0, healthy=13, overall="healthy"), open(path).read()
    # at 20 steps the second half is judged
    rows = [step_row(s, **{"actor/entropy": 1.7}) for s in range(1, 21)]
    assert feed(health.Monitor(bands.Bands(), 20), rows) == [
        "step 11: actor/entropy 1.7 > 1.0 late in training (step 11 of 20): the policy is not sharpening"
    ]


def test_readmes_calculator_run_learned_and_is_not_a_problem(tmp_path):
    """README's calculator command, its recorded metrics (docs/tools_smollm2): held-out 0.00 -> 1.00 by step 5.
    The entropy fell 77% at step 2 and 97% at step 5 as the policy found the answer, then every group was all
    right (every advantage 0 at 4 of 10 steps): the report said PROBLEM on both. In a run that learned they
    are a watch."""
    rows = [json.loads(line) for line in open(os.path.join(REPO, "docs", "tools_smollm2", "metrics.jsonl"))]
    write_run(tmp_path / "run", rows, max_steps=60, kl_coef=0.0, lr=2e-5, dtype="bf16")  # README's flags
    path, counts = report.write_report(str(tmp_path / "run"))
    got = verdicts(open(path).read())
    assert counts["problem"] == 0, open(path).read()
    assert got["update size (largest one-step entropy drop)"] == got["advantages"] == "watch"
    assert got["entropy (actor/entropy)"] == "watch"  # 1.08 -> 0.002: collapsed after the task was learned
    assert "collapsed after the task was learned (train reward 0.453 -> 0.992" in open(path).read()


def collapse_run(late_score, val_final, steps=200):
    """The demo's shape: the reward rises from 0, the entropy collapses below 0.1 halfway at `late_score`."""
    rows = [{"step": 0, VAL: 0.0}]
    for s in range(1, steps + 1):
        score = late_score * min(1.0, 2 * s / steps)
        entropy = 2.9 - 2.85 * min(1.0, 2 * s / steps)  # 0.05 from halfway
        rows.append(step_row(s, **{"critic/score/mean": score, "actor/entropy": entropy, "actor/grad_norm": 0.5,
                                   "frac_reward_zero_std": 1.0 if s > steps / 2 else 0.5}))  # fmt: skip
        if s % 20 == 0:
            rows[-1][VAL] = val_final * min(1.0, 2 * s / steps)
    return rows


def test_an_entropy_collapse_after_most_of_the_task_is_learned_is_a_watch(tmp_path):
    """README's demo on an AMD EPYC without avx512_bf16: held-out 0.892 at step 100 and 0.918 at step 200, its
    entropy collapsed below 0.1 first, and the report said PROBLEM ("collapsed before the task was learned":
    its train reward was under 0.9 x the best sample's). A run that learned most of its task and then stopped
    exploring is a watch; one that collapsed at a train reward under learned_reward (0.5) x the best sample's
    is a problem (the demo at lr 5e-3 collapsed into always answering 8 at 0.198)."""
    write_run(tmp_path / "epyc", collapse_run(late_score=0.86, val_final=0.918))
    path, counts = report.write_report(str(tmp_path / "epyc"))
    got = verdicts(open(path).read())
    assert counts["problem"] == 0 and got["entropy (actor/entropy)"] == got["advantages"] == "watch", got
    write_run(tmp_path / "stuck", collapse_run(late_score=0.198, val_final=0.2))
    path, counts = report.write_report(str(tmp_path / "stuck"))
    got = verdicts(open(path).read())
    assert got["entropy (actor/entropy)"] == got["advantages"] == "problem", got
    assert "collapsed before the task was learned" in open(path).read()


def test_a_slower_end_is_a_watch_not_a_problem(tmp_path):
    """Steps 4x slower at the end of a run that learned: on a shared machine that is often the other work (the
    distillation runs' steps took 27-292 s). The report said PROBLEM; PROBLEM is for a run that fails to learn."""
    rows = [{"step": 0, VAL: 0.1}] + [step_row(s, **{"timing_s/step": 4.0 if s > 90 else 1.0}) for s in range(1, 101)]
    rows[-1][VAL] = 0.45
    write_run(tmp_path / "run", rows)
    path, counts = report.write_report(str(tmp_path / "run"))
    assert verdicts(open(path).read())["step time (timing_s/step)"] == "watch" and counts["problem"] == 0


def planted(entropies, scores, vals, **over):
    """A planted failure's rows, its values as recorded from the demo (`train_grpo.py --rollout hf --max-steps N`
    plus the flag that breaks it); `vals`: step -> held-out reward."""
    rows = [{"step": 0, VAL: vals[0]}]
    for s, (entropy, score) in enumerate(zip(entropies, scores), 1):
        zero_std = 1.0 if score in (0.0, 1.0) else 0.9  # every group alike once the reward is constant
        rows.append(step_row(s, **{"actor/entropy": entropy, "critic/score/mean": score, "actor/kl_loss": 0.0,
                                   "critic/score/max": float(score > 0), "frac_reward_zero_std": zero_std, **over}))  # fmt: skip
        if s in vals:
            rows[-1][VAL] = vals[s]
    return rows


PLANTED = {
    # --lr 1e30: each update would make the weights non-finite, so it is skipped; the run stops after 3 steps
    "lr 1e30": (
        planted([2.903, 2.905, 2.906], [0.0039, 0.0, 0.0], {0: 0.0}, **{"actor/skipped_updates": 1}),
        ["skipped updates (non-finite or runaway)", f"final `{VAL}`"],
    ),
    # --reward-fn that returns 1.0 whatever the answer: every advantage is 0, nothing is learned
    "constant reward": (
        planted([2.9 + 0.008 * s for s in range(12)], [1.0] * 12, {0: 1.0, 4: 1.0, 8: 1.0, 12: 1.0}),
        ["advantages", f"final `{VAL}`"],
    ),
    # --lr 0.05 --entropy-coef 0: the policy collapses onto one wrong answer before it earns any reward
    "collapse before any reward": (
        planted([2.903, 2.626, 2.348, 0.411, 1.334, 0.662, 0.198, 0.065, 0.025, 0.011, 0.0055, 0.0031, 0.0019,
                 0.0012, 0.0008, 0.0005], [0.0039, 0.0176, 0.0293, 0.0137, 0.0117] + [0.0] * 11, {0: 0.0, 8: 0.0, 16: 0.0}),
        ["entropy (actor/entropy)", "update size (largest one-step entropy drop)", "advantages", f"final `{VAL}`"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_failures_are_still_problems(tmp_path, name):
    """The bands were loosened for runs that learn; a run that fails to learn is still PROBLEM, by the checks
    that name why."""
    rows, problems = PLANTED[name]
    write_run(tmp_path / "run", rows, max_steps=rows[-1]["step"], kl_coef=0.0, lr=5e-4)
    path, counts = report.write_report(str(tmp_path / "run"))
    got = verdicts(open(path).read())
    assert counts["overall"] == "problem" and {k: got[k] for k in problems} == dict.fromkeys(problems, "problem"), got


def test_a_short_runs_first_step_without_an_advantage_is_a_watch(tmp_path):
    """The demo for 3 steps from scratch: a random policy is right about once in 400 tries, so its first step
    often has every group's rewards equal (every advantage 0). One such step of 3 said PROBLEM; it is a watch.
    More than two such steps, over a quarter of the run, in a run that did not learn, is still a problem."""
    rows = [step_row(s, **{"critic/score/mean": 0.004 * (s > 1), "frac_reward_zero_std": 1.0 if s == 1 else 0.97})
            for s in (1, 2, 3)]  # fmt: skip
    write_run(tmp_path / "short", rows, max_steps=3)
    path, counts = report.write_report(str(tmp_path / "short"))
    assert verdicts(open(path).read())["advantages"] == "watch" and counts["problem"] == 0, open(path).read()
    rows = [step_row(s, **{"critic/score/mean": 0.0, "frac_reward_zero_std": 1.0}) for s in range(1, 5)]
    write_run(tmp_path / "stuck", rows, max_steps=4)
    path, counts = report.write_report(str(tmp_path / "stuck"))
    assert verdicts(open(path).read())["advantages"] == "problem"


def test_a_run_with_no_finite_step_still_gets_its_report(tmp_path):
    """A teacher with NaN weights made every step's advantages and grad norm NaN (each update skipped) in a
    2-step run: the report reads it, says so, and is a problem; it once crashed on the max of no finite norm."""
    from run_log import json_line

    nan = math.nan
    broken = {"actor/grad_norm": nan, "actor/pg_loss": nan, "critic/advantages/min": nan, "critic/advantages/max": nan}
    rows = [{"step": 0, VAL: 0.1}] + [step_row(s, **broken, **{"actor/skipped_updates": 1}) for s in (1, 2)]
    run = tmp_path / "run"
    write_run(run, rows, max_steps=2)
    (run / "metrics.jsonl").write_text("".join(json_line(r) for r in rows))
    path, counts = report.write_report(str(run))
    text = open(path).read()
    assert verdicts(text)["grad norm (actor/grad_norm)"] == "problem"
    assert "not finite at 2 of 2 steps" in text
    assert counts["overall"] == "problem"


def test_a_curriculum_tasks_validation_is_judged_at_its_last_level_only():
    """A harder level starts lower: the fall at a level rise is not a falling trend (curriculum.py)."""
    key = "val-core/reasoning_gym/chain_sum/reward/mean@1"
    train = [step_row(s, **{"curriculum/chain_sum/level": 0 if s <= 10 else 1}) for s in range(1, 21)]
    series = [(0, 0.1), (5, 0.5), (10, 0.8), (15, 0.3), (20, 0.5)]
    checks = {
        name: (value, verdict) for name, value, verdict, _ in report.validation(key, series, train, bands.Bands())
    }
    value, verdict = checks[f"final `{key}`"]
    assert (
        verdict == "healthy" and value == "0.500 at step 20 (first 0.300, best 0.500 at step 20, at curriculum level 1)"
    )
    assert checks["validation trend"] == ("0% below its best; longest run of falls: 0", "healthy")
    # no validation yet at the level the run ended on: judged at its last validation's level, and named so
    risen = train + [step_row(21, **{"curriculum/chain_sum/level": 2})]
    assert report.at_last_level(key, series[:3], risen) == (series[:3], ", at curriculum level 0")
    plain = {name: verdict for name, _, verdict, _ in report.validation(VAL, series, train, bands.Bands())}
    assert plain["validation trend"] == "problem"  # 0.5 is 38% below 0.8, with no level to explain it
