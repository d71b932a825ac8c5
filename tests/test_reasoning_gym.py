"""tasks/reasoning_gym.py: reasoning-gym's tasks as verl's parquet, and its verifiers as our reward: the rows,
the command line's refusals, and the scorer, which must equal reasoning-gym's own on every task we write."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep
from data_prep import DataError, load_dataset
from reward import BUILTIN_SOURCES, compute_score, score_rows
from tasks.reasoning_gym import (
    PREFIX,
    SHOT_SEED,
    TEST_SEED,
    decode,
    encode,
    level_config,
    level_rows,
    max_level,
    split_counts,
    task_entries,
    task_names,
    write_reasoning_gym,
)
from user_errors import RewardError

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.utils import extract_answer  # noqa: E402


def read(path):
    return pq.read_table(str(path)).to_pylist()


# ----------------------------------------------------------------------------------------------
# the data


def test_rows_are_verls_schema_with_what_the_verifier_needs(tmp_path):
    data_prep.main(["reasoning-gym", "--task", "chain_sum,leg_counting", "--size", "30", "--test-size", "10"]
                   + ["--weights", "2,1", "--out", str(tmp_path)])  # fmt: skip
    train, test = read(tmp_path / "train.parquet"), read(tmp_path / "test.parquet")
    assert len(train) == 30 and len(test) == 20
    sources = [r["data_source"] for r in train]
    assert sources.count("reasoning_gym/chain_sum") == 20 and sources.count("reasoning_gym/leg_counting") == 10
    assert sources != sorted(sources)  # shuffled: a batch mixes the tasks
    # the tasks in turn: --val-max-prompts' first rows hold every task
    assert [r["data_source"] for r in test] == ["reasoning_gym/chain_sum", "reasoning_gym/leg_counting"] * 10
    row = test[0]
    system, user = row["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]  # reasoning-gym's default system prompt
    info = row["extra_info"]
    assert user == {"role": "user", "content": info["question"]}
    assert row["reward_model"]["ground_truth"] == decode(info["answer"])
    entry = reasoning_gym.create_dataset("chain_sum", seed=TEST_SEED, size=1)[0]  # test rows: seeds from TEST_SEED
    assert (info["question"], decode(info["answer"])) == (entry["question"], entry["answer"])
    assert decode(info["metadata"]) == entry["metadata"] and decode(info["metadata"])["source_dataset"] == "chain_sum"
    assert info["split"] == "test" and decode(info["config"]) == {}
    # held out: no training question is a test question; and verl's loader reads both with a built-in reward
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    for split in ("train", "test"):
        assert len(load_dataset(str(tmp_path / f"{split}.parquet"), known_sources=BUILTIN_SOURCES)) == len(read(
            tmp_path / f"{split}.parquet"))  # fmt: skip


def test_the_same_seed_writes_the_same_files_and_another_seed_others(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_reasoning_gym(str(tmp_path / name), ["basic_arithmetic"], 20, 5, seed=seed)
    assert read(tmp_path / "a" / "train.parquet") == read(tmp_path / "b" / "train.parquet")
    assert read(tmp_path / "a" / "train.parquet") != read(tmp_path / "c" / "train.parquet")


def test_config_values_reach_the_task_and_the_row(tmp_path):
    args = ["--task", "chain_sum", "--size", "10", "--test-size", "2", "--out", str(tmp_path)]
    data_prep.main(["reasoning-gym", *args, "--config", "chain_sum.min_terms=5", "--config", "chain_sum.max_terms=5"])
    for row in read(tmp_path / "train.parquet"):
        assert decode(row["extra_info"]["config"]) == {"min_terms": 5, "max_terms": 5}
        assert decode(row["extra_info"]["metadata"])["num_terms"] == 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "chain_summ"], "unknown reasoning-gym task(s) ['chain_summ']; the tasks: ab, acre,"),
        (["--task", "chain_sum", "--config", "chain_sum.max_term=3"], "its keys: ['allow_negation', 'max_digits',"),
        (["--task", "chain_sum", "--config", "gcd.max_terms=3"], "'gcd' is not one of the --task tasks ['chain_sum']"),
        (["--task", "chain_sum", "--config", "max_terms=3"], "expected NAME.key=value"),
        (["--task", "chain_sum", "--config", "chain_sum.max_terms=0"], "max_terms must be >= min_terms"),
        (["--task", "chain_sum,gcd", "--weights", "1"], "--weights [1.0]: expected 2 positive numbers"),
        (["--task", "chain_sum", "--system-prompt", "chatty"], "expected one of ['DeepSeekZero', 'chain_of_draft',"),
        (
            [
                "--task",
                "chain_sum",
                "--test-size",
                "300",
                "--config",
                "chain_sum.max_terms=2",
                "--config",
                "chain_sum.max_digits=1",
            ],
            "only 200 usable questions in 3100 tries, fewer than 300; ask for fewer",
        ),  # fmt: skip
        (["--task", "leg_counting,leg_counting"], "--task: leg_counting named more than once, which would write each"),
        (["--task", "chain_sum", "--size", "0"], "argument --size: expected a whole number >= 1, got 0"),
        (["--task", "chain_sum", "--size", "-5"], "argument --size: expected a whole number >= 1, got -5"),
        (["--task", "chain_sum", "--test-size", "-1"], "argument --test-size: expected a whole number >= 0, got -1"),
        (["--task", "chain_sum", "--shots", "-2"], "argument --shots: expected a whole number >= 0, got -2"),
        (
            ["--task", "chain_sum", "--test-size", "150", "--shots", "60"]
            + ["--config", "chain_sum.max_terms=2", "--config", "chain_sum.max_digits=1"],
            "--shots 60: chain_sum gave only ",  # 200 questions, 150 of them held out
        ),
    ],
)
def test_bad_input_is_refused_naming_the_flag_and_the_valid_values(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        data_prep.main(["reasoning-gym", "--size", "5", "--out", str(tmp_path), *flags])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "train.parquet").exists()


def test_split_counts_follow_the_weights_and_sum_to_the_total():
    assert split_counts(10, [3, 1]) == [8, 2]  # 7.5 and 2.5: the tie goes to the first
    assert split_counts(7, [1, 1, 1]) == [3, 2, 2]
    assert sum(split_counts(1001, [0.3, 2, 5])) == 1001


def test_encode_keeps_tuples_and_int_keys_which_json_loses():
    value = {"grid": ((1, 2), (3, 4)), "colors": {0: "red", 1: None}, "nested": [{"a": (1.5, True)}], "s": "x"}
    assert decode(encode(value)) == value and isinstance(decode(encode(value))["grid"][0], tuple)
    with pytest.raises(TypeError, match="has no JSON form"):
        encode({"when": object()})


# ----------------------------------------------------------------------------------------------
# the scorer: reasoning-gym's own, on every task data_prep writes


def responses(entry, other):
    """The answers to score: right (when the task has one), wrong, partly right, empty, missing, and another row's."""
    answer = entry["answer"] if isinstance(entry["answer"], str) else "1"
    texts = [answer, answer + " and more", " " + answer.upper() + " ", "", "0", "[[1, 2], [3, 4]]", other or "x"]
    return [f"Thinking... <answer>{t}</answer>" for t in texts] + ["I cannot say.", "<answer>1</answer> <answer>"]


@pytest.mark.parametrize("name", task_names())
def test_the_scorer_equals_reasoning_gyms_own(tmp_path, name):
    # the rows go through the parquet file and the loader, as in training; reasoning-gym's own score is the
    # entry's dataset's score_answer(extract_answer(response), entry), on the entry as the generator made it
    write_reasoning_gym(str(tmp_path), [name], 2, 2, seed=3)
    held_out = [r["extra_info"]["question"] for r in read(tmp_path / "test.parquet")]
    for split, seed, exclude in (("test", 3 + TEST_SEED, ()), ("train", 3, held_out)):
        rows = load_dataset(str(tmp_path / f"{split}.parquet"), known_sources=BUILTIN_SOURCES)
        data, entries = task_entries(name, 2, seed, {}, exclude)
        assert [r["extra_info"]["question"] for r in rows] == [e["question"] for e in entries] or split == "train"
        by_question = {e["question"]: e for e in entries}
        for i, row in enumerate(rows):
            entry = by_question[row["extra_info"]["question"]]
            for text in responses(entry, entries[1 - i]["answer"]):
                try:
                    theirs = float(data.score_answer(extract_answer(text), entry))
                except Exception as e:
                    theirs = type(e).__name__
                try:
                    ours = compute_score(
                        row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"]
                    )
                except Exception as e:
                    ours = type(e).__name__
                assert ours == theirs, (name, split, text)


def test_partial_credit_stays_partial_and_a_missing_answer_scores_0(tmp_path):
    write_reasoning_gym(str(tmp_path), ["spell_backward"], 1, 1)
    row = read(tmp_path / "test.parquet")[0]
    truth = row["reward_model"]["ground_truth"]
    half = len(truth) // 2  # spell_backward's partial credit: the share of letters in the right place
    answer = truth[:half] + "#" * (len(truth) - half)
    score = compute_score(row["data_source"], f"<answer>{answer}</answer>", truth, row["extra_info"])
    assert 0 < half < len(truth) and score == pytest.approx(half / len(truth))
    assert compute_score(row["data_source"], truth, truth, row["extra_info"]) == 0.0  # no <answer> tags
    # the last <answer> counts, as in reasoning-gym's extract_answer
    assert (
        compute_score(row["data_source"], f"<answer>no</answer> <answer>{truth}</answer>", truth, row["extra_info"])
        == 1.0
    )


def test_a_scorer_that_raises_is_a_reward_error_counted_or_fatal(tmp_path):
    write_reasoning_gym(str(tmp_path), ["chain_sum"], 1, 2)
    rows = read(tmp_path / "test.parquet")
    rows[1]["extra_info"] = {"split": "test", "index": 1}  # a row written by hand, without the entry
    with pytest.raises(RewardError, match="sample 1 .*reasoning_gym/chain_sum.*extra_info lacks"):
        score_rows(compute_score, rows, ["<answer>1</answer>"] * 2, where="step 3")
    scores, extras = score_rows(compute_score, rows, ["<answer>1</answer>"] * 2, errors="skip", where="step 3")
    assert scores[1] == 0.0 and extras["reward_error"] == [0.0, 1.0]


def test_every_reasoning_gym_task_is_a_builtin_source_and_no_other_name_is():
    assert all(PREFIX + name in BUILTIN_SOURCES for name in task_names()) and len(task_names()) >= 100
    assert "reasoning_gym/composite" not in BUILTIN_SOURCES and "reasoning_gym/chain_summ" not in BUILTIN_SOURCES
    with pytest.raises(ValueError, match="no built-in reward .*reasoning_gym/<task>"):
        compute_score("reasoning_gym/chain_summ", "<answer>1</answer>", "1", {})


# ----------------------------------------------------------------------------------------------
# per-task validation metrics, as training's validation and eval.py compute them


def test_validation_metrics_are_per_task_with_partial_credit(tmp_path):
    """eval.validate on two tasks with a scripted engine: each task gets verl's metrics under its own
    data_source, and spell_backward's partial credit is averaged as it is (mean), while pass@k counts full scores."""
    from conftest import QWEN_DIR, need
    from transformers import AutoTokenizer

    from engine import Rollout
    from eval import validate

    need(QWEN_DIR)
    tokenizer = AutoTokenizer.from_pretrained(QWEN_DIR)
    write_reasoning_gym(str(tmp_path), ["chain_sum", "spell_backward"], 2, 3)
    rows, _ = data_prep.load_prompts(str(tmp_path / "test.parquet"), tokenizer, BUILTIN_SOURCES)
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    chain_sum = [r["data_source"] == "reasoning_gym/chain_sum" for r in rows]  # the tasks in turn
    # sample 1 of each prompt is right; sample 2 is wrong for chain_sum, half right for spell_backward
    answers = [(t, "-1" if c else t[: len(t) // 2] + "#" * (len(t) - len(t) // 2)) for c, t in zip(chain_sum, truths)]
    texts = [f"<answer>{a}</answer>" for pair in answers for a in pair]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    class Scripted:
        def generate(self, prompts, *, n, seeds, **kw):
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
            return Rollout(response_ids=ids, truncated=[False] * len(ids))

    metrics, samples = validate(Scripted(), rows, tokenizer, compute_score, {eos}, n=2, temperature=1.0,
                                max_new_tokens=16, seed=0)  # fmt: skip
    halves = [(len(t) // 2) / len(t) for c, t in zip(chain_sum, truths) if not c]
    assert metrics["val-core/reasoning_gym/chain_sum/reward/mean@2"] == 0.5
    assert metrics["val-core/reasoning_gym/spell_backward/reward/mean@2"] == pytest.approx(
        sum(1 + h for h in halves) / 6
    )
    assert metrics["val-aux/reasoning_gym/chain_sum/reward/pass@2"] == 1.0
    assert metrics["val-aux/reasoning_gym/spell_backward/reward/best@2/mean"] > 0.75
    assert [s["score"] for s in samples][:2] == [1.0, 0.0]


@pytest.mark.slow
def test_eval_py_scores_any_reasoning_gym_task_with_the_usual_command(qwen_model, tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO

    write_reasoning_gym(str(tmp_path / "data"), ["gcd", "word_sorting"], 2, 3)
    out = tmp_path / "eval.json"
    flags = f"--model {qwen_model} --data {tmp_path / 'data' / 'test.parquet'} --max-new-tokens 8 --out {out}"
    proc = subprocess.run([sys.executable, "eval.py", *flags.split()], cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(out))["metrics"]
    for task in ("gcd", "word_sorting"):
        assert 0.0 <= metrics[f"val-core/reasoning_gym/{task}/reward/mean@1"] <= 1.0
        assert f"val-core/reasoning_gym/{task}/reward/mean@1" in proc.stdout


# ----------------------------------------------------------------------------------------------
# curriculum levels (curriculum.py raises them during training)


def test_a_level_is_reasoning_gyms_curriculum_over_the_users_config(tmp_path):
    assert level_config("chain_sum", 0, {"allow_negation": True}) == {
        "allow_negation": True, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # fmt: skip
    assert level_config("chain_sum", 1, {"max_terms": 9}) | {"allow_negation": 0} == {
        "allow_negation": 0, "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}  # fmt: skip
    assert max_level("chain_sum") == 10 and level_config("chain_sum", 10, {})["max_terms"] == 12
    with pytest.raises(ValueError, match="levels 0 to 10"):
        level_config("chain_sum", 11, {})
    with pytest.raises(ValueError, match="'acre' has no curriculum; the tasks that have one: \\['ab', "):
        level_config("acre", 0, {})
    write_reasoning_gym(str(tmp_path), ["chain_sum"], 6, 4, level=1)
    for row in read(tmp_path / "train.parquet") + read(tmp_path / "test.parquet"):
        assert row["extra_info"]["level"] == 1 and decode(row["extra_info"]["config"])["max_digits"] == 2


def test_level_rows_follow_from_the_step_and_are_held_out():
    args = ("chain_sum", 2, 7, 0, {}, "")
    train, test = level_rows(*args, counts=(20, 10))
    assert (train, test) == level_rows(*args, counts=(20, 10))  # the same step: the same rows
    assert train != level_rows("chain_sum", 2, 8, 0, {}, "", counts=(20, 10))[0]  # another step: others
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    assert {r["extra_info"]["level"] for r in train + test} == {2} and len(train) == 20 and len(test) == 10


def test_shots_put_the_same_worked_examples_before_every_question(tmp_path):
    write_reasoning_gym(str(tmp_path), ["chain_sum"], 6, 3, prompt="direct", shots=2)
    rows = read(tmp_path / "train.parquet") + read(tmp_path / "test.parquet")
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(row["prompt"][:-1] == rows[0]["prompt"][:-1] for row in rows)
    shown = rows[0]["prompt"][1:5]
    entry = reasoning_gym.create_dataset("chain_sum", seed=SHOT_SEED, size=1)[0]  # from seeds beyond both splits'
    assert shown[:2] == [{"role": "user", "content": entry["question"]},
                         {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]  # fmt: skip
    assert not {shown[0]["content"], shown[2]["content"]} & {r["extra_info"]["question"] for r in rows[6:]}
    with pytest.raises(ValueError, match="graph_color has no single right answer to show"):
        write_reasoning_gym(str(tmp_path), ["graph_color"], 2, 2, shots=1)


def test_no_worked_example_is_a_question_of_the_file(tmp_path):
    # README's chain_sum at level 0 has 200 questions, 100 held out: its second worked example was a test question,
    # shown with its answer before every question, and its first was asked 21 times in training
    write_reasoning_gym(str(tmp_path), ["chain_sum"], 200, 100, prompt="direct", level=0, shots=2)
    rows = read(tmp_path / "train.parquet") + read(tmp_path / "test.parquet")
    shown = {m["content"] for m in rows[0]["prompt"][:-1] if m["role"] == "user"}
    assert len(shown) == 2 and not shown & {r["extra_info"]["question"] for r in rows}


def test_questions_two_tasks_share_are_counted_and_no_task_trains_on_anothers_test(tmp_path, capsys, monkeypatch):
    from reasoning_gym.factory import DATASETS

    monkeypatch.setitem(DATASETS, "leg_counting_twin", DATASETS["leg_counting"])  # a task that asks the same
    task_names.cache_clear()
    try:
        write_reasoning_gym(str(tmp_path), ["leg_counting", "leg_counting_twin"], 20, 10)
    finally:
        task_names.cache_clear()
    out = capsys.readouterr().out
    shared = "rows ask a question that a row of another task also asks (reasoning_gym/leg_counting, "
    shared += "reasoning_gym/leg_counting_twin); each is scored by its own task's verifier"
    assert f"{tmp_path / 'train.parquet'}: 20 of 20 {shared}" in out
    assert f"{tmp_path / 'test.parquet'}: 20 of 20 {shared}" in out
    train, test = read(tmp_path / "train.parquet"), read(tmp_path / "test.parquet")
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    write_reasoning_gym(str(tmp_path / "one"), ["leg_counting", "chain_sum"], 20, 10)
    assert "another task" not in capsys.readouterr().out  # two tasks that share nothing: nothing said


def test_metadata_that_is_not_json_is_named_at_start_up_and_by_the_scorer(tmp_path):
    # a hand-edited file: extra_info.metadata as Python's repr, which is not JSON
    write_reasoning_gym(str(tmp_path), ["chain_sum"], 4, 3)
    rows = read(tmp_path / "test.parquet")
    rows[1]["extra_info"]["metadata"] = str(decode(rows[1]["extra_info"]["metadata"]))
    path = tmp_path / "edited.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError) as err:
        load_dataset(str(path), known_sources=BUILTIN_SOURCES)  # the trainer's and eval.py's check of every row
    said = str(err.value)
    assert said.startswith(f"{path}: 1 of 3 rows are invalid:\n  row 1, field extra_info.metadata: not JSON text (")
    assert "write the file again with `python data_prep.py reasoning-gym`, or store tasks.reasoning_gym.encode" in said
    with pytest.raises(ValueError, match=r"^reasoning_gym/chain_sum row: extra_info.metadata is not JSON text \("):
        compute_score("reasoning_gym/chain_sum", "<answer>3</answer>", "3", rows[1]["extra_info"])
    assert len(load_dataset(str(path))) == 3  # no built-in reward asked for (--reward-fn): not its concern
