"""distill.py: on-policy distillation. The teacher's term by hand; a teacher equal to the student gives exactly 0;
a teacher with another tokenizer, or that is no model, is refused before anything loads; OPSD's teacher reads its
own prompt then the student's response ids exactly; the memory check counts the teacher; and real runs of the tiny
model: 1 and 2 ranks alike, a kill -9 and a SIGTERM resumed exactly, LoRA with its base as the teacher, pure
distillation on rows without a ground truth, a bf16 teacher held in bf16; on the real Qwen2.5 tokenizer, --tools
(the teacher's term on the model's tokens only) and which teachers it accepts."""

import dataclasses
import json
import math
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
import memory
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


def test_a_teacher_with_non_finite_log_probs_is_named(one_rank):
    """A teacher whose weights hold NaN gives NaN log-probs; the run stops naming --teacher, not the student's --lr."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    distill.check_teacher_logp(torch.tensor([[-1.0, -2.0, float("nan")]]), mask, Args(teacher="t"), "cpu")  # padding
    with pytest.raises(SystemExit, match=r"--teacher runs/x/final_model: 1 of the student's tokens got a non-finite"):
        distill.check_teacher_logp(
            torch.tensor([[-1.0, float("nan"), -1.0]]), mask, Args(teacher="runs/x/final_model"), "cpu"
        )


@pytest.mark.parametrize("fused", [True, False])
def test_the_teachers_top_k_pass_equals_the_full_softmax(tmp_path, fused, monkeypatch):
    """forward_kl_topk's teacher pass on a real (tiny) model, micro-batch by micro-batch with shared prompts: the
    sampled tokens' log-probs and the top k's, at the same ids, as log_softmax of the model's whole logits; through
    the fused head's blocks, and through the logits for a head that is not a plain linear layer."""
    import policy

    torch.manual_seed(0)
    model = policy.load_model(build_tiny_model(str(tmp_path / "m"), TASK_WORDS, hidden=64), torch.float32, "cpu")
    V = model.config.vocab_size
    prompts, responses = [[1, 5, 6]] * 2 + [[1, 7]] * 2, [[8, 9, 4], [10], [11, 12], [5, 5, 5]]
    batch = make_batch(prompts, responses, pad_id=0, group=2)
    monkeypatch.setattr(policy, "FUSED_HEAD_MIN_VOCAB", 0)  # the tiny model's 20-row head fuses too
    if not fused:
        monkeypatch.setattr(distill, "fusable_head", lambda model: None)
    assert (distill.fusable_head(model) is not None) == fused
    how = dict(micro=2, max_tokens=0, temperature=0.9, device="cpu")
    logp, top_logp, top_ids = distill.teacher_topk(model, model, batch, k=5, vocab=V, **how)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    P = batch["prompt_width"]
    full = torch.log_softmax(logits[:, P - 1 : -1].double() / 0.9, -1)  # [N, R, V]
    on = batch["response_mask"].bool()
    want = full.topk(5, -1)
    torch.testing.assert_close(
        logp[on].double(), full.gather(-1, batch["responses"][..., None])[..., 0][on], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(top_logp[on].double(), want.values[on], atol=1e-5, rtol=0)
    assert torch.equal(top_ids[on], want.indices[on])
    with pytest.raises(SystemExit, match="--distill-topk 99: more than the student's"):
        distill.teacher_topk(model, model, batch, k=99, vocab=V, **how)


def test_the_default_top_k_is_the_vocabulary_of_a_smaller_student_and_a_larger_one_given_is_refused(tmp_path, capsys):
    # --distill-loss forward_kl_topk on the demo (20 words) refused "--distill-topk 32", which nobody had passed
    model = build_tiny_model(str(tmp_path / "m"), TASK_WORDS)
    args = Args(model=model, teacher=model, distill_loss="forward_kl_topk")
    distill.check_teacher(args)  # before anything loads
    said = "--distill-topk: the student has 20 vocabulary entries, fewer than the default 32: each position compares all 20"
    assert capsys.readouterr().out == said + "\n"
    assert distill.distill_topk(args, 20) == 20 and distill.distill_topk(args, 151_936) == 32 == Args.distill_topk
    args.distill_topk = 25
    assert distill.distill_topk(args, 20) == 25  # the user's value, as given
    with pytest.raises(SystemExit, match=r"^--distill-topk 25: more than the student's 20 vocabulary entries \("):
        distill.check_teacher(args)


def test_a_teacher_whose_weights_changed_is_refused_on_resume_unless_allowed(tmp_path, capsys):
    """The teacher is never checkpointed, only its fingerprint: other weights at the same --teacher path would make
    the resumed run learn from another teacher. Refused, or accepted with --allow-changed teacher and said."""
    import checkpoint
    import lora
    import policy

    model = build_tiny_model(str(tmp_path / "t"), TASK_WORDS, hidden=64)
    teacher = policy.load_model(model, torch.float32, "cpu").requires_grad_(False)
    args = Args(teacher=model)
    saved = distill.teacher_fingerprint(args, teacher)
    assert (
        saved == lora.base_fingerprint(teacher) and distill.teacher_fingerprint(Args(teacher="self"), teacher) is None
    )
    checkpoint.check_teacher(saved, saved, "ckpt", args)  # the same teacher
    checkpoint.check_teacher(None, saved, "ckpt", args)  # a checkpoint from before fingerprints
    with torch.no_grad():
        teacher.lm_head.weight[0, 0] += 0.5  # the directory's files replaced between runs
    changed = distill.teacher_fingerprint(args, teacher)
    with pytest.raises(SystemExit, match="its weights are not those ckpt was trained with .* would mix two teachers"):
        checkpoint.check_teacher(saved, changed, "ckpt", args)
    checkpoint.check_teacher(saved, changed, "ckpt", Args(teacher=model, allow_changed="teacher"))
    assert "going on with this teacher (--allow-changed teacher)" in capsys.readouterr().out


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


def test_teacher_prompts_longer_than_the_teachers_positions_are_dropped_and_counted(tmp_path, capsys):
    """A teacher prompt is bounded by the teacher's context (512 positions for the tiny model) less the longest
    response: longer ones are dropped with a count that says why; too few left to fill a step is refused."""
    teacher = build_tiny_model(str(tmp_path / "m"), TASK_WORDS)  # max_position_embeddings 512
    rows = [{"teacher_prompt_ids": [1] * n} for n in (10, 400, 500, 20)]
    args = Args(teacher=teacher, teacher_prompt_key="hint", max_response_length=100, prompt_batch_size=2)
    kept = distill.fitting_teacher_prompts(args, rows)
    assert [len(r["teacher_prompt_ids"]) for r in kept] == [10, 400, 20]
    out = capsys.readouterr().out
    assert "dropped 1 of 4 rows whose teacher prompt ('hint') is longer than 412 tokens" in out
    assert "the teacher's 512 positions (max_position_embeddings" in out and "--max-response-length 100" in out
    with pytest.raises(SystemExit, match="2 rows with a teacher prompt .* fewer than --prompt-batch-size 3"):
        distill.fitting_teacher_prompts(dataclasses.replace(args, max_response_length=200, prompt_batch_size=3), rows)
    assert distill.fitting_teacher_prompts(Args(), rows) is rows  # no --teacher-prompt-key


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


def test_equal_rewards_are_no_warning_when_a_teacher_trains_in_any_mode():
    """A step whose groups all scored alike has no reward advantage, but a teacher's term still trains: with the
    default k1 (distill/adv_share logged) and with a term in the loss (no adv_share, the reverse KL logged)."""
    from test_health import feed, step_row

    for teacher in ({"distill/adv_share": 1.0}, {}):
        row = step_row(1, frac_reward_zero_std=1.0, **{"distill/reverse_kl/mean": 0.5}, **teacher)
        warnings = feed(health.Monitor(bands.parse_bands(""), total_steps=10), [row])
        assert not any("every group's rewards are equal" in w for w in warnings), warnings
    warnings = feed(health.Monitor(bands.parse_bands(""), total_steps=10), [step_row(1, frac_reward_zero_std=1.0)])
    assert any("every group's rewards are equal" in w for w in warnings)  # without a teacher it is one


def test_the_start_up_memory_check_counts_the_teacher(tmp_path, capsys):
    """memory.check_update_memory runs after the teacher loaded (its free memory is what the teacher left),
    and a warning says what the frozen models hold: a teacher once, the policy itself (--teacher self) not at
    all. The real run's call is watched in test_a_bf16_teacher_is_held_in_bf16_and_scores_as_the_student_does."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(tmp_path / "m"), TASK_WORDS))
    teacher = torch.nn.Embedding(2**15, 2**11, dtype=torch.bfloat16)  # 128 MiB, as load_teacher holds it in bf16
    assert memory.frozen_gib(policy, (None, teacher)) == memory.frozen_gib(policy, (teacher, teacher)) == 0.125
    assert memory.frozen_gib(policy, (None, policy)) == 0  # --teacher self: no second model
    if memory.free_memory_gib(torch.device("cpu"), 1) is None:
        pytest.skip("no /proc/meminfo: the free memory cannot be read")
    args = Args(micro_batch_size=4_000_000, max_prompt_length=32, max_response_length=32, share_prompts=False)
    how = dict(world=1, ranks_here=1, device=torch.device("cpu"))
    memory.check_update_memory(args, policy, list(policy.parameters()), frozen=(None, teacher), **how)
    assert "The frozen reference and teacher hold 0.1 GiB of this rank's memory" in capsys.readouterr().out


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


# train_grpo.py in one plain process (a world of one), watched where distill.py joins it: the teacher as loaded
# (its parameters' dtypes and GiB), what the start-up memory check was told the frozen models hold, and each step
# the batch and log-probs the teacher's term saw
SPIED = """
import sys, torch, distill, memory, train_grpo
out, add, load, check, steps = sys.argv[1], distill.add_teacher_term, distill.load_teacher, train_grpo.check_update_memory, []
def load_teacher(*a, **kw):
    teacher = load(*a, **kw)
    dtypes = sorted({str(p.dtype) for p in teacher.parameters()})
    torch.save(dict(dtypes=dtypes, gib=memory.frozen_gib(None, [teacher])), out + "/teacher.pt")
    return teacher
def check_update_memory(args, policy, trained, *, frozen, **kw):
    torch.save(memory.frozen_gib(policy, frozen), out + "/frozen_gib.pt")
    return check(args, policy, trained, frozen=frozen, **kw)
def add_teacher_term(batch, teacher_logp, student_logp, **kw):
    before = batch["advantages"].clone()
    metrics = add(batch, teacher_logp, student_logp, **kw)
    seen = {k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_lens", "response_mask")}
    seen.update(before=before, after=batch["advantages"], teacher_logp=teacher_logp, student_logp=student_logp)
    steps.append(metrics)
    torch.save(dict(seen, metrics=metrics), out + f"/step{len(steps)}.pt")
    return metrics
distill.load_teacher, distill.add_teacher_term, train_grpo.check_update_memory = load_teacher, add_teacher_term, check_update_memory
sys.argv = ["train_grpo.py", *sys.argv[2:]]
train_grpo.main()
"""


def spied_train(out_dir, *flags):
    """train_grpo.py watched by SPIED; returns {1: step 1's batch, ..., "teacher": {"dtypes", "gib"} if it
    loaded one, "frozen_gib": what the memory check counted}."""
    seen = out_dir / "seen"
    seen.mkdir(parents=True)
    cmd = [sys.executable, "-c", SPIED, str(seen), "--out-dir", str(out_dir), *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train_grpo.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = {int(p.stem[4:]): torch.load(p) for p in seen.glob("step*.pt")}
    out |= {p.stem: torch.load(p) for p in (seen / "teacher.pt", seen / "frozen_gib.pt") if p.exists()}
    return out


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
    the student's exactly. --no-reward on rows without a reward_model: every advantage is then 0. The model's
    vocabulary is padded to policy.FUSED_HEAD_MIN_VOCAB words, so that both copies' heads run in the fused head,
    as every real vocabulary's does: the model's own 20-row head, a small matmul, rounds differently in two FSDP2
    copies of the same weights (2.4e-7 nats apart, measured)."""
    from policy import FUSED_HEAD_MIN_VOCAB

    words = TASK_WORDS + [f"w{i}" for i in range(FUSED_HEAD_MIN_VOCAB)]
    model = build_tiny_model(str(tmp_path / "model"), words)
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
    flags += ["--model", model, "--max-prompt-length", "32", "--max-response-length", "4"]  # the demo's lengths
    train(tmp_path / "run", *flags, "--no-reward", "--teacher", model)
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


# ----------------------------------------------------------------------------------------------
# With the real Qwen2.5 tokenizer: tools, and which teachers it accepts


@pytest.fixture(scope="module")
def qwen_teacher(tmp_path_factory):
    """Another random Qwen2 on the real Qwen2.5 tokenizer (seed 1), the size of conftest's qwen_tool_model."""
    from conftest import QWEN_DIR, need

    from models import build_random_model

    need(QWEN_DIR)
    sizes = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    out = str(tmp_path_factory.mktemp("qwen_teacher") / "teacher")
    return build_random_model(out, QWEN_DIR, seed=1, intermediate_size=256, **sizes)


@pytest.mark.slow
def test_with_tools_the_teachers_term_is_on_the_models_tokens_only(tmp_path, qwen_tool_model, qwen_teacher, gsm8k_data):
    """--tools (test_train_tools.py's model and calculator): a conversation's response holds the model's turns
    and, between them, the tools' answers and the chat template's tokens. The teacher scores the whole sequence,
    but its term, and the distill/* metrics, are on the model's tokens only: the tools' tokens keep an
    advantage of exactly 0, and the logged reverse KL is the mean over the model's tokens, not over all."""
    from conftest import gsm8k_flags
    from transformers import AutoModelForCausalLM, AutoTokenizer

    flags = [
        *("--model", qwen_tool_model, *gsm8k_flags(gsm8k_data), "--teacher", qwen_teacher, "--rollout", "hf"),
        *("--tools", os.path.join(REPO, "examples", "tools", "calculator.py"), "--max-turns", "3"),
        *"--max-response-length 64 --max-tool-response-length 24 --max-prompt-length 512 --dtype fp32".split(),
        *"--prompt-batch-size 4 --mini-batch-size 4 --group-size 4 --max-steps 1 --test-freq -1 --save-freq -1".split(),
    ]
    b, logged = spied_train(tmp_path, *flags)[1], metrics(tmp_path)[0]  # step 1's batch and metrics (no step 0)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tool_model)
    real = b["attention_mask"][:, -b["responses"].shape[1] :].bool()  # [N, R] the response, the tools' included
    mine = b["response_mask"].bool()  # [N, R] the model's own tokens
    tools = real & ~mine
    assert tools.any(), "no conversation called a tool: nothing was tested"
    for i in range(len(real)):  # what the mask leaves out is the tools' answers and the template around them
        assert not tools[i].any() or "<tool_response>" in tokenizer.decode(b["responses"][i][tools[i]])
    assert torch.equal(b["after"][~mine], torch.zeros((~mine).sum().item()))  # tools' tokens, padding: exactly 0
    term = b["after"] - b["before"]
    torch.testing.assert_close(term[mine], (b["teacher_logp"] - b["student_logp"])[mine], rtol=0, atol=1e-6)
    kl = b["student_logp"] - b["teacher_logp"]  # [N, R] nats
    assert logged["distill/reverse_kl/mean"] == pytest.approx(kl[mine].mean().item(), rel=1e-5)
    assert logged["distill/reverse_kl/max"] == pytest.approx(kl[mine].max().item(), rel=1e-5)
    assert logged["distill/teacher_logp/mean"] == pytest.approx(b["teacher_logp"][mine].mean().item(), rel=1e-5)
    assert abs(kl[real].mean().item() - kl[mine].mean().item()) > 1e-3  # over all the response's it differs
    # the teacher's log-probs line up with the tokens: a plain forward of the teacher on a row with a tool's answer
    i = next(i for i in range(len(real)) if tools[i].any())
    ids = b["input_ids"][i][b["attention_mask"][i].bool()]  # [prompt + response]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(qwen_teacher, dtype=torch.float32)(ids[None]).logits[0, :-1]
    n = b["response_lens"][i]
    by_hand = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[-n:, 0]  # [n]
    torch.testing.assert_close(b["teacher_logp"][i, :n], by_hand, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_qwen_teachers_are_accepted_and_another_tokenizer_is_refused_before_anything_loads(
    tmp_path, qwen_tool_model, qwen_teacher, teacher, gsm8k_data
):
    """The real Qwen2.5 tokenizer (151,665 tokens, 151,936 vocabulary rows): a teacher on it is accepted (the
    0.5B's own directory too, config and tokenizer only); the demo's tokenizer is refused at its first token."""
    from conftest import QWEN_DIR, gsm8k_flags

    assert distill.vocabulary_difference(qwen_tool_model, qwen_teacher) is None
    assert distill.vocabulary_difference(qwen_tool_model, QWEN_DIR) is None
    proc = train(tmp_path, "--model", qwen_tool_model, *gsm8k_flags(gsm8k_data), "--teacher", teacher, check=False)
    expected = f"--teacher {teacher}: token id 0 is '!' in --model's tokenizer and '<pad>' in the teacher's (151665 and"
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert "rollout engine" not in proc.stdout  # refused before the engine (and the policy) loaded


# ----------------------------------------------------------------------------------------------
# bf16, SIGTERM


@pytest.mark.slow
def test_a_bf16_teacher_is_held_in_bf16_and_scores_as_the_student_does(tmp_path):
    """--dtype bf16: the teacher's weights are held in bf16 (it only scores: fp32 copies would double its
    memory for the same numbers), and it computes as the bf16 student does: --model's own directory as the
    teacher (a second frozen copy) gives exactly 0 at step 1, the initial weights; then the student moves."""
    flags = [*RUN, "--max-steps", "2", "--test-freq", "-1", "--save-freq", "-1", "--dtype", "bf16"]
    seen = spied_train(tmp_path, *flags, "--teacher", str(tmp_path / "tiny_model"))
    assert seen["teacher"]["dtypes"] == ["torch.bfloat16"]
    assert seen["frozen_gib"] == seen["teacher"]["gib"] > 0  # the memory check counts it, in bf16's bytes
    rows = metrics(tmp_path)
    assert rows[0]["distill/reverse_kl/mean"] == rows[0]["distill/reverse_kl/max"] == 0.0
    assert rows[1]["distill/reverse_kl/mean"] != 0.0 and 0 < rows[1]["actor/grad_norm"] < 100
    assert seen[2]["teacher_logp"].dtype == torch.float32  # the log-probs of bf16 logits, taken in fp32


@pytest.mark.slow
def test_sigterm_during_opd_saves_and_the_rerun_continues_exactly(whole, teacher, tmp_path):
    """SIGTERM to torchrun with a teacher, sent during step 2's rollout (GRPO_CRASH_AT=rollout:2:SIGTERM: a step
    here takes 0.1 s, too short to aim a signal from outside): the run abandons step 2, saves step 1 and stops,
    though --save-freq 50 would have saved none; the same command continues to the uninterrupted run (the
    `whole` fixture's 1-rank run), distill/* included: the teacher is frozen and read again from --teacher."""
    flags = [*RUN, "--teacher", teacher, "--save-freq", "50"]
    proc = train(tmp_path, *flags, crash_at="rollout:2:SIGTERM")
    out, err = proc.stdout, proc.stderr
    assert "stopped by SIGTERM after step 1 of 4" in out + err, err[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1] and (tmp_path / "global_step_1").is_dir()
    assert not (tmp_path / "final_model").exists()
    proc = train(tmp_path, *flags)
    assert f"resumed from {tmp_path / 'global_step_1'}" in proc.stdout
    a, b = metrics(whole / "ranks1"), metrics(tmp_path)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a[1:], b[1:]):
        for key in [*COMPARED, "distill/reverse_kl/max", "distill/teacher_logp/mean", "response_length/mean"]:
            assert x[key] == y[key], (x["step"], key, x[key], y[key])


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--distill-loss", "forward_kl_topk", "--distill-topk", "4", "--no-reward", "--distill-logp-clamp", "-10"],
        ["--distill-loss", "forward_kl_topk"],  # the default top 32 of the demo's 20 words: all 20
        ["--distill-loss", "low_var_kl", "--distill-loss-clamp", "5"],
        ["--distill-loss", "k1", "--distill-clip", "0.2", "--micro-batch-size", "4"],
    ],
    ids=["forward_kl_topk pure", "forward_kl_topk default k", "k3 beside the reward", "k1 with its own clip"],
)
def test_each_distill_loss_trains_end_to_end_and_logs_verls_metrics(teacher, tmp_path, flags):
    """Two steps of the tiny model with a teacher's term in the loss: finite updates, the term logged under verl's
    names (distill/loss, loss_max, loss_min; forward_kl_topk's masses), the reverse KL as for k1; without a reward
    the advantages are 0 and the teacher's term is what trains."""
    proc = train(tmp_path, *RUN, "--max-steps", "2", "--teacher", teacher, *flags)
    said = "--distill-topk: the student has 20 vocabulary entries, fewer than the default 32"
    assert proc.stdout.count(said) == (flags == ["--distill-loss", "forward_kl_topk"])  # once, on rank 0
    rows = [r for r in metrics(tmp_path) if "actor/grad_norm" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["actor/grad_norm"] > 0 and all(map(math.isfinite, (r["actor/grad_norm"], r["distill/loss"])))
        assert r["distill/loss_min"] <= r["distill/loss_max"] and r["distill/reverse_kl/mean"] != 0
        if "forward_kl_topk" in flags:
            whole = "--distill-topk" not in flags  # the default takes all 20 words: the whole mass
            assert r["distill/student_mass"] == pytest.approx(1) if whole else 0 < r["distill/student_mass"] < 1
            assert 0 < r["distill/teacher_mass"] <= 1
            assert r["distill/loss_min"] >= 0
            assert "--no-reward" not in flags or r["critic/advantages/max"] == r["critic/advantages/min"] == 0


@pytest.mark.slow
def test_a_teacher_with_nan_weights_is_named_not_blamed_on_the_learning_rate(teacher, tmp_path):
    """The hostile case: a teacher whose weights are all NaN. The run stops at its first step naming --teacher;
    before, every update was skipped and the run said "diverged ... Lower --lr"."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan_teacher"
    subprocess.run(["cp", "-r", teacher, str(broken)], check=True)
    (weights,) = broken.glob("*.safetensors")
    save_file(
        {k: torch.full_like(v, math.nan) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"}
    )
    proc = train(tmp_path / "run", *RUN, "--max-steps", "2", "--teacher", str(broken), check=False)
    assert proc.returncode != 0
    assert f"--teacher {broken}: " in proc.stderr and "non-finite teacher log-prob" in proc.stderr, proc.stderr[-3000:]
    assert "Lower --lr" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_pure_distillation_on_a_prompt_only_dataset_without_a_reward_function(teacher, tmp_path):
    """The hostile case: --no-reward on a file of prompts alone, no --reward-fn. Decided at start-up (the teacher's
    term alone trains, critic/score is 0, said once); it used to load everything, then blame labelled_reward, the
    trainer's own function, at step 1."""
    rows = [{"prompt": [{"role": "user", "content": f"list {i % 10} 2 3 4 5 6 first"}]} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    flags = [*RUN, "--max-steps", "2", "--test-freq", "-1", "--train-data", str(tmp_path / "prompts.parquet")]
    proc = train(tmp_path / "run", *flags, "--teacher", teacher, "--no-reward")
    assert "a prompt-only dataset with --no-reward and no --reward-fn: the teacher's term alone trains" in proc.stdout
    steps = [r for r in metrics(tmp_path / "run") if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(r["critic/score/mean"] == 0 and r["distill/adv_share"] == 1 for r in steps)
