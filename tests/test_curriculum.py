"""curriculum.py: reasoning-gym tasks go up a level when their held-out accuracy reaches the threshold, their rows
replaced in place; a run killed with SIGKILL resumes to the same levels and the same prompts; 2 ranks agree."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from data_prep import load_dataset, render_chats
from tasks.reasoning_gym import write_reasoning_gym

pytest.importorskip("reasoning_gym")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Words:
    """A stand-in tokenizer: one id per word of the rendered messages."""

    def apply_chat_template(self, chats, **kw):
        return [[len(w) for m in chat for w in m["content"].split()] for chat in chats]


def rows_at_level_0(tmp_path):
    write_reasoning_gym(str(tmp_path), ["chain_sum", "gcd"], 12, 4, prompt="none", level=0)
    rows = [load_dataset(str(tmp_path / f"{split}.parquet")) for split in ("train", "test")]
    for split in rows:
        render_chats(split, Words())
    return rows


def args(threshold=0.5, curriculum=True):
    return SimpleNamespace(
        curriculum=curriculum, curriculum_threshold=threshold, val_n=1, seed=0, max_prompt_length=512, train_data="x"
    )


def test_a_task_at_the_threshold_goes_up_a_level_and_its_rows_are_replaced_in_place(tmp_path):
    from curriculum import Curriculum

    train, val = rows_at_level_0(tmp_path)
    before = [r["extra_info"]["question"] for r in train]
    levels = Curriculum(args(0.5), train, val, Words())
    assert levels.step(1, {"val-core/reasoning_gym/chain_sum/reward/mean@1": 0.49}) == {
        "curriculum/chain_sum/level": 0, "curriculum/gcd/level": 0}  # fmt: skip
    assert [r["extra_info"]["question"] for r in train] == before
    metrics = {"val-core/reasoning_gym/chain_sum/reward/mean@1": 0.5, "val-core/reasoning_gym/gcd/reward/mean@1": 0.1}
    assert levels.step(2, metrics) == {"curriculum/chain_sum/level": 0, "curriculum/gcd/level": 0}  # this step's
    assert levels.step(3, {})["curriculum/chain_sum/level"] == 1  # the next step trains on level 1
    for rows, count in ((train, 6), (val, 4)):
        chain = [r for r in rows if r["data_source"] == "reasoning_gym/chain_sum"]
        assert len(chain) == count and {r["extra_info"]["level"] for r in chain} == {1}
        assert all(r["prompt_ids"] for r in chain)  # rendered
        assert {r["extra_info"]["level"] for r in rows if r["data_source"] == "reasoning_gym/gcd"} == {0}
    assert [r["extra_info"]["question"] for r in train] != before
    # a resume from the logged metrics of steps 1-3 makes the same rows
    history = [{"step": 1, "curriculum/chain_sum/level": 0}, {"step": 2, "curriculum/chain_sum/level": 0, **metrics},
               {"step": 3, "curriculum/chain_sum/level": 1, "curriculum/gcd/level": 0}]  # fmt: skip
    train2, val2 = rows_at_level_0(tmp_path / "again")
    Curriculum(args(0.5), train2, val2, Words(), history)
    assert (train2, val2) == (train, val)


def test_it_is_off_without_the_flag_and_refuses_data_without_a_level(tmp_path):
    from curriculum import Curriculum

    train, val = rows_at_level_0(tmp_path)
    assert Curriculum(args(curriculum=False), train, val, Words()).step(1, {"val-core/x": 1.0}) == {}
    write_reasoning_gym(str(tmp_path / "plain"), ["chain_sum"], 4, 2)
    plain = load_dataset(str(tmp_path / "plain" / "train.parquet"))
    with pytest.raises(SystemExit, match="row 0 .*no curriculum level.*--level 0"):
        Curriculum(args(), plain, [], Words())


# ----------------------------------------------------------------------------------------------
# the real trainer: the tiny model at threshold 0, so every validation raises every task a level

RUN = (
    "--max-steps 4 --epochs 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 1 --save-freq 1 "
    "--max-response-length 4 --rollout hf --curriculum --curriculum-threshold 0"
).split()


def train(out_dir, data, ranks=1, crash_at=None):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_CRASH_AT"} | (
        {"GRPO_CRASH_AT": crash_at} if crash_at else {}
    )
    flags = [
        "--out-dir",
        str(out_dir),
        "--train-data",
        str(data / "train.parquet"),
        "--val-data",
        str(data / "test.parquet"),
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train_grpo.py"]
    proc = subprocess.run([*cmd, *flags, *RUN], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert (proc.returncode != 0) == bool(crash_at), proc.stderr[-4000:]
    return proc


def record(run_dir):
    """Per step: the levels, the prompts' mean length, and the first prompt the step trained on."""
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    samples = [json.loads(line) for line in open(run_dir / "samples" / "train.jsonl")]
    keys = ("curriculum/chain_sum/level", "curriculum/gcd/level", "prompt_length/mean")
    return [tuple(m.get(k) for k in keys) for m in metrics], [(s["step"], s["prompt"]) for s in samples]


@pytest.fixture(scope="module")
def level0_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    write_reasoning_gym(str(root / "data"), ["chain_sum", "gcd"], 16, 4, prompt="none", level=0)
    return root


@pytest.mark.slow
def test_levels_rise_and_a_killed_run_resumes_to_the_same_prompts_on_1_and_2_ranks(level0_data):
    data = level0_data / "data"
    train(level0_data / "whole", data)
    levels, prompts = record(level0_data / "whole")
    assert [lv[:2] for lv in levels[1:]] == [(0, 0), (1, 1), (2, 2), (3, 3)]  # steps 1-4
    assert len({p for _, p in prompts}) > 1
    train(level0_data / "killed", data, crash_at="rollout:3")  # SIGKILL in step 3, after step 2's checkpoint
    proc = train(level0_data / "killed", data)
    assert "at step 2" in proc.stdout
    assert record(level0_data / "killed") == (levels, prompts)
    train(level0_data / "two", data, ranks=2)
    assert record(level0_data / "two")[0] == levels  # the same levels and prompt lengths on 2 ranks
    train(level0_data / "two_killed", data, ranks=2, crash_at="rollout:3")
    train(level0_data / "two_killed", data, ranks=2)
    assert record(level0_data / "two_killed") == record(level0_data / "two")
