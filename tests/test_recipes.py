"""Recipes: --config FILE (our flags by name, a run's config.json, TRL's GRPOConfig YAML) and verl's key=value, read
into the run's flags before anything loads (recipe.py, verl_keys.py, trl_fields.py).

- verl's GRPO example scripts (tests/recipes_peers/*.sh, verl's examples/grpo_trainer/ as of commit b178a3cd5 of
  volcengine/verl, 2026-01-29, the newest we could read; the three scripts last changed in 25d78fa, 2025-09-25)
  resolve key by key to what verl 0.9.1's config means, with what a CPU needs appended; and run 2 steps on SmolLM2 and
  GSM8K (slow).
- open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml (tests/recipes_peers/, open-r1 commit 1416fa0) the
  same through --config, its model, dataset and reward functions pointed at local ones.
- Every table key is verl 0.9.1's (with its default) or TRL 1.16.0's (every GRPOConfig field is read or named), where
  their code is in .verl_ref/ and .trl_ref/ (install.sh --dev); and every key is in docs/from_verl_trl.md.
- Bad input ends in an error that names the key and the file, from parse_args, before anything loads.
- Every file in recipes/ runs one step (slow).
"""

import dataclasses
import glob
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
from conftest import GSM8K_DIR, REPO, metrics, need, run_script

import cli
import recipe
import trl_fields
import verl_keys
from config import Args

PEERS = os.path.join(REPO, "tests", "recipes_peers")
SCRIPTS = ("run_qwen2-7b.sh", "run_qwen2_5-3b_gsm8k_grpo_lora.sh", "run_deepseek7b_llm.sh")
DEFAULTS = dataclasses.asdict(Args())


def refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def script_keys(name):
    """A verl script's key=value arguments, as bash passes them to verl.trainer.main_ppo (before its $@)."""
    text = open(os.path.join(PEERS, name)).read().split("$@")[0]
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    return words[words.index("verl.trainer.main_ppo") + 1 :]


def cpu_keys(model, train, val, out_dir):
    """What a CPU needs appended to verl's command: paths, one rank, no tensor parallelism, one prompt a step,
    2 steps, no wandb."""
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "trainer.total_training_steps=2",
        "trainer.logger=console",
        f"trainer.default_local_dir={out_dir}",
    ]


def files(tmp_path):
    for name in ("model", "train.parquet", "val.parquet"):
        (tmp_path / name).touch()
    return str(tmp_path / "model"), str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet")


# what each script means, flag by flag, beside ours (with the CPU keys above); every other flag keeps our default
VERL_MEANS = dict(
    max_prompt_length=512,  # data.max_prompt_length (filter_overlong_prompts=True: we always drop longer ones)
    max_response_length=1024,  # data.max_response_length
    lr=1e-6,  # actor_rollout_ref.actor.optim.lr
    micro_batch_size=40,  # ppo_micro_batch_size_per_gpu: sequences per rank, both
    kl_coef=0.001,  # use_kl_loss=True, kl_loss_coef=0.001
    kl_kind="low_var_kl",  # kl_loss_type
    entropy_coef=0.0,  # entropy_coeff=0
    grad_checkpointing=True,  # enable_gradient_checkpointing=True
    share_prompts=False,  # derived: checkpointed layers drop the KV cache
    rollout="vllm",  # rollout.name
    gpu_memory_utilization=0.6,
    group_size=5,  # rollout.n
    adv_estimator="grpo",
    save_freq=20,
    test_freq=5,
    epochs=15,  # trainer.total_epochs
    dtype="bf16",  # verl's default: fsdp_config.dtype bfloat16, its master weights fp32, rollout.dtype bfloat16
    prompt_batch_size=1,  # appended data.train_batch_size (prompts)
    mini_batch_size=1,  # appended ppo_mini_batch_size (prompts)
    tensor_parallel_size=1,  # appended
    max_steps=2,  # appended trainer.total_training_steps
    logger="console,jsonl",  # appended trainer.logger=console; jsonl always
)
SCRIPT_MEANS = {
    "run_qwen2-7b.sh": {},
    "run_qwen2_5-3b_gsm8k_grpo_lora.sh": dict(lr=3e-6, lora_rank=64, lora_alpha=32.0, val_before_train=False),
    "run_deepseek7b_llm.sh": dict(micro_batch_size=80),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_verl_script_resolves_key_by_key_to_what_verl_means(script, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, train, val = files(tmp_path)
    args = cli.parse_args(script_keys(script) + cpu_keys(model, train, val, str(tmp_path / "run")))
    paths = dict(model=model, train_data=train, val_data=val, out_dir=str(tmp_path / "run"))
    assert dataclasses.asdict(args) == {**DEFAULTS, **VERL_MEANS, **SCRIPT_MEANS[script], **paths}
    out = " ".join(capsys.readouterr().out.split())  # the lines are wrapped at 120
    assert "group_size=5 <- actor_rollout_ref.rollout.n" in out  # which key set each flag
    assert "kl_coef=0.001 <- actor_rollout_ref.actor.use_kl_loss, actor_rollout_ref.actor.kl_loss_coef" in out
    assert "verl 0.9.1's defaults, for keys the recipe leaves out" in out and "dtype='bf16'" in out
    assert "actor_rollout_ref.ref.fsdp_config.param_offload" in out  # no effect on a CPU, named
    assert "trainer.critic_warmup" in out and "algorithm.use_kl_in_reward" in out


def test_verl_keys_given_again_later_replace_and_verl_defaults_fill_the_rest(tmp_path, capsys):
    model, train, val = files(tmp_path)
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}"]
    base += ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n=6"]
    base += ["actor_rollout_ref.rollout.tensor_model_parallel_size=1", "data.train_batch_size=8"]
    args = cli.parse_args(base + ["actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert args.group_size == 6  # the later one
    # verl 0.9.1's defaults where they differ from ours: no KL loss, 30 epochs, 512 response tokens, no
    # validation or checkpoints, gradient checkpointing, bf16, its loggers (console, wandb) and run directory
    assert (args.kl_coef, args.epochs, args.max_response_length, args.test_freq, args.save_freq) == (0, 30, 512, -1, -1)
    assert (args.grad_checkpointing, args.dtype, args.logger) == (True, "bf16", "console,jsonl,wandb")
    assert (args.wandb_project, args.wandb_run_name) == ("verl_examples", "gsm8k")
    assert args.out_dir == "checkpoints/verl_examples/gsm8k"
    assert "trainer.total_epochs" in capsys.readouterr().out
    # our flag on the command line wins over verl's default, and sets nothing twice
    assert cli.parse_args(base + ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "--epochs", "2"]).epochs == 2


def test_verl_offload_keys_on_a_gpu_and_on_a_cpu():
    """On a GPU, verl's param_offload and optimizer_offload are --offload's; the reference's alone cannot be honoured
    (ours offloads it with the policy's) and is refused by name. On a CPU the three have no effect, named."""
    keys = [f"{verl_keys.A}fsdp_config.param_offload=True", f"{verl_keys.A}fsdp_config.optimizer_offload=True"]
    ref, grpo = f"{verl_keys.REF}fsdp_config.param_offload=True", ["algorithm.adv_estimator=grpo", f"{verl_keys.R}n=4"]
    keys, ref = [*grpo, *keys], [*grpo, ref]
    assert recipe.read("", keys + ref, {}, cuda=True).values["offload"] == "both"
    assert recipe.read("", grpo + keys[3:], {}, cuda=True).values["offload"] == "optimizer"
    with pytest.raises(
        recipe.RecipeError, match=r"the command line: actor_rollout_ref.ref.fsdp_config.param_offload=True: ours"
    ):
        recipe.read("", ref, {}, cuda=True)
    on_cpu = recipe.read("", keys + ref, {}, cuda=False)
    assert "offload" not in on_cpu.values and "a CPU run keeps everything in CPU memory already" in " ".join(
        on_cpu.lines
    )


def test_verl_keys_in_a_yaml_file_nested_or_dotted(tmp_path):
    model, train, val = files(tmp_path)
    (tmp_path / "verl.yaml").write_text(
        f"actor_rollout_ref:\n  model:\n    path: {model}\n  rollout:\n    n: 4\n    tensor_model_parallel_size: 1\n"
        f"  actor.ppo_mini_batch_size: 8\nalgorithm.adv_estimator: rloo\ndata:\n  train_files: [{train}]\n"
        f"  val_files: {val}\n  train_batch_size: 16\n"
    )
    args = cli.parse_args(["--config", str(tmp_path / "verl.yaml"), "actor_rollout_ref.rollout.n=8"])
    assert (args.group_size, args.adv_estimator, args.prompt_batch_size, args.mini_batch_size) == (8, "rloo", 16, 8)
    assert args.train_data == train


# ----------------------------------------------------------------------------------------------
# TRL


def open_r1_copy(tmp_path, model, **changes):
    """open-r1's config_demo.yaml with its model, dataset and reward functions pointed at local ones (and any
    `changes`, field: YAML text), and a local dataset shaped as OpenR1-Math-220k: GSM8K's first 24 questions as
    `problem`, their answers as `solution`, and no prompt column: the recipe's system_prompt and
    dataset_prompt_column make each prompt, as open-r1's script does."""
    import yaml

    need(GSM8K_DIR)
    text = open(os.path.join(PEERS, "config_demo.yaml")).read()
    system = yaml.safe_load(text)["system_prompt"]
    data = tmp_path / "openr1_math"
    data.mkdir()
    with open(os.path.join(GSM8K_DIR, "train.jsonl")) as f, open(data / "train.jsonl", "w") as out:
        for line in list(f)[:24]:
            row = json.loads(line)
            problem, solution = row["question"], row["answer"].split("####")[-1].strip()
            out.write(json.dumps(dict(problem=problem, solution=solution)) + "\n")
    rewards = "\n".join(f"- tests.openr1_style_rewards.{f}_reward" for f in ("accuracy", "format", "tag_count"))
    text = text.replace("Qwen/Qwen2.5-1.5B-Instruct", model).replace("open-r1/OpenR1-Math-220k", str(data))
    text = text.replace("- accuracy\n- format\n- tag_count", rewards)
    text = text.replace("report_to:\n- wandb", f"report_to: {changes.pop('report_to', '[wandb]')}")
    for field, value in changes.items():  # one line each
        start = text.index(f"\n{field}:") + 1
        text = text[:start] + f"{field}: {value}" + text[text.index("\n", start) :]
    (tmp_path / "config_demo.yaml").write_text(text)
    return str(tmp_path / "config_demo.yaml"), data, system


@pytest.mark.parametrize("world", [1, 2])
def test_open_r1s_config_demo_resolves_field_by_field(world, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    config, data, system = open_r1_copy(tmp_path, str(tmp_path))
    args = cli.parse_args(["--config", config])
    rewards = ",".join(f"tests/openr1_style_rewards.py:{f}_reward" for f in ("accuracy", "format", "tag_count"))
    prompts = (
        16 * world * 4 // 16
    )  # per_device_train_batch_size x ranks x gradient_accumulation_steps / num_generations
    expected = dict(
        model=str(tmp_path),
        train_data=str(data / "train.jsonl"),
        prompt_column="problem",  # dataset_prompt_column: each prompt is [system_prompt, the row's problem]
        system_prompt=system,
        val_data=str(data / "train.jsonl"),  # eval_strategy no: never read for validation
        reward_fn=rewards,
        reward_weights="1.0,1.0,1.0",
        out_dir="data/Qwen2.5-1.5B-Open-R1-GRPO",
        resume="never",  # TRL starts afresh
        dtype="bf16",  # bf16: true, torch_dtype: bfloat16
        prompt_batch_size=prompts,
        mini_batch_size=prompts,  # steps_per_generation = gradient_accumulation_steps: one update a step
        micro_batch_size=16,
        group_size=16,
        lr=2e-5,
        lr_schedule="cosine",
        warmup_steps=math.ceil(0.1 * (24 // prompts)),  # warmup_ratio 0.1 of the run's steps: 1 epoch of 24 rows
        grad_checkpointing=True,
        share_prompts=False,
        seed=42,
        max_response_length=1024,
        max_prompt_length=512,
        rollout="vllm",  # use_vllm
        gpu_memory_utilization=0.3,  # TRL's vllm_gpu_memory_utilization default
        kl_coef=0.0,  # TRL's beta default
        weight_decay=0.0,  # TRL's default
        test_freq=-1,
        val_before_train=False,  # eval_strategy no
        save_freq=24 // prompts,  # save_strategy epoch: an epoch's steps
        max_ckpt_to_keep=1,
        logger="console,jsonl,wandb",
        wandb_project="huggingface",  # TRL's project default
    )
    assert dataclasses.asdict(args) == {**DEFAULTS, **expected}
    out = " ".join(capsys.readouterr().out.split())  # the lines are wrapped at 120
    assert "prompt_batch_size=" in out and "per_device_train_batch_size, gradient_accumulation_steps" in out
    assert "vllm_importance_sampling_mode" in out  # TRL's default correction: named, not applied
    assert "push_to_hub" in out and "overwrite_output_dir" in out  # no effect, named


def test_trl_batch_sizes_and_steps_convert_by_meaning(tmp_path, monkeypatch):
    """4 completions per device, 2 ranks, accumulation 2, a generation every 4 micro-steps, 4 samples a prompt, 2
    iterations: 32 completions (8 prompts) a generation, 16 (4 prompts) per optimizer step, 2 x 2 = 4 of TRL's
    optimizer steps in each of ours."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(dict(prompt=f"q{i}")) + "\n" for i in range(64)))
    (tmp_path / "trl.yaml").write_text(
        f"model_name_or_path: {tmp_path}\ndataset_name: {tmp_path}\nper_device_train_batch_size: 4\n"
        "gradient_accumulation_steps: 2\nsteps_per_generation: 4\nnum_generations: 4\nnum_iterations: 2\n"
        "max_steps: 100\nwarmup_steps: 10\nsave_steps: 50\nlr_scheduler_type: constant_with_warmup\n"
        "learning_rate: 1e-6\nepsilon_high: 0.28\nloss_type: dr_grpo\nscale_rewards: none\ntop_k: 0\n"
    )
    args = cli.parse_args(["--config", str(tmp_path / "trl.yaml")])
    assert (args.prompt_batch_size, args.mini_batch_size, args.micro_batch_size) == (8, 4, 4)
    assert (args.group_size, args.ppo_epochs) == (4, 2)
    assert (args.max_steps, args.warmup_steps, args.save_freq) == (25, 3, 13)  # ceil(n / 4)
    assert args.lr == 1e-6  # learning_rate: 1e-6, which YAML reads as text
    assert (args.clip_low, args.clip_high, args.loss_agg, args.norm_adv_by_std) == (
        0.2,
        0.28,
        "seq-mean-token-sum-norm",
        False,
    )
    assert (args.top_k, args.rollout, args.lr_schedule, args.epochs) == (-1, "hf", "constant", 3)


def test_trl_reward_funcs(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(json.dumps(dict(prompt="q", solution="1")) + "\n")
    base = f"model_name_or_path: {tmp_path}\ndataset_name: {tmp_path}\nlr_scheduler_type: constant\n"
    for funcs, expected in (
        ("[accuracy]", "open-r1's registry: use --reward-fn path/to/open_r1/rewards.py:accuracy_reward"),
        ("[think_format_reward]", "TRL's registry: use --reward-fn trl.rewards:think_format_reward"),
        ("[accuracy_of]", "expected a dotted import path"),
    ):
        (tmp_path / "trl.yaml").write_text(base + f"reward_funcs: {funcs}\n")
        err = refused(["--config", str(tmp_path / "trl.yaml")], capsys)
        assert f"{tmp_path / 'trl.yaml'}: reward_funcs=" in err and expected in err, err
    (tmp_path / "trl.yaml").write_text(base + "reward_funcs: [tests.openr1_style_rewards.format_reward, my.mod.f]\n")
    args = cli.parse_args(["--config", str(tmp_path / "trl.yaml")])
    assert args.reward_fn == "tests/openr1_style_rewards.py:format_reward,my.mod:f"  # a file under the current dir


# ----------------------------------------------------------------------------------------------
# our own recipes


def test_a_recipe_file_is_the_flags_as_if_typed(tmp_path, capsys):
    for name in sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml"))):
        if "model:" in open(name).read() and "model: tiny" not in open(name).read():
            continue  # real models: their paths are checked when they run (test_each_recipe_runs_one_step)
        import yaml

        values = {k.replace("_", "-"): v for k, v in (yaml.safe_load(open(name)) or {}).items()}
        flags = [f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k}={v}" for k, v in values.items()]
        typed = dataclasses.asdict(cli.parse_args(flags))
        assert dataclasses.asdict(cli.parse_args(["--config", name])) == typed, name
    # the demo's overrides and the derived defaults follow the file's flags, as if typed
    (tmp_path / "r.yaml").write_text("lr: 1.0e-3\ngrad_checkpointing: true\n")
    args = cli.parse_args(["--config", str(tmp_path / "r.yaml")])
    assert (args.lr, args.group_size, args.share_prompts) == (1e-3, 16, False)  # the file's lr, the demo's n
    assert cli.parse_args(["--config", str(tmp_path / "r.yaml"), "--lr", "2e-3"]).lr == 2e-3  # the flag wins
    assert "--lr 0.002 (the command line) wins over" in capsys.readouterr().out


def test_a_runs_config_json_is_a_recipe_for_a_new_run(tmp_path, capsys):
    old = dataclasses.asdict(Args(lr=5e-4, group_size=4, out_dir="runs/old", resume="never"))
    (tmp_path / "config.json").write_text(json.dumps(old))
    args = cli.parse_args(["--config", str(tmp_path / "config.json"), "--kl-coef", "0.01"])
    assert (args.lr, args.group_size, args.kl_coef) == (5e-4, 4, 0.01)
    assert (args.out_dir, args.resume) == ("runs/grpo", "auto")  # a new run's own
    assert "not taken from" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "text, name, argv, said",
    [
        (
            "kl_coeff: 0.01\ngroup_size: 4\n",
            "r.yaml",
            [],
            ["r.yaml: kl_coeff: not one of our flags", "did you mean kl_coef?"],
        ),
        ("lr: fast\n", "r.yaml", [], ["r.yaml: lr=fast: expected a number"]),
        ("group_size: 1\n", "r.yaml", [], ["r.yaml: group_size gives --group-size 1; it must be >= 2"]),
        ("loss_mode: ppo\n", "r.yaml", [], ["r.yaml: loss_mode gives --loss-mode ppo; it must be one of vanilla"]),
        ("lr: [1, 2\n", "r.yaml", [], ["r.yaml: not valid YAML"]),
        ('{"lr": 1e-5,}', "r.json", [], ["r.json: not valid JSON"]),
        ("lr = 1e-5\n", "r.toml", [], ["--config", "r.toml: neither YAML (.yaml, .yml) nor JSON (.json)"]),
        ("python3 -m verl.trainer.main_ppo\n", "run.sh", [], ["run.sh: neither YAML", "a verl script"]),
        ("learning_rate: 1.0e-5\nnum_generation: 4\n", "r.yaml", [], ["num_generation: not one", "num_generations?"]),
        (
            "learning_rate: 1.0e-5\nnum_generations: four\n",
            "r.yaml",
            [],
            ["r.yaml: num_generations=four: expected an integer"],
        ),  # fmt: skip
        (
            "learning_rate: 1.0e-5\ngroup_size: 4\n",
            "r.yaml",
            [],
            ["mixes TRL's fields (learning_rate) and our flags (group_size)"],
        ),  # fmt: skip
        (
            "lr: 1.0e-5\nactor_rollout_ref.actor.optim.lr: 2.0e-5\n",
            "r.yaml",
            [],
            ["r.yaml: lr (= 1e-05) and", "r.yaml: actor_rollout_ref.actor.optim.lr (= 2e-05) set --lr to two values"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["actor_rollout_ref.actor.optim.lrr=1e-5"],
            ["the command line: actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr?"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=four"],
            ["actor_rollout_ref.rollout.n=four: expected an integer"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["actor_rollout_ref.actor.optim.lr=1e-5", "--lr", "2e-5"],
            ["actor_rollout_ref.actor.optim.lr (= 1e-05) and --lr 2e-05, both on the command line"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["actor_rollout_ref.rollout.n=4"],
            ["algorithm.adv_estimator=gae: GAE needs a critic", "verl 0.9.1's default"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["algorithm.use_kl_in_reward=True"],
            ["the command line: algorithm.use_kl_in_reward=True: the KL is a loss here"],
        ),  # fmt: skip
        (
            "",
            "r.yaml",
            ["chain_sum.max_terms=3"],
            ["chain_sum.max_terms=3: not one of verl's keys", "data_prep.py reasoning-gym --config"],
        ),  # fmt: skip
    ],
)
def test_bad_input_names_the_key_and_the_file(text, name, argv, said, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(text)
    err = refused((["--config", str(path)] if text else []) + argv, capsys)
    for words in said:
        assert words in err, err


def test_a_reasoning_gym_setting_given_to_config_says_where_it_belongs(capsys):
    err = refused(["--config", "chain_sum.max_terms=3"], capsys)
    assert "not a file" in err and "data_prep.py reasoning-gym --config" in err


# ----------------------------------------------------------------------------------------------
# the tables against verl's and TRL's own code, and the docs


def test_every_verl_key_is_verl_0_9_1s_with_its_default():
    ref = os.path.join(REPO, ".verl_ref", "verl", "trainer", "config", "_generated_ppo_trainer.yaml")
    if not os.path.isfile(ref):
        pytest.skip(f"verl's config is not in {ref} (bash install.sh --dev puts it there)")
    import yaml

    config = recipe.flatten(yaml.safe_load(open(ref)))
    for key, (default, _) in verl_keys.KEYS.items():
        if key == "actor_rollout_ref.rollout.name":
            assert config[key] == "???"  # verl's: a command must set it
        else:
            assert key in config and config[key] == default, (key, config.get(key, "missing"), default)
    missing = [k for k in verl_keys.NO_EFFECT if k not in config]
    assert not missing, missing


def test_every_trl_field_is_read_or_named_with_trl_1_16s_default():
    ref = os.path.join(REPO, ".trl_ref")
    if not os.path.isdir(os.path.join(ref, "trl")):
        pytest.skip(f"TRL's code is not in {ref} (bash install.sh --dev puts it there)")
    sys.path.insert(0, ref)
    try:
        from trl import GRPOConfig, ModelConfig, ScriptArguments
    finally:
        sys.path.remove(ref)
    known = set(trl_fields.KEYS) | set(trl_fields.NO_EFFECT)
    for cls in (GRPOConfig, ModelConfig, ScriptArguments):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert not set(fields) - known, (cls.__name__, set(fields) - known)
        for name, (default, _) in trl_fields.KEYS.items():
            if name in fields and fields[name].default is not dataclasses.MISSING:
                assert fields[name].default == default, (name, fields[name].default, default)


def test_docs_table_has_every_key():
    text = open(os.path.join(REPO, "docs", "from_verl_trl.md")).read()
    keys = {k for rule in verl_keys.rules() + trl_fields.rules() for k in rule.keys}
    keys |= set(verl_keys.NO_EFFECT) | set(trl_fields.NO_EFFECT)
    assert not [k for k in keys if f"`{k}`" not in text and k not in text]


# ----------------------------------------------------------------------------------------------
# end to end


@pytest.fixture(scope="module")
def gsm8k_small(tmp_path_factory):
    """GSM8K's first 16 training and 2 test rows in verl's schema."""
    import pyarrow.parquet as pq

    import data_prep

    need(GSM8K_DIR)
    out = tmp_path_factory.mktemp("gsm8k_small")
    data_prep.main(["gsm8k", "--input", GSM8K_DIR, "--out", str(out)])
    for name, rows in (("train", 16), ("test", 2)):
        pq.write_table(pq.read_table(out / f"{name}.parquet").slice(0, rows), out / f"{name}.parquet")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS[:2])  # run_deepseek7b_llm.sh: run_qwen2-7b.sh's keys, other sizes
def test_a_verl_script_runs_two_steps_on_smollm2_and_gsm8k(script, tmp_path, smollm2_model, gsm8k_small):
    out = str(tmp_path / "run")
    keys = cpu_keys(smollm2_model, gsm8k_small / "train.parquet", gsm8k_small / "test.parquet", out)
    run_script(*script_keys(script), *keys)
    rows = metrics(out)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert json.load(open(os.path.join(out, "config.json")))["group_size"] == 5


@pytest.mark.slow
def test_open_r1s_config_demo_runs_two_steps(tmp_path, smollm2_model):
    """Pointed at SmolLM2 and a local dataset, with a CPU's batch (4 completions of 1 prompt a step), 2 steps, no
    wandb and a run directory of its own."""
    out = str(tmp_path / "run")
    changes = dict(per_device_train_batch_size="4", gradient_accumulation_steps="1", num_generations="4")
    changes.update(max_steps="2", output_dir=out, report_to="[none]")
    config, _, _ = open_r1_copy(tmp_path, smollm2_model, **changes)
    run_script("--config", config)
    rows = metrics(out)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert "rewards/accuracy_reward/mean" in rows[-1]


def real_model_flags(name, tmp_path, smollm2_model, gsm8k_small):
    """What each real-model recipe needs here: the model and data its README command prepares, made in tmp_path,
    and a CPU's batch."""
    import data_prep

    small = ["--prompt-batch-size", "2", "--mini-batch-size", "2", "--group-size", "2", "--micro-batch-size", "4"]
    data = tmp_path / "data"
    if name in ("smollm2_multiply", "opd_smollm2"):
        data_prep.main(["multiply", "--out", str(data)])
    elif name == "smollm2_calculator":
        data_prep.main(["multiply", "--digits", "3x2", "--shots", "2", "--out", str(data)])
    elif name == "smollm2_chain_sum":
        args = "--task chain_sum --level 0 --shots 2 --system-prompt direct --size 16 --test-size 4".split()
        data_prep.main(["reasoning-gym", *args, "--out", str(data)])
    else:  # qwen_gsm8k: SmolLM2 for the 0.5B Qwen, which is not here
        data = gsm8k_small
        small += ["--max-response-length", "64"]
    flags = ["--model", smollm2_model, "--train-data", str(data / "train.parquet"), "--val-data", str(data / "test.parquet")]  # fmt: skip
    return flags + small + (["--teacher", smollm2_model] if name == "opd_smollm2" else [])


RECIPES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
DEMO_RECIPES = [
    n for n in RECIPES if n == "demo" or "model:" not in open(os.path.join(REPO, "recipes", f"{n}.yaml")).read()
]
ONE_STEP = ["--max-steps", "1", "--test-freq", "-1", "--no-val-before-train", "--save-freq", "-1", "--no-save-model",
            "--rollout", "hf"]  # fmt: skip

# train_grpo.main once per recipe, in one process: each run its own flags, its own process group and run directory
IN_ONE_PROCESS = """
import json, sys
import train_grpo
for argv in json.loads(sys.argv[1]):
    sys.argv = ["train_grpo.py", *argv]
    print("recipe:", argv[1], flush=True)
    train_grpo.main()
"""


@pytest.mark.slow
def test_each_demo_recipe_runs_one_step(tmp_path):
    """Every recipe file of the demo (the GRPO family on the digits task) trains one step: one process runs them in
    turn, so the imports are paid once, not once per recipe."""
    runs = {n: str(tmp_path / n) for n in DEMO_RECIPES}
    argv = [["--config", os.path.join(REPO, "recipes", f"{n}.yaml"), "--out-dir", runs[n], *ONE_STEP] for n in runs]
    done = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS, json.dumps(argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert len(runs) >= 14
    for name, out in runs.items():
        assert [r["step"] for r in metrics(out) if r["step"] > 0] == [1], name


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RECIPES if n not in DEMO_RECIPES])
def test_each_real_model_recipe_runs_one_step(name, tmp_path, smollm2_model, gsm8k_small):
    path = os.path.join(REPO, "recipes", f"{name}.yaml")
    flags = ["--config", path, "--out-dir", str(tmp_path / "run"), *ONE_STEP]
    run_script(*flags, *real_model_flags(name, tmp_path, smollm2_model, gsm8k_small))
    assert [r["step"] for r in metrics(str(tmp_path / "run")) if r["step"] > 0] == [1]
