"""benchmarks/opd_smollm2.py: its --dry-run runs pure OPD, GRPO, both and OPSD on the tiny demo model for 2
steps each, through train_grpo.py, and reads their curves. The real comparison (SmolLM2) is run by hand."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import opd_smollm2  # noqa: E402


def test_the_report_times_each_run_to_the_target():
    curves = {"opd": [(0, 0.0, 0.2), (3, 30.0, 0.85)], "grpo": [(0, 0.0, 0.2), (3, 50.0, 0.5), (6, 100.0, 0.8)]}
    text = opd_smollm2.report(curves, 0.8)
    assert "opd: first at 0.8 after 30 s" in text and "grpo: first at 0.8 after 100 s" in text
    assert "OPD / GRPO time to 0.8: 0.30" in text
    assert "not defined" in opd_smollm2.report({"opd": [(0, 0.0, 0.1)], "grpo": curves["grpo"]}, 0.8)


def test_it_needs_its_three_directories(capsys):
    with pytest.raises(SystemExit):
        opd_smollm2.parse_args(["--teacher", "t"])
    assert "--teacher, --student and --data are required" in capsys.readouterr().err


def test_each_mode_runs_beside_the_reward_with_its_own_distill_loss(tmp_path):
    for d in ("t", "s", "d"):
        os.makedirs(tmp_path / d)
    args = opd_smollm2.parse_args(["--teacher", str(tmp_path / "t"), "--student", str(tmp_path / "s"),
                                   "--data", str(tmp_path / "d"), "--modes", "k3,forward_kl_topk"])  # fmt: skip
    made = opd_smollm2.runs(args, "T", "S", "D")
    assert list(made) == ["opd", "grpo", "both", "both_k3", "both_forward_kl_topk"]
    for mode in ("k3", "forward_kl_topk"):
        flags = made[f"both_{mode}"]
        assert flags[-4:] == ["--teacher", "T", "--distill-loss", mode] and "--no-reward" not in flags
    assert "--distill-loss" not in made["both"]  # k1, the default
    args.only = "grpo,both_k3"
    assert list(opd_smollm2.runs(args, "T", "S", "D")) == ["grpo", "both_k3"]


@pytest.mark.slow
def test_dry_run(tmp_path, capsys):
    curves = opd_smollm2.main(["--dry-run", "--out-dir", str(tmp_path)])
    assert sorted(curves) == ["both", "grpo", "opd", "opsd"]
    assert all([s for s, _, _ in points] == [0, 1, 2] for points in curves.values()), curves
    out = capsys.readouterr().out
    assert "OPD / GRPO time to 0.8" in out
    assert "wrote" in out or "matplotlib is not installed" in out
