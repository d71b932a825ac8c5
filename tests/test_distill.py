"""distill.py: on-policy distillation. The teacher's term by hand; a teacher equal to the student gives exactly 0;
a teacher with another tokenizer, or that is no model, is refused before anything loads; OPSD's teacher reads its
own prompt then the student's response ids exactly; and real runs of the tiny model: 1 and 2 ranks alike, a kill -9
resumed exactly, LoRA with its base as the teacher, pure distillation on rows without a ground truth."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

import bands
import data_prep
import distill
import health
from config import Args
from models import build_tiny_model
from policy import make_batch
from tasks.digits import TASK_WORDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = (
    "--max-steps 4 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16".split()
)
RUN += ["--rollout", "hf", "--save-freq", "1"]
COMPARED = (
    "critic/score/mean actor/pg_loss actor/grad_norm actor/entropy distill/reverse_kl/mean distill/adv_share".split()
)


@pytest.fixture
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_teachers_term_by_hand(one_rank):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [N=2, R=3]: 3 model tokens
    student = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    teacher = torch.tensor([[-0.5, -3.0, -1.0], [-0.5, -1.0, -1.0]])
    # beta (t - s) m: 0.5 * [[0.5, -1, (masked)], [0, (masked), (masked)]]
    expected = torch.tensor([[0.25, -0.5, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(distill.teacher_advantages(teacher, student, mask, 0.5), expected)
    reward = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])  # a group-normalised advantage, broadcast
    batch = dict(response_mask=mask, advantages=reward.clone())
    metrics = distill.add_teacher_term(batch, teacher, student, coef=0.5, reward=True, device=torch.device("cpu"))
    assert torch.equal(batch["advantages"], reward + expected)
    # reverse KL per model token, s - t: -0.5, 1, 0
    assert metrics["distill/reverse_kl/mean"] == pytest.approx(0.5 / 3)
    assert metrics["distill/reverse_kl/max"] == 1.0
    assert metrics["distill/teacher_logp/mean"] == pytest.approx(-4.0 / 3)
    assert metrics["distill/adv_share"] == pytest.approx(0.75 / (0.75 + 3.0))  # sums of |.| over model tokens
    batch = dict(response_mask=mask, advantages=reward.clone())  # --no-reward: the teacher's term alone
    metrics = distill.add_teacher_term(batch, teacher, student, coef=0.5, reward=False, device=torch.device("cpu"))
    assert torch.equal(batch["advantages"], expected) and metrics["distill/adv_share"] == 1.0


def test_a_teacher_equal_to_the_student_adds_exactly_zero(one_rank):
    logp = torch.randn(4, 5)
    batch = dict(response_mask=torch.ones(4, 5), advantages=torch.zeros(4, 5))
    metrics = distill.add_teacher_term(batch, logp.clone(), logp, coef=1.0, reward=True, device=torch.device("cpu"))
    assert torch.equal(batch["advantages"], torch.zeros(4, 5))
    assert metrics["distill/reverse_kl/mean"] == metrics["distill/reverse_kl/max"] == 0.0


def test_opsds_teacher_reads_its_prompt_then_the_students_response_ids_exactly():
    prompts, responses = [[5, 6, 7]] * 2 + [[8]] * 2, [[1, 2], [3], [4, 4, 4], []]
    batch = make_batch(prompts, responses, pad_id=99, group=2, model_mask=[[1, 0], [1], [1, 1, 1], []])
    teacher = [[10, 11, 12, 13, 14]] * 2 + [[15, 16]] * 2  # e.g. the question with its worked solution
    scored = distill.teacher_batch(batch, teacher)
    for i in range(4):
        ids = scored["input_ids"][i][scored["attention_mask"][i].bool()].tolist()
        assert ids == teacher[i] + (responses[i] or [99]), i  # an empty response keeps its one padded column
    assert scored["responses"].shape == batch["responses"].shape and scored["group"] == 2


def test_teacher_prompts_are_rendered_from_a_column_or_extra_info_and_a_missing_one_is_named(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "m"), TASK_WORDS))
    rows = [{"solution": "list 1 first"}, {"extra_info": {"solution": [{"role": "user", "content": "list 2"}]}}]
    args = Args(teacher="t", teacher_prompt_key="solution", train_data="train.parquet")
    distill.teacher_prompts(args, tokenizer, rows)
    chat = [{"role": "user", "content": "list 1 first"}]
    assert rows[0]["teacher_prompt_ids"] == tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=False
    )
    with pytest.raises(SystemExit, match="train.parquet: row 1 has no teacher prompt 'solution'"):
        distill.teacher_prompts(args, tokenizer, [rows[0], {"prompt": []}])


def test_a_vocabulary_difference_is_named(tmp_path):
    a = build_tiny_model(str(tmp_path / "a"), TASK_WORDS)
    b = build_tiny_model(str(tmp_path / "b"), [*TASK_WORDS[:-1], "middle"])
    assert distill.vocabulary_difference(a, a) is None
    problem = distill.vocabulary_difference(a, b)
    assert "is 'last' in --model's tokenizer and 'middle' in the teacher's" in problem, problem


def test_the_reverse_kl_band_warns_when_it_rises_or_does_not_fall():
    b = bands.Bands()
    assert list(health.distill_warnings(b, [1.0 - 0.04 * s for s in range(20)], late=True)) == []  # falling
    rising = list(health.distill_warnings(b, [1.0] * 10 + [2.0] * 5, late=False))
    assert rising[0][0] == "distill_kl_rise" and "is 2.0x its lowest 1" in rising[0][1]
    assert list(health.distill_warnings(b, [1.0] * 20, late=False)) == []  # flat, but not late yet
    flat = list(health.distill_warnings(b, [1.0] * 20, late=True))
    assert flat[0][0] == "distill_kl_flat" and "is not 10% below" in flat[0][1]


def test_pure_distillation_rows_need_no_ground_truth(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "mine", "prompt": [{"role": "user", "content": "hi"}]}]), path)
    with pytest.raises(data_prep.DataError, match="missing column"):
        data_prep.load_dataset(str(path))
    rows = data_prep.load_dataset(str(path), need_truth=False)
    assert rows[0]["reward_model"]["ground_truth"] is None
    assert (
        distill.labelled_reward("mine", "x", None) == 0.0
        and distill.labelled_reward("synthetic/digits", "7", "7") == 1.0
    )


# ----------------------------------------------------------------------------------------------
# Real runs of the tiny model under torchrun


def train(out_dir, *flags, ranks=1, crash_at=None, check=True):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_CRASH_AT"}
    if crash_at:
        env["GRPO_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train_grpo.py"]
    proc = subprocess.run(
        [*cmd, "--out-dir", str(out_dir), *flags], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
    )
    if crash_at:
        assert proc.returncode != 0, "the run was meant to die"
    elif check and proc.returncode != 0:
        raise AssertionError(f"train_grpo.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def metrics(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Another random tiny model with the demo's tokenizer (seed 1; the demo's student is seed 0)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("teacher") / "teacher"), TASK_WORDS, seed=1)


def test_a_teacher_that_is_not_a_model_or_has_another_tokenizer_is_refused_before_anything_loads(tmp_path):
    proc = train(tmp_path / "a", *RUN, "--teacher", str(tmp_path / "nowhere"), check=False)
    assert (
        proc.returncode != 0 and f"--teacher: model path '{tmp_path / 'nowhere'}': no such directory" in proc.stderr
    ), proc.stderr[-2000:]
    other = build_tiny_model(str(tmp_path / "other"), [*TASK_WORDS[:-1], "middle"])
    proc = train(tmp_path / "b", *RUN, "--teacher", other, check=False)
    assert proc.returncode != 0 and "is 'last' in --model's tokenizer and 'middle' in the teacher's" in proc.stderr
    assert "rollout engine" not in proc.stdout  # refused before the engine (and the policy) loaded


@pytest.fixture(scope="module")
def whole(tmp_path_factory, teacher):
    """4 steps of OPD beside the reward, 1 rank and 2 ranks."""
    root = tmp_path_factory.mktemp("opd")
    train(root / "ranks1", *RUN, "--teacher", teacher)
    train(root / "ranks2", *RUN, "--teacher", teacher, ranks=2)
    return root


@pytest.mark.slow
def test_one_and_two_ranks_draw_the_same_samples_and_make_the_same_updates(whole):
    one, two = metrics(whole / "ranks1"), metrics(whole / "ranks2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 4]
    for a, b in zip(one[1:], two[1:]):
        assert a["distill/reverse_kl/mean"] > 0 and a["distill/adv_share"] > 0 and "timing_s/teacher" in a
        for key in [*COMPARED, "distill/reverse_kl/max", "distill/teacher_logp/mean", "response_length/mean"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    samples = [[json.loads(line) for line in open(whole / r / "samples" / "train.jsonl")] for r in ("ranks1", "ranks2")]
    assert samples[0] == samples[1]


@pytest.mark.slow
def test_a_killed_opd_run_resumes_exactly(whole, teacher, tmp_path):
    train(tmp_path, *RUN, "--teacher", teacher, crash_at="update:3")
    proc = train(tmp_path, *RUN, "--teacher", teacher)
    assert "resumed from" in proc.stdout
    for a, b in zip(metrics(whole / "ranks1"), metrics(tmp_path)):
        for key in COMPARED:
            assert a.get(key) == b.get(key), (a["step"], key)
    from safetensors.torch import load_file

    wa, wb = (load_file(os.path.join(r, "final_model", "model.safetensors")) for r in (whole / "ranks1", tmp_path))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_the_student_as_its_own_teacher_adds_exactly_zero_and_pure_distillation_needs_no_ground_truth(tmp_path):
    """The teacher is --model's own directory, a second frozen copy (no --kl-coef): at step 1 its log-probs are
    the student's exactly. --no-reward on rows without a reward_model: every advantage is then 0."""
    data = tmp_path / "data"
    data_prep.main(["digits", "--out", str(data), "--train-size", "64", "--test-size", "16"])
    rows = pq.read_table(data / "train.parquet").drop(["reward_model"])
    pq.write_table(rows, data / "unlabelled.parquet")
    flags = [
        *RUN,
        "--max-steps",
        "1",
        "--train-data",
        str(data / "unlabelled.parquet"),
        "--val-data",
        str(data / "test.parquet"),
    ]
    train(tmp_path / "run", *flags, "--no-reward", "--teacher", str(tmp_path / "run" / "tiny_model"))
    step1 = metrics(tmp_path / "run")[1]
    assert step1["distill/reverse_kl/mean"] == step1["distill/reverse_kl/max"] == 0.0
    assert step1["critic/advantages/max"] == step1["critic/advantages/min"] == 0.0 and step1["critic/score/mean"] == 0


@pytest.mark.slow
def test_lora_with_its_base_as_the_teacher_and_opsd_with_a_teacher_prompt(tmp_path):
    """LoRA: the teacher is --model's directory, scored as the base with the adapters off (no copy), beside the
    reference KL. OPSD: the same base reads a teacher prompt (here the row's prompt with the answer) first."""
    data = tmp_path / "data"
    data_prep.main(["digits", "--out", str(data), "--train-size", "64", "--test-size", "16"])
    table = pq.read_table(data / "train.parquet").to_pylist()
    for row in table:
        row["hint"] = f"{row['prompt'][-1]['content']} {row['reward_model']['ground_truth']}"
    pq.write_table(pa.Table.from_pylist(table), data / "train_hint.parquet")
    flags = [*RUN, "--max-steps", "2", "--lora-rank", "8", "--lr", "5e-3", "--kl-coef", "0.05"]
    flags += ["--train-data", str(data / "train_hint.parquet"), "--val-data", str(data / "test.parquet")]
    train(tmp_path / "lora", *flags, "--teacher", str(tmp_path / "lora" / "tiny_model"))
    rows = metrics(tmp_path / "lora")
    assert rows[1]["distill/reverse_kl/mean"] == 0.0  # the adapters start at 0: the student is its base
    assert rows[2]["distill/reverse_kl/mean"] != 0.0 and rows[2]["actor/kl_loss"] > 0
    train(tmp_path / "opsd", *flags, "--teacher", str(tmp_path / "opsd" / "tiny_model"), "--teacher-prompt-key", "hint")
    assert all(r["distill/reverse_kl/mean"] != 0.0 for r in metrics(tmp_path / "opsd")[1:])


@pytest.mark.slow
def test_the_teacher_lives_with_the_trainers_one_step_off_policy_and_beside_a_rollout_rank(teacher, tmp_path):
    """--max-staleness 1: the colocated run and a trainer beside a rollout rank (2 ranks, --rollout-ranks 1)
    train on the same samples, so the teacher, on the trainer, scores the same tokens and the updates agree."""
    flags = [*RUN, "--max-steps", "3", "--max-staleness", "1", "--teacher", teacher]
    train(tmp_path / "colocated", *flags)
    train(tmp_path / "rollout_rank", *flags, "--rollout-ranks", "1", ranks=2)
    one, two = metrics(tmp_path / "colocated"), metrics(tmp_path / "rollout_rank")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3]
    for a, b in zip(one[1:], two[1:]):
        assert a["distill/reverse_kl/mean"] > 0
        for key in [*COMPARED, "distill/teacher_logp/mean"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
