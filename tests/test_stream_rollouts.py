"""stream_rollouts.py: --stream-rollouts, rollout ranks that start each group as soon as the staleness cap
allows and load new weights mid-answer. Which version makes which sample depends on timing, so these
tests check what must hold whatever the timing: every sample within --max-staleness, the weight check
at every version, validation, and a kill -9 resume that keeps the history and finishes. The engine's
side (samples as generate's, tokens after a load drawn by the new weights) is in test_rollout.py."""

import json

import pytest
from test_checkpoint import train


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def assert_streamed(rows, cap, steps, test_freq=2):
    assert [r["step"] for r in rows] == list(range(steps + 1))
    trained = rows[1:]
    assert all(0 <= r["rollout/staleness/mean"] <= r["rollout/staleness/max"] <= cap for r in trained)
    assert all(0 <= r.get("rollout/interrupted", 0) <= 1 for r in trained)  # none: a rollout from a checkpoint
    assert sum("rollout/interrupted" in r for r in trained) >= steps - 1
    assert all(r.get("rollout/weight_sync_gap", 0) < 1e-3 for r in trained)  # every version checked (fp32)
    assert all("val-core/synthetic/digits/reward/mean@1" in r for r in rows if r["step"] % test_freq == 0)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 2])
def test_a_streamed_run_trains_every_sample_within_the_staleness_cap(tmp_path, cap):
    """Validation at every version: the engine must first finish the groups it runs (often some)."""
    flags = ["--rollout-ranks", "1", "--max-staleness", str(cap), "--stream-rollouts", "--max-steps", "6"]
    train(tmp_path, *flags, "--test-freq", "1", ranks=2, engine="vllm")
    logged = rows(tmp_path)
    assert_streamed(logged, cap, 6, test_freq=1)
    assert (tmp_path / "final_model" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_killed_streamed_run_resumes_keeping_its_history(tmp_path):
    """kill -9 during step 3's update: the checkpoint of step 2 holds step 3's rollout (made ahead); the
    rerun trains on it, the rollout rank makes the groups lost in flight again, and the run finishes
    with steps 1 and 2 as they were logged."""
    flags = ["--rollout-ranks", "1", "--max-staleness", "1", "--stream-rollouts"]
    train(tmp_path, *flags, ranks=2, engine="vllm", crash_at="update:3")
    before = rows(tmp_path)
    assert [r["step"] for r in before] == [0, 1, 2]
    state = json.load(open(tmp_path / "global_step_2" / "trainer_state.json"))
    assert list(state["rollouts_ahead"]) == ["3"]
    train(tmp_path, *flags, ranks=2, engine="vllm")
    after = rows(tmp_path)
    assert_streamed(after, 1, 4)
    assert after[:3] == before
