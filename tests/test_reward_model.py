"""reward_model.py: a sequence classifier scores (prompt, response) with its own chat template; the
score of a conversation does not depend on what else is in its micro-batch."""

import re

import pytest
import torch

import reward_model
from models import build_random_model, build_tiny_model
from tasks.digits import TASK_WORDS

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    build_tiny_model(root / "tiny", TASK_WORDS)
    path = build_random_model(str(root / "rm"), str(root / "tiny"), seed=1, reward_model=True)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = -1  # what load_reward_model sets: the score is read at the last position
    return model, AutoTokenizer.from_pretrained(path)


def test_score_is_the_logit_at_the_end_of_the_rendered_conversation(rm):
    model, tok = rm
    rows = [{"prompt": [{"role": "user", "content": "list 1 2 3 4 5 6 last"}]}] * 3
    texts = ["6", "1 2", "6 6 6 6 6"]
    scores = reward_model.score(model, tok, rows, texts, micro_batch_size=3, device=CPU)
    for row, text, s in zip(rows, texts, scores):
        ids = reward_model.render(tok, [row], [text])[0]
        assert tok.decode(ids).rstrip().endswith(text + " <|end|>") or text in tok.decode(ids)
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert s == pytest.approx(alone, abs=1e-5)  # left padding in a batch changed nothing
    one_by_one = reward_model.score(model, tok, rows, texts, micro_batch_size=1, device=CPU)
    assert one_by_one == pytest.approx(scores, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 3  # a random head still tells them apart


def test_a_text_prompt_is_read_as_prompt_plus_response_as_trl_gives_it(rm):
    """TRL's standard (text) prompt: the reward model reads prompt + response with no template and no
    special tokens, as GRPOTrainer tokenizes it; chat rows in the same call keep their template."""
    model, tok = rm
    rows = [{"prompt": "list 1 2 3 last"}, {"prompt": [{"role": "user", "content": "list 1 2 3 last"}]}]
    ids = reward_model.render(tok, rows, [" 3", "3"])
    assert ids[0] == tok("list 1 2 3 last 3", add_special_tokens=False)["input_ids"]
    assert ids[1] == reward_model.render(tok, rows[1:], ["3"])[0] and ids[1] != ids[0]
    scores = reward_model.score(model, tok, rows, [" 3", "3"], micro_batch_size=2, device=CPU)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([ids[0]])).logits[0, 0].item()
    assert scores[0] == pytest.approx(alone, abs=1e-5)


def test_a_model_with_more_than_one_output_is_refused(tmp_path):
    tiny = build_tiny_model(str(tmp_path / "tiny"), TASK_WORDS)  # a causal LM: transformers gives it 2
    with pytest.raises(SystemExit, match="--reward-model: model path .*missing.*: no such directory"):
        reward_model.load_reward_model(str(tmp_path / "missing"), None, CPU)
    with pytest.raises(SystemExit) as err:
        reward_model.check_reward_model(tiny)  # from config.json, before anything loads
    assert str(err.value).startswith(
        f"--reward-model {tiny}: a reward model has one output (num_labels 1), this one has 2"
    )
    assert "LlamaForCausalLM" in str(err.value)
    with pytest.raises(SystemExit, match="this one has 2"):
        reward_model.load_reward_model(tiny, None, CPU)


def test_a_reward_model_that_needs_its_own_code_is_refused_and_its_code_never_runs(tmp_path, rm_dir):
    """The reward model's directory gets the policy's checks (model_dir.check_model_path); loading it
    never asks to run its code, so a "y" on the console cannot run it."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO
    from test_inputs import with_its_own_code

    marker = tmp_path / "code_ran"
    path = with_its_own_code(shutil.copytree(rm_dir, str(tmp_path / "rm")), marker)
    with pytest.raises(SystemExit, match="--reward-model: model directory .*: config.json has an auto_map"):
        reward_model.check_reward_model(path)
    load = f"import reward_model, torch; reward_model.load_reward_model({path!r}, None, torch.device('cpu'))"
    proc = subprocess.run(
        [sys.executable, "-c", load], cwd=REPO, input="y\n" * 20, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0 and not marker.exists()
    assert "config.json has an auto_map" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# in the trainer

FLAKY = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "7" in solution_str:
        raise ConnectionError("the checker is down")
    return 1.0
"""
RUN = "--rollout hf --max-steps 2 --prompt-batch-size 16 --mini-batch-size 16 --group-size 4 --test-freq -1 --save-freq -1"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_dir")
    build_tiny_model(root / "tiny", TASK_WORDS)
    return build_random_model(str(root / "rm"), str(root / "tiny"), seed=1, reward_model=True)


@pytest.mark.slow
def test_the_reward_is_the_weighted_functions_plus_the_reward_model(tmp_path, rm_dir):
    from conftest import metrics, run_script

    flags = ["--reward-fn", "reward.py:compute_score", "--reward-fn", "examples/rewards/length_aware.py"]
    flags += ["--reward-weights", "1,0.25", "--reward-model", rm_dir, "--reward-model-weight", "0.1"]
    validating = RUN.replace("--test-freq -1", "--test-freq 2 --val-max-prompts 8")  # length_aware there too
    run_script("--out-dir", str(tmp_path), *validating.split(), *flags, ranks=2)
    assert all("val-core/synthetic/digits/reward/mean@1" in r for r in metrics(tmp_path)[::2])  # steps 0 and 2
    for r in metrics(tmp_path)[1:]:
        rule, model = r["reward_extra/rule/mean"], r["reward_extra/reward_model/mean"]
        assert model != 0 and r["critic/score/mean"] == pytest.approx(rule + 0.1 * model, abs=1e-6)
        parts = r["reward_extra/reward.compute_score/mean"], r["reward_extra/length_aware.compute_score/mean"]
        # length_aware read extra_info: 0 for a response cut at the limit, else 1 (4 tokens are within its budget)
        assert parts[1] == pytest.approx(1 - r["response_length/clip_ratio"], abs=1e-6)
        assert rule == pytest.approx(parts[0] + 0.25 * parts[1], abs=1e-6)


@pytest.mark.slow
def test_reward_errors_skip_counts_and_raise_names_the_sample(tmp_path):
    from conftest import REPO, metrics, run_script

    flaky = tmp_path / "flaky.py"
    flaky.write_text(FLAKY)
    run_script("--out-dir", str(tmp_path / "skip"), *RUN.split(), "--reward-fn", str(flaky), "--reward-errors", "skip")
    rows = metrics(tmp_path / "skip")[1:]
    assert sum(r["reward/errors"] for r in rows) > 0  # the random demo model writes a 7 now and then
    for r in rows:  # every failed sample scored 0, every other 1
        assert r["critic/score/mean"] == pytest.approx(1 - r["reward/errors"] / 64)
        assert r["reward_extra/reward_error/mean"] == pytest.approx(r["reward/errors"] / 64)
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    cmd += ["--out-dir", str(tmp_path / "raise"), *RUN.split(), "--reward-fn", str(flaky)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "ConnectionError: the checker is down" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"\bsample \d+", proc.stderr)  # names the sample ("raised on sample 17", "sample 17 of the batch")


def test_a_reward_model_follows_the_compute_dtype(rm_dir):
    """--dtype bf16: the reward model runs in bf16 (FSDP2 mixed precision, as the policy), and its
    scores stay within bf16's rounding of the fp32 ones."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        rows = [{"prompt": [{"role": "user", "content": "list 1 2 3 4 5 6 last"}]}] * 3
        texts = ["6", "1 2", "6 6 6 6 6"]
        scores, seen = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            model, tok = reward_model.load_reward_model(rm_dir, mesh, CPU, dtype=dtype)
            model.score.register_forward_hook(lambda m, i, o, d=dtype: seen.__setitem__(d, (i[0].dtype, o.dtype)))
            scores[dtype] = reward_model.score(model, tok, rows, texts, micro_batch_size=3, device=CPU)
        assert seen == {torch.float32: (torch.float32,) * 2, torch.bfloat16: (torch.bfloat16,) * 2}
        assert scores[torch.bfloat16] != scores[torch.float32]
        assert scores[torch.bfloat16] == pytest.approx(scores[torch.float32], abs=0.01)  # measured: 2.3e-3
    finally:
        dist.destroy_process_group()
