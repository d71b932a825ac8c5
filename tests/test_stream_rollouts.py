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
    assert sum("rollout/interrupted" in r for r in trained) >= steps - 2  # less those from the checkpoint
    assert all(r.get("rollout/weight_sync_gap", 0) < 1e-3 for r in trained)  # every version checked (fp32)
    assert all("val-core/synthetic/digits/reward/mean@1" in r for r in rows if r["step"] % test_freq == 0)


@pytest.mark.slow
def test_a_killed_streamed_run_resumes_keeping_its_history_and_the_cap(tmp_path):
    """S = 2, validation at every version (the engine must first finish the groups it runs, often some),
    kill -9 during step 3's update: the checkpoint of step 2 holds steps 3 and 4's rollouts (made ahead);
    the rerun trains on them, the rollout rank makes steps 5 and 6 (their groups in flight at the kill
    lost), and the run finishes with steps 1 and 2 as they were logged, every sample within the cap."""
    flags = [
        "--rollout-ranks",
        "1",
        "--max-staleness",
        "2",
        "--stream-rollouts",
        "--test-freq",
        "1",
        "--max-steps",
        "6",
    ]
    train(tmp_path, *flags, ranks=2, engine="vllm", crash_at="update:3")
    before = rows(tmp_path)
    assert [r["step"] for r in before] == [0, 1, 2]
    state = json.load(open(tmp_path / "global_step_2" / "trainer_state.json"))
    assert list(state["rollouts_ahead"]) == ["3", "4"]
    train(tmp_path, *flags, ranks=2, engine="vllm")
    after = rows(tmp_path)
    assert_streamed(after, 2, 6, test_freq=1)
    assert after[:3] == before
    assert (tmp_path / "final_model" / "model.safetensors").exists()
