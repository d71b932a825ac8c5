"""eval.py: the validation metrics on hand-computed cases, and the standalone evaluator end to end."""

import json
import math
import os
import subprocess
import sys

import pytest

from eval import bootstrap, majority, pass_at_k, prompt_metrics, sample_sizes, samples_table, validation_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pass_at_k_matches_the_binomial_formula():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    for n, c, k in [(10, 3, 4), (16, 5, 8), (7, 2, 3)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_bootstrap_best_and_worst_of_k():
    # max of 2 draws from {0, 1} is 1 unless both are 0: 3/4; min is 1 only if both are 1: 1/4
    best, worst = (lambda d: d.max(1)), (lambda d: d.min(1))
    assert bootstrap([0.0, 1.0], 2, best, n_boot=20000)[0] == pytest.approx(0.75, abs=0.02)
    assert bootstrap([0.0, 1.0], 2, worst, n_boot=20000)[0] == pytest.approx(0.25, abs=0.02)
    assert bootstrap([0.0, 1.0], 2, best) == bootstrap([0.0, 1.0], 2, best)  # fixed seed


def test_majority_vote_and_sample_sizes():
    assert majority([1.0, 1.0, 0.0], ["a", "a", "b"]) == 1.0
    assert majority([0.0, 1.0, 0.0], ["7", "8", "7"]) == 0.0
    assert sample_sizes(8) == [2, 4, 8] and sample_sizes(6) == [2, 4, 6] and sample_sizes(1) == []


def test_prompt_metrics_of_a_known_group():
    m = prompt_metrics([1.0, 0.0, 0.0, 1.0], preds=["5", "3", "3", "5"])
    assert m["mean@4"] == 0.5 and m["std@4"] == 0.5
    assert m["pass@1"] == 0.5 and m["pass@2"] == pytest.approx(1 - 1 / 6) and m["pass@4"] == 1.0
    assert m["best@4/mean"] >= m["best@2/mean"] >= m["mean@4"] >= m["worst@2/mean"] >= m["worst@4/mean"]
    assert set(m) >= {"maj@2/mean", "maj@4/mean", "best@2/std", "worst@4/std"}
    # the majority answer "5" or "3" each hold half the votes; maj@4 lies between the two scores
    assert 0.0 <= m["maj@4/mean"] <= 1.0
    assert prompt_metrics([1.0, 1.0, 1.0, 0.0], preds=["5", "5", "5", "3"])["maj@4/mean"] > 0.8  # "5" wins most draws


def test_validation_metrics_are_named_like_verl_and_split_by_source():
    sources = ["a"] * 4 + ["b"] * 4
    metrics = validation_metrics(sources, [1, 1, 0, 0, 0, 0, 0, 0], group_size=2)
    assert metrics["val-core/a/reward/mean@2"] == 0.5  # prompt 1 all right, prompt 2 all wrong
    assert metrics["val-core/b/reward/mean@2"] == 0.0
    assert metrics["val-aux/a/reward/pass@2"] == 0.5
    assert all(k.startswith(("val-core/", "val-aux/")) for k in metrics)
    assert [k for k in metrics if k.startswith("val-core")] == ["val-core/a/reward/mean@2", "val-core/b/reward/mean@2"]


def test_maj_is_voted_only_where_the_reward_gives_a_pred():
    """A validation set mixing MATH (math_score gives a pred) with GSM8K (a float, no pred): the GSM8K
    prompts get no maj@k voted over Nones, the MATH ones get theirs."""
    sources = ["math"] * 4 + ["gsm8k"] * 4
    scores, preds = [1, 0, 0, 0, 1, 0, 0, 0], ["1", "2", "3", "3", None, None, None, None]
    metrics = validation_metrics(sources, scores, group_size=4, preds=preds)
    assert any(k.startswith("val-aux/math/reward/maj@") for k in metrics)
    assert not any(k.startswith("val-aux/gsm8k/reward/maj@") for k in metrics)


def test_samples_table_is_one_readable_line_per_sample():
    long_prompt = "a" * 100 + " How many apples?"
    table = samples_table(
        [
            dict(prompt=long_prompt, response="#### 5\nok", ground_truth="5", score=1.0),
            dict(prompt="p", response="r", ground_truth="7", score=0.0),
        ],
        width=30,
    )
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("prompt") and set(lines[1]) == {"-"}
    assert "How many apples?" in lines[2]  # the end of a long prompt is what identifies it
    assert "#### 5\\nok" in lines[2] and lines[2].endswith("1.000") and lines[3].endswith("0.000")
    assert len({len(line) for line in lines[:3]}) == 1  # columns line up


@pytest.fixture(scope="module")
def tiny_eval_setup(tmp_path_factory):
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS, write_digits

    root = tmp_path_factory.mktemp("eval")
    write_digits(str(root / "data"), seed=0, train_size=10, test_size=12)
    return root, build_tiny_model(str(root / "model"), TASK_WORDS)


@pytest.mark.slow
def test_standalone_eval_on_one_and_two_ranks_agree(tiny_eval_setup):
    root, model = tiny_eval_setup
    args = [
        "--model",
        model,
        "--data",
        str(root / "data" / "test.parquet"),
        *"--temperature 1.0 --max-new-tokens 4 --rollout vllm".split(),
    ]
    one = subprocess.run(
        [sys.executable, "eval.py", *args, "--n", "4", "--out", str(root / "one.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "val-core/synthetic/digits/reward/mean@4" in one.stdout
    two = subprocess.run(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc_per_node=2 eval.py".split(),
            *args,
            "--samples",
            "4",
            "--out",
            str(root / "two.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.load(open(root / "one.json")), json.load(open(root / "two.json"))
    assert a["prompts"] == 12 and a["metrics"] == b["metrics"]  # per-prompt seeds: the split does not matter
    assert {"val-aux/synthetic/digits/reward/pass@4", "val-aux/synthetic/digits/reward/best@2/mean"} <= set(
        a["metrics"]
    )


@pytest.mark.slow
def test_standalone_eval_caps_responses_at_the_models_context(tiny_eval_setup):
    root, model = tiny_eval_setup  # the tiny model has 512 positions; the default --max-new-tokens is 1024
    args = [
        "--model",
        model,
        "--data",
        str(root / "data" / "test.parquet"),
        *"--max-prompts 2 --rollout hf --out".split(),
        str(root / "cap.json"),
    ]
    proc = subprocess.run([sys.executable, "eval.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the model has 512 positions, so responses stop there" in proc.stdout
    assert json.load(open(root / "cap.json"))["prompts"] == 2


def test_a_missing_model_is_named(tmp_path):
    # before: "missing" went to the hub and failed with a "Repo id" error that named no flag
    from tasks.digits import write_digits

    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=4)
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # a machine without the hub, at once
    for model, message in [
        ("missing", "--model missing: not a local model directory, and it cannot be loaded as a Hugging Face hub id"),
        (str(tmp_path / "missing"), "no such directory"),
    ]:
        proc = subprocess.run(
            [sys.executable, "eval.py", "--model", model, "--data", str(tmp_path / "data" / "test.parquet")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_validate_samples_scores_and_strips_every_eos(tmp_path):
    """eval.validate, as training and eval.py call it, with a scripted engine: each prompt's seed
    comes from its place in the whole list, any EOS id of the generation config ends a response
    (not only tokenizer.eos_token_id), and the metrics are verl's."""
    from transformers import AutoTokenizer

    import data_prep
    from engine import Rollout
    from eval import validate
    from models import build_tiny_model
    from reward import compute_score
    from rollout import VALIDATION_STEP, sampling_seeds
    from tasks.digits import TASK_WORDS, write_digits

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "model"), TASK_WORDS))
    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=3)
    rows, _ = data_prep.load_prompts(str(tmp_path / "data" / "test.parquet"), tokenizer)
    answers = [r["reward_model"]["ground_truth"] for r in rows]
    # two stop ids, as Qwen's <|im_end|> and <|endoftext|>
    eos, other_stop = tokenizer.eos_token_id, tokenizer.pad_token_id

    class Scripted:
        """Prompt i's first sample is right and ends in EOS, its second wrong and ends in the other stop id."""

        def generate(self, prompts, *, n, seeds, **kw):
            self.seeds = seeds
            ids = [tokenizer.convert_tokens_to_ids(a) for a in answers[: len(prompts)]]
            return Rollout(
                response_ids=[r for i in ids for r in ([i, eos], [(i + 1) % 10 + 3, other_stop])][: len(prompts) * n],
                truncated=[False] * (len(prompts) * n),
            )

    engine = Scripted()
    metrics, samples = validate(
        engine, rows, tokenizer, compute_score, {eos, other_stop}, n=2, temperature=1.0, max_new_tokens=4, seed=7
    )
    assert engine.seeds == sampling_seeds(7, VALIDATION_STEP, 0, 3)
    assert (
        metrics["val-core/synthetic/digits/reward/mean@2"] == 0.5
        and metrics["val-aux/synthetic/digits/reward/pass@2"] == 1.0
    )
    assert [s["score"] for s in samples] == [1.0, 0.0] * 3 and samples[0]["response"] == answers[0]  # EOS stripped
    assert "<" not in samples[1]["response"]  # so is the other stop id
    assert samples[0]["prompt"] == tokenizer.decode(rows[0]["prompt_ids"])


def run_eval(*flags, stdin=""):
    return subprocess.run(
        [sys.executable, "eval.py", *flags], cwd=REPO, input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_eval_never_runs_a_model_directorys_code_even_when_the_console_says_yes(tiny_eval_setup, tmp_path):
    import shutil

    from test_inputs import with_its_own_code

    root, model = tiny_eval_setup
    marker = tmp_path / "code_ran"
    own = with_its_own_code(shutil.copytree(model, str(tmp_path / "own")), marker)
    proc = run_eval("--model", own, "--data", str(root / "data" / "test.parquet"), "--rollout", "hf", stdin="y\n" * 20)
    assert not marker.exists(), "the model directory's code ran"
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--model: model directory {own!r}: config.json has an auto_map" in proc.stderr


@pytest.mark.slow
def test_eval_on_a_training_checkpoint_says_how_to_export_it(tiny_eval_setup, tmp_path):
    root, _ = tiny_eval_setup
    step = tmp_path / "runs" / "x" / "global_step_3"  # what checkpoint.py writes
    os.makedirs(step / "shards")
    os.makedirs(step / "hf")
    (step / "trainer_state.json").write_text("{}")
    proc = run_eval("--model", str(step), "--data", str(root / "data" / "test.parquet"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--model: {str(step)!r} is a training checkpoint (trainer_state.json, shards/)" in proc.stderr
    assert f"`python export.py {step} OUT_DIR`" in proc.stderr


@pytest.mark.slow
def test_eval_names_a_tokenizer_without_a_chat_template(tiny_eval_setup, tmp_path):
    import shutil

    root, model = tiny_eval_setup
    plain = shutil.copytree(model, str(tmp_path / "plain"))
    os.remove(os.path.join(plain, "chat_template.jinja"))
    proc = run_eval("--model", plain, "--data", str(root / "data" / "test.parquet"), "--rollout", "hf")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"model directory {plain!r}: the tokenizer has no chat_template" in proc.stderr
    assert "chat_template.jinja" in proc.stderr


def test_validation_gives_reward_functions_what_training_gives_them():
    """eval.validate (the trainer's validation and eval.py's) and rollout.score_samples (training's) call a reward
    function with the same extra_info for the same samples: response_ids, response_length and truncated, which
    examples/rewards/length_aware.py reads."""
    import types

    from engine import Rollout
    from eval import validate
    from rollout import response_texts, score_samples

    class Tok:
        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    out = Rollout(response_ids=[[5, 6, 0], [7, 7, 7, 7], [8, 0], [9]], truncated=[False, True, False, True])

    class Scripted:
        def generate(self, prompts, *, n, **kwargs):
            return out

    rows = [
        {"data_source": "x", "reward_model": {"ground_truth": "5"}, "extra_info": {"index": i}, "prompt_ids": [1, 2]}
        for i in range(2)
    ]
    seen = {}

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.setdefault(kind, []).append((solution_str, extra_info))
        return 1.0

    kind = "validation"
    validate(Scripted(), rows, Tok(), record, {0}, n=2, temperature=1.0, max_new_tokens=4, seed=0)
    kind = "training"
    samples, args = (
        [r for r in rows for _ in range(2)],
        types.SimpleNamespace(reward_errors="raise", overlong_buffer_len=0),
    )
    score_samples((record, None), samples, response_texts(out, Tok(), {0}), out, first=0, args=args, device=None)
    assert seen["validation"] == seen["training"]
    assert seen["validation"][1] == (
        "7 7 7 7",
        {"index": 0, "response_ids": [7, 7, 7, 7], "response_length": 4, "truncated": True},
    )
