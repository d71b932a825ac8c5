"""Multi-turn training end to end (--tools): the real trainer on real GSM8K prompts with the real
Qwen2.5 tokenizer and chat template (its tools block in every prompt), on a random-init Qwen2 that
opens and closes tool calls often (tests/conftest.py: qwen_tool_model). Its calls are random tokens,
so each one is malformed and the model reads an error, then goes on: conversations of up to 3 turns.
The same samples on 1 and 2 ranks, an exact resume after kill -9, vLLM with LoRA and --filter-groups,
a rollout rank, eval.py. The loop itself, with scripted turns and every kind of tool failure: test_multi_turn.py."""

import json
import os

import pytest
from conftest import REPO, gsm8k_flags, metrics, run_script
from test_checkpoint import assert_same_run, train

# the reward reads the conversation, and fails the run if it is not there
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    turns = [m["content"] for m in extra_info["conversation"] if m["role"] == "assistant"]
    assert solution_str == turns[-1] and extra_info["num_turns"] == len(turns), extra_info
    return len(turns) + len(solution_str) / 100
"""
COMPARED = "critic/score/mean response_length/mean num_turns/mean num_turns/max tool/calls_per_sample tool/errors"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, qwen_tool_model, gsm8k_data):
    """4 steps on 1 rank and on 2 ranks with the transformers engine, and the 1-rank run killed in
    its third update, then rerun."""
    root = tmp_path_factory.mktemp("tool_runs")
    (root / "reward.py").write_text(REWARD)
    flags = [
        *("--model", qwen_tool_model, *gsm8k_flags(gsm8k_data), "--reward-fn", str(root / "reward.py")),
        *("--tools", os.path.join(REPO, "examples", "tools", "calculator.py"), "--max-turns", "3"),
        *"--max-response-length 64 --max-tool-response-length 24 --max-prompt-length 512 --val-max-prompts 8".split(),
        *"--dtype fp32 --lr 1e-3 --prompt-batch-size 4 --mini-batch-size 4".split(),  # 16 samples: the head is costly
    ]
    train(root / "ranks1", *flags)
    train(root / "ranks2", *flags, ranks=2)
    train(root / "killed", *flags, crash_at="update:3")
    train(root / "killed", *flags)
    return root, flags


@pytest.mark.slow
def test_one_and_two_ranks_draw_the_same_conversations(runs):
    """Step 1 (the same weights on both): the same conversations, so the same lengths, turns, calls and
    rewards. After an update the two differ by the ranks' float reductions, which can move a sample."""
    root, _ = runs
    one, two = metrics(root / "ranks1"), metrics(root / "ranks2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 4]
    for key in COMPARED.split():
        assert one[1][key] == pytest.approx(two[1][key], rel=1e-6), key
    first = slice(0, 4)  # step 1's samples in the table: the first prompt's group, on rank 0 in both
    samples = [
        [json.loads(line) for line in open(root / r / "samples" / "train.jsonl")][first] for r in ("ranks1", "ranks2")
    ]
    assert samples[0] == samples[1] and any("[tool] error:" in s["response"] for s in samples[0])
    assert one[1]["num_turns/max"] >= 2 and one[1]["tool/calls_per_sample"] > 0
    assert all(r["tool/malformed"] == r["tool/errors"] for r in one[1:])  # random tokens are never JSON
    for row in one[1:]:
        assert row["training/rollout_logprob_diff_max"] <= 1e-4  # on the model's tokens, in fp32
    assert one[2]["val-aux/num_turns/mean"] >= 1 and "val-aux/tool/calls_per_sample" in one[2]


@pytest.mark.slow
def test_a_killed_multi_turn_run_resumes_exactly(runs):
    root, _ = runs
    assert_same_run(root / "ranks1", root / "killed")
    a, b = metrics(root / "ranks1"), metrics(root / "killed")
    assert [r.get("num_turns/mean") for r in a] == [r.get("num_turns/mean") for r in b]


@pytest.mark.slow
def test_vllm_with_lora_and_dynamic_sampling_on_two_ranks(runs, tmp_path):
    _, flags = runs
    extra = "--rollout vllm --lora-rank 8 --lr 5e-3 --filter-groups --max-gen-batches 2 --max-steps 2 --test-freq 2"
    extra += " --group-size 4 --save-freq -1"
    run_script(*flags, *extra.split(), "--out-dir", str(tmp_path), ranks=2)
    rows = metrics(tmp_path)
    for row in rows[1:]:
        assert row["num_turns/mean"] >= 1 and row["tool/calls_per_sample"] > 0
        assert row["training/rollout_logprob_diff_max"] <= 1e-4 and row["filter/kept_groups"] >= 1


@pytest.mark.slow
def test_a_rollout_rank_holds_the_conversations_a_colocated_rank_would(runs, tmp_path):
    """--rollout-ranks 1 --max-staleness 1: the tool worker runs on the rollout rank; the trainer gets the
    conversations (their masks, turns and tool counts) and trains exactly as one colocated rank at S = 1."""
    _, flags = runs
    train(tmp_path / "colocated", *flags, "--max-staleness", "1")
    train(tmp_path / "split", *flags, "--max-staleness", "1", "--rollout-ranks", "1", ranks=2)
    assert_same_run(tmp_path / "colocated", tmp_path / "split")
    a, b = metrics(tmp_path / "colocated"), metrics(tmp_path / "split")
    for key in COMPARED.split():
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    assert max(r["num_turns/max"] for r in b[1:]) >= 2


@pytest.mark.slow
def test_eval_py_runs_conversations(runs, tmp_path):
    root, flags = runs
    model, data = str(root / "ranks1" / "final_model"), flags[flags.index("--val-data") + 1]
    tools = os.path.join(REPO, "examples", "tools", "calculator.py")
    out = tmp_path / "eval.json"
    run_script(
        *("--model", model, "--data", data, "--max-prompts", "8", "--samples", "2", "--temperature", "1"),
        *("--tools", tools, "--max-turns", "3", "--max-new-tokens", "64", "--rollout", "hf", "--out", str(out)),
        script="eval.py",
    )
    result = json.load(open(out))["metrics"]
    assert result["val-aux/num_turns/max"] >= 1 and "val-aux/tool/calls_per_sample" in result
