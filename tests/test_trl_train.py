"""A TRL user's GRPO inputs, unchanged, through train_grpo.py on 1 and 2 ranks: a prompt-only dataset and batched
reward functions written TRL's way. The demo's tiny model on the digits task, and the real SmolLM2 on a
TRL-format GSM8K, killed with SIGKILL and resumed to exactly the run that would have happened."""

import json
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import GSM8K_DIR, REPO, metrics, need, run_script

from tasks.digits import write_digits

# TRL-style reward functions, as a TRL user writes them for GRPOTrainer(reward_funcs=[...])
REWARDS = textwrap.dedent(
    """
    import re

    def accuracy_reward(completions, solution, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        kwargs["log_extra"]("solution", list(solution))
        kwargs["log_metric"]("answers/nonempty", sum(bool(t.strip()) for t in texts) / len(texts))
        return [float(s in t) for t, s in zip(texts, solution)]

    def short_reward(completion_ids, trainer_state, **kwargs):
        # applies from step 2 on: None before that, so accuracy_reward alone scores step 1
        if trainer_state.global_step < 2:
            return [None] * len(completion_ids)
        return [1.0 - min(len(ids), 16) / 16 for ids in completion_ids]

    def text_length(completions, **kwargs):
        # differs within a group from step 1 on: the exact-resume check then resumes a run whose weights move
        return [len(c[0]["content"]) / 40 for c in completions]

    def format_reward(completions, **kwargs):
        return [float(bool(re.fullmatch(r"\\s*\\d\\s*", c[0]["content"]))) for c in completions]

    def gsm8k_accuracy(completions, solution, **kwargs):
        texts = [c[0]["content"] for c in completions]
        numbers = [re.findall(r"-?\\d[\\d,]*", t) for t in texts]
        return [float(bool(n) and n[-1].replace(",", "") == s) for n, s in zip(numbers, solution)]
    """
)


def trl_digits(tmp_path):
    """The digits task as a TRL user's files: chat prompts in jsonl for training, text prompts in a save_to_disk
    directory for validation (Arrow stream files, as `datasets` writes them)."""
    write_digits(str(tmp_path / "verl"), seed=0, train_size=32, test_size=8)
    rows = {s: pq.read_table(tmp_path / "verl" / f"{s}.parquet").to_pylist() for s in ("train", "test")}
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "solution": r["reward_model"]["ground_truth"]}) + "\n"
            for r in rows["train"]
        )
    )
    val = tmp_path / "val"
    val.mkdir()
    table = pa.Table.from_pylist(
        [{"prompt": r["prompt"][-1]["content"], "solution": r["reward_model"]["ground_truth"]} for r in rows["test"]]
    )
    with pa.OSFile(str(val / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (val / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (val / "dataset_info.json").write_text("{}")
    return str(train), str(val)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_trl_dataset_and_trl_reward_functions_train_on_one_and_two_ranks(tmp_path, ranks):
    train, val = trl_digits(tmp_path)
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(REWARDS)
    out = tmp_path / "run"
    spec = f"{rewards}:accuracy_reward,{rewards}:short_reward"
    flags = ["--out-dir", str(out), "--train-data", train, "--val-data", val, "--reward-fn", spec]
    flags += "--reward-weights 1,0.5 --rollout hf --max-steps 2 --prompt-batch-size 8 --mini-batch-size 8".split()
    run_script(*flags, *"--group-size 4 --test-freq 2 --val-max-prompts 8 --save-freq -1".split(), ranks=ranks)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert {"rewards/accuracy_reward/mean", "rewards/accuracy_reward/std", "answers/nonempty"} <= set(row)
        assert row["reward_extra/reward_unscored/mean"] == 0.0
    assert "rewards/short_reward/mean" not in rows[1] and "rewards/short_reward/mean" in rows[2]  # None at step 1
    assert "val-core/prompt_only/reward/mean@1" in rows[2]
    samples = [json.loads(line) for line in open(out / "samples" / "train.jsonl")]
    assert all("solution" in s and "rewards/accuracy_reward" in s for s in samples)


TRL_REF = os.path.join(REPO, ".trl_ref")  # TRL 1.16.0's code (bash install.sh --dev), for trl.rewards


@pytest.mark.slow
def test_the_documented_trl_command_runs_at_a_tiny_size(tmp_path, monkeypatch):
    """docs/rewards.md's "Coming from TRL" command: a user's accuracy_reward and format_reward beside TRL's own
    think_format_reward, weighted 1.0,0.2,0.2, on 2 ranks, validating on TRL-format data. At a tiny size: the demo's
    model on the digits task as chat prompts stands in for SmolLM2 on GSM8K (the SmolLM2 test below runs those),
    1 step, the transformers engine; it validates on the training file, as trl_digits' validation set has text
    prompts, which think_format_reward cannot read (in TRL neither)."""
    if not os.path.isdir(os.path.join(TRL_REF, "trl", "rewards")):
        pytest.skip(f"TRL's code is not in {TRL_REF} (bash install.sh --dev puts it there)")
    monkeypatch.setenv("PYTHONPATH", TRL_REF)  # the reward workers import trl.rewards from there
    train, _ = trl_digits(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    command = "--reward-fn my_rewards.py:accuracy_reward --reward-fn my_rewards.py:format_reward "
    command += "--reward-fn trl.rewards:think_format_reward --reward-weights 1.0,0.2,0.2"
    docs = open(os.path.join(REPO, "docs", "rewards.md")).read()
    flags = command.split()
    assert all(f"{flag} {value}" in docs for flag, value in zip(flags[::2], flags[1::2]))
    flags = [f.replace("my_rewards.py", str(tmp_path / "my_rewards.py")) for f in flags]
    flags += ["--out-dir", str(tmp_path / "run"), "--train-data", train, "--val-data", train]
    run_script(*flags, *"--rollout hf --max-steps 1 --prompt-batch-size 8 --mini-batch-size 8".split(), ranks=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and all("val-core/prompt_only/reward/mean@1" in r for r in rows)
    names = ("accuracy_reward", "format_reward", "think_format_reward")
    assert all(f"rewards/{name}/mean" in rows[1] and f"val-aux/rewards/{name}/mean" in rows[1] for name in names)


def train_smollm2(out_dir, data, model, rewards, crash_at=None, save_freq=1):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_CRASH_AT"}
    if crash_at:
        env["GRPO_CRASH_AT"] = crash_at
    flags = ["--model", model, "--out-dir", str(out_dir), "--train-data", data, "--val-data", data]
    flags += ["--reward-fn", f"{rewards}:gsm8k_accuracy,{rewards}:short_reward,{rewards}:text_length"]
    flags += "--rollout hf --max-steps 2 --prompt-batch-size 2 --mini-batch-size 2 --group-size 2".split()
    flags += "--max-response-length 8 --test-freq 2 --val-max-prompts 2 --kl-coef 0 --lr 1e-5".split()
    flags += ["--save-freq", str(save_freq)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_grpo.py", *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert (proc.returncode != 0) == bool(crash_at), f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
def test_smollm2_on_a_trl_gsm8k_is_killed_and_resumes_exactly(tmp_path, smollm2_model):
    need(GSM8K_DIR)
    with open(os.path.join(GSM8K_DIR, "train.jsonl")) as f:
        raw = [json.loads(next(f)) for _ in range(24)]
    system = {"role": "system", "content": "Solve the problem. End with the final number."}
    data = tmp_path / "gsm8k_trl.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [system, {"role": "user", "content": r["question"]}],
                    "solution": r["answer"].split("####")[-1].strip(),
                }
            )
            + "\n"
            for r in raw
        )
    )
    rewards = tmp_path / "gsm8k_rewards.py"
    rewards.write_text(REWARDS)
    # the reference saves no checkpoints (1.6 GB each: SmolLM2 and its Adam moments); saving must change nothing
    train_smollm2(tmp_path / "whole", str(data), smollm2_model, rewards, save_freq=-1)
    proc = train_smollm2(tmp_path / "killed", str(data), smollm2_model, rewards, crash_at="update:2")
    assert proc.returncode != 0
    proc = train_smollm2(tmp_path / "killed", str(data), smollm2_model, rewards)
    assert "resumed from" in proc.stdout
    whole, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "killed")
    assert [r["step"] for r in whole] == [r["step"] for r in resumed] == [0, 1, 2]  # killed in step 2, resumed
    compared = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "rewards/gsm8k_accuracy/mean"]
    for a, b in zip(whole, resumed):
        assert {k: a.get(k) for k in compared} == {k: b.get(k) for k in compared}, a["step"]
    assert "rewards/short_reward/mean" in whole[2] and "rewards/gsm8k_accuracy/mean" in whole[1]
    assert all(r["actor/grad_norm"] > 0 for r in whole[1:]), [r["actor/grad_norm"] for r in whole]  # it trained
    from safetensors.torch import load_file

    wa = load_file(os.path.join(tmp_path / "whole", "final_model", "model.safetensors"))
    wb = load_file(os.path.join(tmp_path / "killed", "final_model", "model.safetensors"))
    assert all((wa[k] == wb[k]).all() for k in wa)
