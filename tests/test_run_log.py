"""run_log.py: a step's metrics under verl's names, early stopping from the history, and the run's
log (metrics.jsonl, TensorBoard, samples, the console), in-process in a world of one rank."""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bands  # noqa: E402
import health  # noqa: E402
import run_log  # noqa: E402
from run_log import RunLog  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """loss_metrics and RunLog's histograms use collectives: a gloo group of one process."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rollout_metrics_use_verl_names():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float)  # [N=4, R=4]
    scores, advantages = [1.0, 0.0, 1.0, 1.0], torch.tensor([0.7, -0.7, 0.0, 0.0])
    extras = dict(pred=["3", "4", "3", None], acc=[True, False, 1.0, None])
    m = run_log.rollout_metrics(
        scores, advantages, mask.sum(-1).tolist(), [5, 5, 7, 7], [False, False, True, False], extras, group_size=2
    )
    assert (
        m["critic/score/mean"] == 0.75
        and m["critic/score/min"] == 0.0
        and m["critic/advantages/max"] == pytest.approx(0.7)
    )
    assert (
        m["response_length/mean"] == 2.5 and m["response_length/max"] == 4 and m["response_length/clip_ratio"] == 0.25
    )
    assert m["prompt_length/mean"] == 6 and m["prompt_length/min"] == 5
    assert m["frac_reward_zero_std"] == 0.5  # the second group scored 1 and 1
    assert m["reward_extra/acc/mean"] == pytest.approx(2 / 3) and "reward_extra/pred/mean" not in m  # numbers only


def test_loss_metrics_take_every_term_the_loss_reports():
    """A loss that reports a new number gets it logged as actor/<name>, token-weighted."""
    stats = [dict(pg_loss=1.0, my_new_term=2.0, tokens=1), dict(pg_loss=4.0, my_new_term=5.0, tokens=3, grad_norm=0.5)]
    m = run_log.loss_metrics(stats, CPU)
    assert m == {"actor/pg_loss": (1.0 + 12.0) / 4, "actor/my_new_term": (2.0 + 15.0) / 4, "actor/grad_norm": 0.5}


def test_early_stopping_and_the_best_validation():
    metric = "val-core/x/reward/mean@1"
    history = [
        dict(step=0, **{metric: 0.2}),
        dict(step=1),
        dict(step=2, **{metric: 0.5}),
        dict(step=4, **{metric: 0.5}),
    ]
    assert not run_log.should_stop(history, metric, patience=2) and run_log.should_stop(history, metric, patience=1)
    assert not run_log.should_stop(history, "", patience=1)  # no metric: never
    assert run_log.is_best(history[:3], metric) and not run_log.is_best(history, metric)  # a tie is not better


def test_run_log_writes_jsonl_tensorboard_and_samples(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "samples").mkdir()
    monitor = health.Monitor(bands.parse_bands(""), total_steps=2)
    log = RunLog(str(tmp_path), dict(lr=0.1), ["console", "jsonl", "tensorboard"], monitor, rank=0)
    log.start(dict(lr=0.1), [], start_step=0, total_steps=2)
    log.log(0, {"val-core/x/reward/mean@1": 0.25})
    log.log(1, {"critic/score/mean": 0.5, "actor/pg_loss": 0.1}, histograms={"critic/score": [0.0, 1.0, 1.0]})
    log.samples(
        "val_step_2.jsonl",
        2,
        [dict(prompt="p", response="r | s", ground_truth="3", score=1.0)],
        mode="w",
        table="val/generations",
    )
    log.close()
    assert (
        [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        == log.history
        == [{"step": 0, "val-core/x/reward/mean@1": 0.25}, {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": 0.1}]
    )
    assert json.load(open(tmp_path / "config.json")) == dict(lr=0.1)
    assert json.loads(open(tmp_path / "samples" / "val_step_2.jsonl").read())["response"] == "r | s"
    assert "step 0: val-core/x/reward/mean@1=0.2500" in capsys.readouterr().out  # the console line, above the bar
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.5)]
    assert events.Histograms("critic/score")[0].histogram_value.num == 3
    assert "val/generations/text_summary" in events.Tags()["tensors"]


def test_a_resumed_log_rewrites_the_run_files_to_the_checkpoint(tmp_path):
    """metrics.jsonl and train samples after the checkpoint's step are redone, not kept twice."""
    (tmp_path / "samples").mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(dict(step=s)) + "\n" for s in range(5)))
    (tmp_path / "samples" / "train.jsonl").write_text("".join(json.dumps(dict(step=s)) + "\n" for s in range(1, 5)))
    log = RunLog(str(tmp_path), {}, ["jsonl"], health.Monitor(bands.parse_bands(""), 9), rank=0)
    log.start({}, [dict(step=s) for s in range(3)], start_step=2, total_steps=9)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples" / "train.jsonl")] == [1, 2]
    assert log.bar is None  # no console logger: no progress bar
