"""benchmarks/bench_vs_trl.py: its checks and statistics. The benchmark itself needs TRL
(benchmarks/requirements-bench.txt) and a quiet machine, so the suite does not run it."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_vs_trl as bench  # noqa: E402


def test_the_peer_is_pinned():
    pins = bench.pinned_peer()
    assert pins["trl"] == "1.16.0" and "torch" not in pins  # torch is ours: requirements-cpu.txt pins it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hidden", "100"], "--hidden must be a positive multiple of 64"),
        (["--group-size", "1"], "--group-size must be at least 2"),
        (["--steps", "5", "--warmup", "5"], "--steps (5) must be larger than --warmup (5)"),
        (["--trl-engines", "generate,sglang"], "unknown ['sglang']"),
        (["--sweep-n", "4,eight"], "expected comma-separated integers"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_statistics_of_kept_steps():
    run = {"records": [{"step": s, "step_s": float(s)} for s in range(1, 8)]}
    kept = [r["step_s"] for r in bench.kept(run, warmup=2)]
    assert kept == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert bench.stats(kept) == dict(median=5.0, p25=4.0, p75=6.0, min=3.0, max=7.0, count=5)
