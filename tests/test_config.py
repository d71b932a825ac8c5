"""train_grpo.py's and eval.py's flags: every bad value is refused by name while parsing, before
anything loads, and every flag set the project itself uses still passes. All in-process (parse_args
and check_args are plain functions) but one subprocess run that proves the order."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import cli  # noqa: E402
import config  # noqa: E402
import eval as evaluate  # noqa: E402


def refused(parse, argv, capsys):
    """Run a parser that must refuse argv; returns what it printed to stderr."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2, f"{argv}: exit code {exit_info.value.code}"
    return capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# train_grpo.py: each bad value, and the message that must name it

BAD = [
    # the hostile tester's cases (issue 12): silent wrong values ...
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--prompt-column", " "], "--prompt-column must be a column's name"),
    (["--allow-changed", "lr,learning_rate"], "--allow-changed learning_rate: no such flag"),
    (["--lr-schedule", "cosin"], "argument --lr-schedule: invalid choice: 'cosin'"),
    (["--max-steps", "0"], "--max-steps must be >= 1, or -1 to run all --epochs"),
    (["--kl-coef", "0", "--kl-kind", "k4"], "argument --kl-kind: invalid choice: 'k4'"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    # ... late, unreadable failures ...
    (["--group-size", "0"], "--group-size must be >= 2"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--mini-batch-size", "0"], "--mini-batch-size must be >= 1"),
    (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1"),
    (["--lr", "-1"], "--lr must be >= 0"),
    (["--max-response-length", "0"], "--max-response-length must be >= 1"),
    (["--loss-agg", "nonsense"], "argument --loss-agg: invalid choice: 'nonsense'"),
    # ... and abbreviations, which the demo's max_steps=200 then silently overrode
    (["--max-st", "5"], "unrecognized arguments: --max-st 5"),
    # every other field
    (["--model", ""], "--model must be"),
    (["--train-data", "no/such/train.parquet"], "--train-data no/such/train.parquet: no such file"),
    (["--val-data", "no/such/test.parquet"], "--val-data no/such/test.parquet: no such file"),
    (["--out-dir", ""], "--out-dir must not be empty"),
    (
        ["--reward-fn", "no/such/reward.py:score"],
        "--reward-fn no/such/reward.py:score: no such file 'no/such/reward.py'",
    ),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--max-steps", "-2"], "--max-steps must be >= 1, or -1"),
    (["--prompt-batch-size", "0"], "--prompt-batch-size must be >= 1"),
    (["--max-prompt-length", "0"], "--max-prompt-length must be >= 1"),
    (["--rollout", "sglang"], "argument --rollout: invalid choice: 'sglang'"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--temperature", "-0.5"], "--temperature must be > 0"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "0"], "--top-k must be >= 1, or -1 for off"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--micro-batch-tokens", "-1"], "--micro-batch-tokens must be >= 0"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--lr-schedule", "cosine", "--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1]"),
    (
        ["--lr-schedule", "constant", "--min-lr-ratio", "0.1"],
        "--min-lr-ratio is only used by --lr-schedule cosine",
    ),  # the demo is cosine
    (["--weight-decay", "-0.01"], "--weight-decay must be >= 0"),
    (["--grad-clip", "0"], "--grad-clip must be > 0"),
    (["--clip-low", "0"], "--clip-low must be in (0, 1)"),
    (["--clip-low", "1"], "--clip-low must be in (0, 1)"),
    (["--clip-high", "0"], "--clip-high must be > 0"),
    (["--clip-c", "1"], "--clip-c must be > 1"),
    (["--kl-coef", "-0.001"], "--kl-coef must be >= 0"),
    (["--entropy-coef", "-0.01"], "--entropy-coef must be >= 0"),
    (["--tis-cap", "0.5"], "--tis-cap must be >= 1"),
    (["--tis-cap", "2", "--no-engine-logprobs"], "--tis-cap needs the engine's log-probs"),
    (["--rollout", "vllm", "--no-engine-shares-policy"], "--no-engine-shares-policy is a setting of the transformers"),
    (["--profile-step", "-1"], "--profile-step must be >= 0 (0: none)"),
    (
        ["--prompt-batch-size", "64", "--mini-batch-size", "48"],
        "--prompt-batch-size (64) must be a multiple of --mini-batch-size (48)",
    ),
    (["--adv-estimator", "ppo"], "argument --adv-estimator: invalid choice: 'ppo'"),
    (["--loss-mode", "dapo"], "argument --loss-mode: invalid choice: 'dapo'"),
    # each --loss-mode variant's own flags: out of range, and set while another mode is used
    (["--loss-mode", "sapo", "--tau-pos", "0"], "--tau-pos must be > 0, got 0.0"),
    (["--loss-mode", "sapo", "--tau-neg", "-1"], "--tau-neg must be > 0, got -1.0"),
    (["--tau-neg", "2"], "--tau-neg 2.0 is a sapo setting and --loss-mode is vanilla: add --loss-mode sapo"),
    (["--loss-mode", "clip_cov", "--clip-cov-ratio", "0"], "--clip-cov-ratio must be in (0, 1], got 0.0"),
    (["--loss-mode", "clip_cov", "--clip-cov-lb", "-1"], "--clip-cov-lb must be >= 0: it cuts tokens of high"),
    (["--loss-mode", "clip_cov", "--clip-cov-ub", "0"], "--clip-cov-ub must be > 0, got 0.0"),
    (["--loss-mode", "clip_cov", "--clip-cov-lb", "5"], "--clip-cov-ub (5.0) must be > --clip-cov-lb (5.0)"),
    (["--loss-mode", "gspo", "--clip-cov-ub", "4"], "--clip-cov-ub 4.0 is a clip_cov setting and --loss-mode is gspo"),
    (["--loss-mode", "kl_cov", "--kl-cov-ratio", "1.5"], "--kl-cov-ratio must be in (0, 1], got 1.5"),
    (["--loss-mode", "kl_cov", "--ppo-kl-coef", "-0.1"], "--ppo-kl-coef must be >= 0, got -0.1"),
    (["--ppo-kl-coef", "1"], "--ppo-kl-coef 1.0 is a kl_cov setting and --loss-mode is vanilla: add --loss-mode"),
    (["--max-gen-batches", "0"], "--max-gen-batches must be >= 1"),
    (
        ["--max-response-length", "8", "--overlong-buffer-len", "8"],
        "--overlong-buffer-len must be in [0, --max-response-length (8))",
    ),
    (["--overlong-penalty-factor", "-1"], "--overlong-penalty-factor must be >= 0"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0 (0: full fine-tuning)"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora-target-modules", ","], "--lora-target-modules must name modules, or be all-linear"),
    # LoRA settings without LoRA were silently ignored
    (
        ["--lora-target-modules", "q_proj"],
        "--lora-target-modules q_proj is a LoRA setting and LoRA is off: add --lora-rank R",
    ),
    (["--lora-alpha", "16"], "--lora-alpha 16.0 is a LoRA setting and LoRA is off"),
    (["--lora-dropout", "0.1"], "--lora-dropout 0.1 is a LoRA setting and LoRA is off"),
    (["--reward-timeout", "0"], "--reward-timeout must be > 0 seconds"),
    (["--tools", "no/such/tools.py:calculator"], "--tools no/such/tools.py:calculator: no such file"),
    (["--tools", "examples/tools/calculator.py", "--max-turns", "0"], "--max-turns must be >= 1"),
    (["--tools", "examples/tools/calculator.py", "--tool-timeout", "0"], "--tool-timeout must be > 0 seconds"),
    (
        ["--tools", "examples/tools/calculator.py", "--max-tool-response-length", "0"],
        "--max-tool-response-length must be >= 1",
    ),
    (["--max-turns", "3"], "--max-turns needs --tools"),
    (["--collective-timeout", "-5"], "--collective-timeout must be > 0 seconds"),
    # a call that may outlast the other ranks' patience: they stop the run while this rank waits, silent
    (
        ["--reward-fn", "reward.py", "--reward-timeout", "300", "--collective-timeout", "60"],
        "--reward-timeout (300) must be less than --collective-timeout (60)",
    ),
    (
        ["--tools", "examples/tools/calculator.py", "--tool-timeout", "30", "--collective-timeout", "30"],
        "--tool-timeout (30) must be less than --collective-timeout (30)",
    ),
    (["--loss-scale-factor", "-1"], "--loss-scale-factor must be > 0, or 0 for --max-response-length"),
    (["--reward-fn", "no/such.py:f"], "--reward-fn no/such.py:f: no such file 'no/such.py'"),
    (["--reward-fn", "reward.py", "--reward-fn", "no/such.py"], "--reward-fn no/such.py: no such file"),
    (
        ["--reward-fn", "reward.py", "--reward-weights", "1,2"],
        "--reward-weights 1,2: expected one number per --reward-fn (1 given)",
    ),
    (["--reward-weights", "nan"], "--reward-weights nan: expected one number per --reward-fn (0 given)"),
    (["--reward-errors", "ignore"], "invalid choice: 'ignore'"),
    (["--reward-model", "no/such/rm"], "--reward-model no/such/rm: no such directory"),
    (["--reward-model-weight", "inf"], "--reward-model-weight must be a finite number"),
    (["--reward-model-only"], "--reward-model-only needs --reward-model DIR"),
    (["--test-freq", "0"], "--test-freq must be >= 1, or -1 for never"),
    (["--val-temperature", "-1"], "--val-temperature must be >= 0"),
    (["--val-max-prompts", "0"], "--val-max-prompts must be >= 1, or -1 for all"),
    (["--val-n", "0"], "--val-n must be >= 1"),
    (["--early-stop-metric", "reward"], "--early-stop-metric reward: expected a validation metric"),
    (["--early-stop-metric", "val-core/x/reward/mean@1", "--test-freq", "-1"], "--early-stop-metric needs validation"),
    (["--early-stop-patience", "0"], "--early-stop-patience must be >= 1"),
    (
        ["--logger", "console,jsonl,tensorbord"],
        "--logger tensorbord: expected some of console, jsonl, wandb, tensorboard",
    ),
    (["--logger", "console,tensorboard"], "--logger console,tensorboard: jsonl is required"),
    (["--logger", "console,jsonl,wandb"], "--logger wandb needs --wandb-project NAME"),
    (["--wandb-project", "grpo-test"], "--wandb-project needs wandb in --logger"),
    (["--wandb-run-name", "run1"], "--wandb-run-name needs --wandb-project"),
    (["--save-freq", "0"], "--save-freq must be >= 1, or -1 for no checkpoints"),
    (["--max-ckpt-to-keep", "0"], "--max-ckpt-to-keep must be >= 1, or -1 for all"),
    (["--health-bands", "nope=1"], "--health-bands 'nope=1': expected name=value"),
    (["--resume", "no/such/global_step_3"], "--resume no/such/global_step_3: no such directory"),
    (["--compile-blocks", "--offload", "params"], "--compile-blocks with --offload params: not yet run together"),
    (
        ["--share-prompts", "--grad-checkpointing"],
        "--share-prompts needs the KV cache, which --grad-checkpointing drops",
    ),
    (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
    (
        ["--max-staleness", "1", "--no-engine-logprobs"],
        "--max-staleness and --rollout-ranks need the engine's log-probs",
    ),
    (["--rollout-ranks", "1"], "--rollout-ranks 1 leaves no trainer rank (WORLD_SIZE=1)"),
    (["--stream-rollouts"], "--stream-rollouts needs --rollout-ranks K >= 1 and --max-staleness S >= 1"),
    (["--stream-rollouts", "--rollout", "hf"], "--stream-rollouts needs the vLLM engine: drop --rollout hf"),
    (["--stream-rollouts", "--filter-groups"], "--stream-rollouts streams single-turn groups one by one"),
    (["--offload", "gpu"], "invalid choice: 'gpu'"),
    # the suite runs on CPUs: there, every offload is refused (tests/test_offload.py: with a GPU)
    (["--offload", "params"], "--offload params: it moves GPU memory to the CPU, and this machine has no CUDA GPU"),
    (["--offload", "optimizer"], "--offload optimizer: it moves GPU memory to the CPU"),
    # on-policy distillation (distill.py)
    (["--teacher", "t", "--distill-coef", "-1"], "--distill-coef must be >= 0"),
    (["--distill-coef", "0.5"], "--distill-coef needs --teacher DIR"),
    (["--teacher-prompt-key", "solution"], "--teacher-prompt-key needs --teacher DIR"),
    (["--no-reward"], "--no-reward (pure distillation) needs --teacher DIR"),
    (["--teacher", "t", "--no-reward", "--distill-coef", "0"], "--no-reward with --distill-coef 0 leaves no advantage"),
    (["--teacher", "self"], "--teacher self needs --teacher-prompt-key"),
    (["--curriculum-threshold", "1.5"], "--curriculum-threshold must be in [0, 1], got 1.5"),
    (["--curriculum", "--test-freq", "-1"], "--curriculum raises levels at validations: give --test-freq N >= 1"),
    (
        ["--curriculum", "--max-staleness", "1"],
        "--curriculum replaces rows at validations: not with rollouts made ahead",
    ),
    (
        ["--teacher", "t", "--teacher-prompt-key", "k", "--tools", "examples/tools/calculator.py"],
        "--teacher-prompt-key with --tools",
    ),
    (["--teacher", "t", "--distill-loss", "reverse_kl"], "invalid choice: 'reverse_kl'"),
    (["--teacher", "t", "--distill-topk", "0"], "--distill-topk must be >= 1"),
    (["--teacher", "t", "--distill-topk", "8"], "--distill-topk 8 needs --distill-loss forward_kl_topk"),
    (["--distill-loss", "k3"], "--distill-loss needs --teacher DIR"),
    (["--teacher", "t", "--distill-loss-clamp", "-1"], "--distill-loss-clamp must be > 0, or 0 for off"),
    (["--teacher", "t", "--distill-logp-clamp", "1"], "--distill-logp-clamp must be < 0, or 0 for off"),
    (["--teacher", "t", "--distill-logp-clamp", "-10"], "--distill-logp-clamp needs --distill-loss forward_kl_topk"),
    (["--teacher", "t", "--distill-clip", "1"], "--distill-clip must be in (0, 1), or 0 for off"),
    (["--teacher", "t", "--distill-loss", "k3", "--distill-clip", "0.2"], "--distill-clip is the k1 advantage's own"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_a_bad_flag_is_refused_by_name(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for model in ("tiny", "Qwen/Qwen2.5-0.5B-Instruct"):  # with and without the demo's overrides
        if "--model" in argv and model != "tiny":
            continue
        err = refused(cli.parse_args, ["--model", model, *argv], capsys)
        assert message in err, f"{argv}: expected {message!r} in:\n{err}"


# Fields with nothing to refuse: booleans.
FREE = {
    "norm_adv_by_std",
    "engine_logprobs",
    "grad_checkpointing",
    "val_before_train",
    "save_model",
    "async_save",
    "verbose",
    "filter_groups",
    "mask_truncated",
    "reward",  # its rules are BAD's --no-reward cases
    "engine_shares_policy",  # its rule is BAD's --no-engine-shares-policy case
    "cuda_graphs",  # a no-op off CUDA, so a command runs unchanged on both
    "system_prompt",  # any text; empty: none
}


def test_every_field_has_a_bad_case():
    """A new flag needs a rule (rule or one_of on its Args field, or one in check_args) and a line in BAD."""
    tested = {a.removeprefix("--").replace("-", "_") for argv, _ in BAD for a in argv if a.startswith("--")}
    missing = {f.name for f in dataclasses.fields(config.Args)} - FREE - tested
    assert not missing, f"no bad case in BAD for {sorted(missing)}"


def test_every_problem_is_reported_at_once(capsys):
    err = refused(cli.parse_args, ["--temperature", "0", "--group-size", "0", "--ppo-epochs", "0"], capsys)
    assert "--temperature" in err and "--group-size" in err and "--ppo-epochs" in err


def test_check_args_is_a_plain_function():
    """Build a config in code, check it yourself: [] when all is well, else one line per problem."""
    args = config.Args()
    assert config.check_args(args) == []
    assert config.check_args(dataclasses.replace(args, temperature=0.0, lr_schedule="cosin")) == [
        "--temperature must be > 0: sampling and the trainer's log-probs divide logits by it (greedy is --val-temperature 0), got 0.0",
        "--lr-schedule 'cosin': expected one of constant, cosine",
    ]


def test_a_reward_or_tool_call_must_end_before_the_other_ranks_stop_waiting():
    used = config.Args(reward_fn="reward.py:compute_score", tools="examples/tools/calculator.py")
    assert config.check_args(used) == []  # the defaults: 300 s and 10 s, under 600 s
    assert config.check_args(dataclasses.replace(used, reward_timeout=599.0, tool_timeout=599.0)) == []
    assert config.check_args(dataclasses.replace(used, reward_timeout=600.0, tool_timeout=900.0)) == [
        "--reward-timeout (600) must be less than --collective-timeout (600): while one --reward-fn call runs, "
        "the other ranks wait for this one and give up first; lower --reward-timeout or raise --collective-timeout",
        "--tool-timeout (900) must be less than --collective-timeout (600): while one --tools call runs, "
        "the other ranks wait for this one and give up first; lower --tool-timeout or raise --collective-timeout",
    ]
    # without --reward-fn (or --tools) nothing runs under that timeout: a short --collective-timeout is fine
    assert config.check_args(config.Args(collective_timeout=15.0)) == []


def test_batch_sizes_must_split_over_the_ranks(capsys, monkeypatch):
    # each rank takes prompt_batch_size / world prompts, mini_batch_size / world per optimizer step
    args = config.Args(prompt_batch_size=96, mini_batch_size=48)
    assert config.check_args(args, world=1) == [] and config.check_args(args, world=4) == []
    assert config.check_args(args, world=5) == [
        "--mini-batch-size (48) must be a multiple of the number of ranks (WORLD_SIZE=5)"
    ]
    monkeypatch.setenv("WORLD_SIZE", "5")  # as torchrun sets it
    err = refused(cli.parse_args, ["--prompt-batch-size", "96", "--mini-batch-size", "48"], capsys)
    assert "--mini-batch-size (48) must be a multiple of the number of ranks (WORLD_SIZE=5)" in err


# ----------------------------------------------------------------------------------------------
# train_grpo.py: the defaults, the demo, and every flag set used in the tests, README and benchmarks


def good_flag_sets(tmp):
    """(flags, ranks) as the project runs them; paths point at real (empty) files under tmp."""
    for name in ("train.parquet", "test.parquet", "reward.py"):
        (tmp / name).write_text("")
    data = ["--train-data", str(tmp / "train.parquet"), "--val-data", str(tmp / "test.parquet")]
    small = [
        *"--max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16".split()
    ]
    ckpt = [
        *"--max-steps 4 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16 --save-freq 1".split()
    ]
    bench = dict(
        model=str(tmp),
        train_data=str(tmp / "train.parquet"),
        val_data=str(tmp / "test.parquet"),
        out_dir=str(tmp / "out"),
        seed=0,
        rollout="hf",
        prompt_batch_size=16,
        group_size=8,
        max_prompt_length=32,
        max_response_length=32,
        max_steps=15,
        mini_batch_size=16,
        micro_batch_size=128,
        micro_batch_tokens=2048,
        ppo_epochs=1,
        lr=1e-6,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=0.0,
        grad_clip=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        kl_coef=0.0,
        entropy_coef=0.0,
        test_freq=-1,
        save_freq=-1,
        resume="never",
    )
    return [
        ([], 1),  # the demo
        (["--model", "Qwen/Qwen2.5-0.5B-Instruct", *data], 8),  # README: verl's defaults on 8 ranks
        ([*small, "--rollout", "vllm"], 2),
        (
            [
                *small,
                *"--rollout hf --ppo-epochs 2 --mini-batch-size 4 --micro-batch-size 8 --kl-coef 0.01 --tis-cap 2.0 --grad-checkpointing --lr-schedule cosine --warmup-steps 0 --min-lr-ratio 0.1 --val-n 2 --val-temperature 1.0 --logger console,jsonl,wandb --wandb-project grpo-test".split(),
            ],
            2,
        ),
        (
            [
                *small,
                *"--max-steps 5 --rollout hf --lr 0 --test-freq 1 --save-freq -1 --early-stop-metric val-core/synthetic/digits/reward/mean@1 --early-stop-patience 1".split(),
            ],
            1,
        ),
        (
            [
                *small,
                *"--max-steps 1 --rollout hf --no-val-before-train --test-freq -1 --save-freq -1 --no-engine-logprobs".split(),
            ],
            1,
        ),
        (
            [
                "--train-data",
                str(tmp / "train.parquet"),
                *"--max-steps 1 --prompt-batch-size 8 --mini-batch-size 8 --group-size 2 --test-freq -1".split(),
            ],
            1,
        ),
        (["--max-prompt-length", "5"], 1),
        *[(["--loss-mode", mode], 1) for mode in ("cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")],
        (["--loss-mode", "sapo", "--tau-pos", "2", "--tau-neg", "2.1"], 1),
        (["--loss-mode", "clip_cov", "--clip-cov-ratio", "0.01", "--clip-cov-lb", "0", "--clip-cov-ub", "1"], 1),
        (["--loss-mode", "kl_cov", "--kl-cov-ratio", "0.01", "--ppo-kl-coef", "1"], 1),
        (["--lr", "0.05", "--max-steps", "10", "--test-freq", "5", "--val-max-prompts", "64", "--save-freq", "-1"], 1),
        ([*ckpt, "--rollout", "hf", "--max-ckpt-to-keep", "2", "--async-save"], 2),
        ([*ckpt, "--rollout", "hf", "--resume", "never", "--max-steps", "5"], 1),
        (
            [
                "--model",
                str(tmp),
                *data,
                "--reward-fn",
                str(tmp / "reward.py"),
                *"--max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --max-response-length 16 --test-freq 2 --val-max-prompts 8 --lr 1e-3 --save-freq -1".split(),
            ],
            2,
        ),
        (
            [
                "--model",
                str(tmp),
                *data,
                *"--rollout vllm --max-steps 2 --prompt-batch-size 24 --mini-batch-size 24 --group-size 2 --max-response-length 8 --kl-coef 0 --lr 1e-5 --test-freq 2 --val-max-prompts 8 --save-freq -1".split(),
            ],
            1,
        ),
        (
            [
                "--model",
                str(tmp),
                *data,
                *"--prompt-batch-size 8 --mini-batch-size 8 --group-size 8 --max-prompt-length 128 --max-response-length 32 --kl-coef 0 --lr 1e-5 --epochs 2 --test-freq 3".split(),
            ],
            1,
        ),  # README's SmolLM2 example
        (
            [
                "--model",
                str(tmp),
                *data,
                *"--prompt-batch-size 8 --mini-batch-size 8 --group-size 8 --max-prompt-length 256 --max-response-length 32 --kl-coef 0 --lr 2e-5 --test-freq 5 --dtype auto".split(),
            ],
            1,
        ),  # README's reasoning-gym example
        (
            [*data, "--curriculum", "--curriculum-threshold", "0", "--test-freq", "1", "--rollout", "hf"],
            2,
        ),  # test_curriculum
        (
            [f"--{k.replace('_', '-')}={v}" for k, v in bench.items()]
            + ["--no-val-before-train", "--no-save-model", "--no-engine-logprobs"],
            1,
        ),
    ]


def test_the_project_s_own_flag_sets_pass(tmp_path, monkeypatch):
    assert config.check_args(config.Args(), world=8) == []  # verl's defaults, before the demo's
    for flags, ranks in good_flag_sets(tmp_path):
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        cli.parse_args(flags)  # exits on any problem


def test_no_abbreviations_so_the_demo_cannot_swallow_a_flag(capsys):
    assert cli.parse_args(["--max-steps", "5"]).max_steps == 5
    assert cli.parse_args(["--max-steps=5"]).max_steps == 5
    refused(cli.parse_args, ["--max-st", "5"], capsys)


def test_a_bad_flag_fails_before_anything_loads(tmp_path):
    """The real script: a bad flag next to a model that does not exist. The flag must be what is
    reported, nothing may be written, and it takes seconds (importing torch), not an engine load."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train_grpo.py",
        "--model",
        str(tmp_path / "no_such_model"),
        "--out-dir",
        str(out),
        "--temperature",
        "0",
    ]
    t = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "1"}
    )
    took = time.perf_counter() - t
    assert proc.returncode == 2 and "--temperature must be > 0" in proc.stderr, proc.stderr[-2000:]
    assert "no such directory" not in proc.stderr and not out.exists()
    assert took < 60, f"{took:.0f}s: something heavy ran before the flags were checked"


# ----------------------------------------------------------------------------------------------
# eval.py: the same, for the standalone evaluator (greedy is allowed there: temperature 0)

EVAL_BAD = [
    (["--n", "0"], "--n/--samples must be >= 1"),
    (["--samples", "0"], "--n/--samples must be >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-prompts", "0"], "--max-prompts must be >= 1, or -1 for all"),
    (["--rollout", "sglang"], "argument --rollout: invalid choice: 'sglang'"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--sample", "4"], "unrecognized arguments: --sample 4"),  # no abbreviations
]


@pytest.mark.parametrize("argv, message", EVAL_BAD, ids=[" ".join(argv) for argv, _ in EVAL_BAD])
def test_eval_refuses_a_bad_flag_before_loading(argv, message, capsys):
    # neither the model nor the data exists: the flag must be what fails, before either is read
    err = refused(evaluate.main, ["--model", "no/such/model", "--data", "no/such/test.parquet", *argv], capsys)
    assert message in err, f"{argv}: expected {message!r} in:\n{err}"


def test_eval_report_takes_no_abbreviations(capsys):
    err = refused(evaluate.main, ["report", "no/such/run", "--band", "kl_max=0.1"], capsys)
    assert "unrecognized arguments: --band" in err


def test_help_documents_every_field():
    proc = subprocess.run(
        [sys.executable, "train_grpo.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    docs = cli.field_docs(config.Args)
    for f in dataclasses.fields(config.Args):
        assert f.name in docs, f"Args.{f.name} has no docstring"
        assert "--" + f.name.replace("_", "-") in proc.stdout


def test_demo_overrides_apply_only_to_the_tiny_model_and_yield_to_flags():
    demo = cli.parse_args([])
    assert demo.lr == config.DEMO_OVERRIDES["lr"]
    assert cli.parse_args(["--lr", "1e-3"]).lr == 1e-3
    real = cli.parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct"])
    assert real.lr == 1e-6 and real.kl_coef == 0.001 and real.loss_agg == "token-mean" and real.clip_low == 0.2
    # the demo's cosine floor goes with its schedule: another schedule, chosen on the command line, takes none
    assert (demo.lr_schedule, demo.min_lr_ratio) == ("cosine", config.DEMO_OVERRIDES["min_lr_ratio"])
    constant = cli.parse_args(["--lr-schedule", "constant"])
    assert (constant.lr_schedule, constant.min_lr_ratio) == ("constant", 0.0)
    assert cli.parse_args(["--min-lr-ratio", "0.2"]).min_lr_ratio == 0.2


def test_grad_checkpointing_turns_shared_prompts_off_unless_asked_for(monkeypatch):
    """Checkpointed layers drop the KV cache that shared prompts need: --grad-checkpointing alone turns
    them off (and the resolved config says so); asking for both is refused (BAD above)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.parse_args(["--model", "m"]).share_prompts is True
    assert cli.parse_args(["--model", "m", "--grad-checkpointing"]).share_prompts is False
    assert cli.parse_args(["--model", "m", "--no-share-prompts"]).share_prompts is False


def test_what_tensor_parallelism_cannot_do_right_is_refused_by_name():
    """--tensor-parallel-size T: T consecutive ranks share one vLLM engine and must send it the same requests."""
    ok = config.Args(prompt_batch_size=8, mini_batch_size=8, tensor_parallel_size=2, rollout="vllm")
    assert config.check_args(ok, world=2) == [] and config.check_args(ok, world=4) == []
    odd = dataclasses.replace(ok, prompt_batch_size=6, mini_batch_size=6, tensor_parallel_size=4)
    assert config.check_args(odd, world=6) == [
        "--tensor-parallel-size 4 must divide the number of ranks (WORLD_SIZE=6)"
    ]
    for change, message in [
        (dict(rollout="hf"), "--tensor-parallel-size > 1 is vLLM's: drop --rollout hf"),
        (dict(engine_logprobs=False), "--tensor-parallel-size > 1 needs the engine's log-probs"),
        (dict(rollout_ranks=1), "--rollout-ranks: each rollout rank runs a whole engine; use --tensor-parallel-size 1"),
    ]:
        problems = config.check_args(dataclasses.replace(ok, **change), world=4)
        assert any(p.startswith(message) for p in problems), problems


def test_the_choices_of_a_flag_are_exactly_what_the_code_consumes():
    """config.py lists each fixed set of values itself (it imports no feature module), so a mode added to
    loss.py or advantage.py must be added to its flag too: --help and check_args read the list here."""
    import advantage
    import loss

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(config.Args) if "choices" in f.metadata}
    assert choices["loss_mode"] == loss.LOSS_MODES
    assert choices["loss_agg"] == loss.AGG_MODES
    assert choices["kl_kind"] == tuple(loss.KL_KINDS)
    assert set(choices["distill_loss"]) == set(loss.DISTILL_LOSSES)
    assert choices["adv_estimator"] == advantage.ADV_ESTIMATORS
