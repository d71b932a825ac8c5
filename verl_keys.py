"""verl's Hydra keys as our flags: a verl command's key=value overrides (verl/trainer/main_ppo.py's, or a YAML file
of them) read as verl 0.9.1 reads them (its verl/trainer/config/, the reference for every key's meaning and
default). Batch sizes keep verl's units: data.train_batch_size and ppo_mini_batch_size in prompts,
ppo_micro_batch_size_per_gpu in sequences per rank. A command in verl's keys gets verl's defaults for the keys it
leaves out where they differ from ours (rollout.n 1, use_kl_loss false, total_epochs 30, ...), each named at
start-up; a default we cannot honour (adv_estimator gae: it needs a critic) is refused unless the command sets
another. docs/from_verl_trl.md is this table in words.

    torchrun --nproc_per_node=1 train_grpo.py algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=5 ...
"""

import dataclasses

from config import Args
from translate import SKIP, Ratio, accepted, key_table, refuse, rule_table, table

A, R, M, REF = (
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.rollout.",
    "actor_rollout_ref.model.",
    "actor_rollout_ref.ref.",
)
D, G, T = "data.", "algorithm.", "trainer."
SECTIONS = ("actor_rollout_ref.", "algorithm.", "data.", "trainer.", "critic.", "reward_model.", "reward.")
SECTIONS += ("custom_reward_function.", "global_profiler.", "ray_kwargs.", "transfer_queue.")
# every key a rule reads: verl 0.9.1's default (verl/trainer/config/_generated_ppo_trainer.yaml) and type;
# tests/test_recipes.py checks both against verl's config
KEYS = key_table("""
data.train_files                                     | ~/data/rlhf/gsm8k/train.parquet | str|list
data.val_files                                       | ~/data/rlhf/gsm8k/test.parquet  | str|list
data.train_batch_size                                | 1024                            | int
data.max_prompt_length                               | 512                             | int
data.max_response_length                             | 512                             | int
data.val_max_samples                                 | -1                              | int
data.seed                                            | null                            | int|null
actor_rollout_ref.model.path                         | ~/models/deepseek-llm-7b-chat   | str
actor_rollout_ref.model.enable_gradient_checkpointing | true                           | bool
actor_rollout_ref.model.lora_rank                    | 0                               | int
actor_rollout_ref.model.lora_alpha                   | 16                              | float
actor_rollout_ref.model.target_modules               | all-linear                      | str|list
actor_rollout_ref.actor.optim.lr                     | 1e-6                            | float
actor_rollout_ref.actor.optim.weight_decay           | 0.01                            | float
actor_rollout_ref.actor.optim.lr_warmup_steps        | -1                              | int|null
actor_rollout_ref.actor.optim.lr_warmup_steps_ratio  | 0.0                             | float
actor_rollout_ref.actor.optim.lr_scheduler_type      | constant                        | str
actor_rollout_ref.actor.optim.warmup_style           | null                            | str|null
actor_rollout_ref.actor.optim.min_lr_ratio           | 0.0                             | float
actor_rollout_ref.actor.optim.clip_grad              | 1.0                             | float
actor_rollout_ref.actor.grad_clip                    | 1.0                             | float
actor_rollout_ref.actor.ppo_mini_batch_size          | 256                             | int
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu | null                            | int|null
actor_rollout_ref.actor.ppo_micro_batch_size         | null                            | int|null
actor_rollout_ref.actor.use_dynamic_bsz              | false                           | bool
actor_rollout_ref.actor.ppo_max_token_len_per_gpu    | 16384                           | int
actor_rollout_ref.actor.ppo_epochs                   | 1                               | int
actor_rollout_ref.actor.clip_ratio_low               | 0.2                             | float
actor_rollout_ref.actor.clip_ratio_high              | 0.2                             | float
actor_rollout_ref.actor.clip_ratio_c                 | 3.0                             | float
actor_rollout_ref.actor.loss_agg_mode                | token-mean                      | str
actor_rollout_ref.actor.loss_scale_factor            | null                            | float|null
actor_rollout_ref.actor.entropy_coeff                | 0                               | float
actor_rollout_ref.actor.use_kl_loss                  | false                           | bool
actor_rollout_ref.actor.kl_loss_coef                 | 0.001                           | float
actor_rollout_ref.actor.kl_loss_type                 | low_var_kl                      | str
actor_rollout_ref.actor.policy_loss.loss_mode        | vanilla                         | str
actor_rollout_ref.actor.policy_loss.clip_cov_ratio   | 0.0002                          | float
actor_rollout_ref.actor.policy_loss.clip_cov_lb      | 1.0                             | float
actor_rollout_ref.actor.policy_loss.clip_cov_ub      | 5.0                             | float
actor_rollout_ref.actor.policy_loss.kl_cov_ratio     | 0.0002                          | float
actor_rollout_ref.actor.policy_loss.ppo_kl_coef      | 0.1                             | float
actor_rollout_ref.actor.tau_pos                      | 1.0                             | float
actor_rollout_ref.actor.tau_neg                      | 1.05                            | float
actor_rollout_ref.actor.fsdp_config.param_offload    | false                           | bool
actor_rollout_ref.actor.fsdp_config.optimizer_offload | false                          | bool
actor_rollout_ref.ref.fsdp_config.param_offload      | false                           | bool
actor_rollout_ref.actor.fsdp_config.dtype            | bfloat16                        | str
actor_rollout_ref.actor.fsdp_config.model_dtype      | fp32                            | str
actor_rollout_ref.rollout.dtype                      | bfloat16                        | str
actor_rollout_ref.actor.checkpoint.async_save        | false                           | bool
actor_rollout_ref.rollout.name                       | null                            | str
actor_rollout_ref.rollout.n                          | 1                               | int
actor_rollout_ref.rollout.temperature                | 1.0                             | float
actor_rollout_ref.rollout.top_p                      | 1                               | float
actor_rollout_ref.rollout.top_k                      | -1                              | int
actor_rollout_ref.rollout.gpu_memory_utilization     | 0.5                             | float
actor_rollout_ref.rollout.tensor_model_parallel_size | 2                               | int
actor_rollout_ref.rollout.calculate_log_probs        | true                            | bool
actor_rollout_ref.rollout.val_kwargs.do_sample       | false                           | bool
actor_rollout_ref.rollout.val_kwargs.temperature     | 0                               | float
actor_rollout_ref.rollout.val_kwargs.n               | 1                               | int
algorithm.adv_estimator                              | gae                             | str
algorithm.norm_adv_by_std_in_grpo                    | true                            | bool
algorithm.filter_groups.enable                       | false                           | bool
algorithm.filter_groups.max_num_gen_batches          | 0                               | int
algorithm.rollout_correction.rollout_is              | null                            | str|null
algorithm.rollout_correction.rollout_is_threshold    | 2.0                             | float
trainer.total_epochs                                 | 30                              | int
trainer.total_training_steps                         | null                            | int|null
trainer.test_freq                                    | -1                              | int
trainer.save_freq                                    | -1                              | int
trainer.val_before_train                             | true                            | bool
trainer.logger                                       | [console,wandb]                 | str|list
trainer.project_name                                 | verl_examples                   | str
trainer.experiment_name                              | gsm8k                           | str
trainer.default_local_dir                            | checkpoints/${trainer.project_name}/${trainer.experiment_name} | str
trainer.resume_mode                                  | auto                            | str
trainer.resume_from_path                             | null                            | str|null
trainer.max_actor_ckpt_to_keep                       | null                            | int|null
trainer.n_gpus_per_node                              | 8                               | int
trainer.nnodes                                       | 1                               | int
custom_reward_function.path                          | null                            | str|null
custom_reward_function.name                          | null                            | str|null
reward.custom_reward_function.path                   | null                            | str|null
reward.custom_reward_function.name                   | compute_score                   | str|null
""")
DEFAULTS = {key: default for key, (default, _) in KEYS.items()}
LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "file": "jsonl"}
ADV = next(f.metadata["choices"] for f in dataclasses.fields(Args) if f.name == "adv_estimator")  # ours, by name


def same(value):
    return value


def never_below_one(value):
    """verl's -1 (or 0) for "never" is our -1."""
    return value if value >= 1 else -1


def one_path(key):
    def path(files):
        files = files if isinstance(files, list) else [files]
        if len(files) != 1:
            refuse(key, files, "one parquet file or directory of one split's shards here; merge the files first")
        return files[0]

    return path


def adv_estimator(name):
    if name == "gae":
        refuse(
            G + "adv_estimator", name, "GAE needs a critic, which GRPO has none of: set algorithm.adv_estimator=grpo"
        )
    if name not in ADV:
        refuse(G + "adv_estimator", name, f"not one we have; we have {', '.join(ADV)}")
    return name


def lr_schedule(kind, style):
    kind = style or kind  # verl reads the deprecated warmup_style first
    if kind not in ("constant", "cosine"):
        refuse(A + "optim.lr_scheduler_type", kind, "we have constant and cosine")
    return kind


def warmup(steps, ratio):
    """verl: lr_warmup_steps when >= 0 (its -1 delegates), else ratio x total training steps."""
    if steps is not None and steps >= 0:
        return steps
    return Ratio(ratio) if ratio > 0 else 0


def grad_clip(optim, actor):
    if optim != actor and 1.0 not in (optim, actor):
        refuse(A + "grad_clip", actor, f"differs from {A}optim.clip_grad={optim}: give one of them")
    return optim if optim != 1.0 else actor  # the one the command changed


def micro_batch(world):
    def per_rank(per_gpu, total):
        if per_gpu is not None:
            return per_gpu
        if total is None:
            return SKIP  # verl then needs use_dynamic_bsz; ours keeps --micro-batch-size
        if total % world:
            refuse(A + "ppo_micro_batch_size", total, f"is over all ranks: must be a multiple of the {world} ranks")
        return total // world

    return per_rank


def offload(cuda):
    """On a GPU: verl's param_offload (actor, and so the reference) and optimizer_offload; only the reference's
    cannot be honoured (ours offloads both or neither). On a CPU every offload key has no effect."""

    def which(params, optimizer, ref_params):
        if not cuda:
            return SKIP
        if ref_params and not params:
            refuse(REF + "fsdp_config.param_offload", ref_params, "ours offloads the reference only with the policy")
        return {(0, 0): "none", (0, 1): "optimizer", (1, 0): "params", (1, 1): "both"}[(params, optimizer)]

    return which


def dtype(actor, master, rollout):
    names = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}
    if names.get(master) != "fp32":
        refuse(A + "fsdp_config.model_dtype", master, "our master weights stay fp32 (the compute dtype is --dtype)")
    for key, value in ((A + "fsdp_config.dtype", actor), (R + "dtype", rollout)):
        if value not in names:
            refuse(key, value, "we have bfloat16 and float32")
    if names[actor] != names[rollout]:
        refuse(R + "dtype", rollout, f"differs from {A}fsdp_config.dtype={actor}: ours is one --dtype for both")
    return names[actor]


def loggers(names):
    names = [names] if isinstance(names, str) else names
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        refuse(T + "logger", names, f"{unknown}: we have {', '.join(LOGGERS)}")
    ours = ["console"] * ("console" in names) + ["jsonl"] + [LOGGERS[n] for n in names if n != "console"]
    return ",".join(dict.fromkeys(ours))  # the JSONL log (metrics.jsonl) is always on: it is the run's record


def for_wandb(names, value):
    return value if "wandb" in ([names] if isinstance(names, str) else names) else SKIP


def out_dir(path, project, experiment):
    return path.replace("${trainer.project_name}", project).replace("${trainer.experiment_name}", experiment)


def resume(mode, path):
    if mode == "resume_path":
        return path or refuse(T + "resume_from_path", path, "resume_mode=resume_path needs a checkpoint path")
    return {"auto": "auto", "disable": "never"}.get(mode) or refuse(
        T + "resume_mode", mode, "auto, disable, resume_path"
    )


def reward_fn(path, name, new_path, new_name):
    path, name = path or new_path, (name if path else new_name) or "compute_score"
    return f"{path}:{name}" if path else ""


def filter_batches(enable, count):
    if not enable:
        return SKIP
    return (
        count if count > 0 else refuse(G + "filter_groups.max_num_gen_batches", count, "verl's 0 is no limit; give one")
    )


def tis_cap(mode, threshold):
    if mode in (None, "null"):
        return 0.0
    return (
        threshold if mode == "token" else refuse(G + "rollout_correction.rollout_is", mode, "we have token (--tis-cap)")
    )


def ranks(world):
    def check(gpus, nodes):
        if gpus * nodes != world:
            refuse(
                T + "n_gpus_per_node",
                gpus,
                f"x trainer.nnodes={nodes} is not torchrun's {world} ranks: make them agree",
            )

    return check


RULES = """
model                | actor_rollout_ref.model.path                         | the model directory or hub id
train_data           | data.train_files                                     | one file or directory (a list of one)
val_data             | data.val_files                                       | one file or directory (a list of one)
prompt_batch_size    | data.train_batch_size                                | prompts per step in both
max_prompt_length    | data.max_prompt_length                               | tokens; longer prompts are dropped
max_response_length  | data.max_response_length                             | tokens
val_max_prompts      | data.val_max_samples                                 | the same; -1: all
seed                 | data.seed                                            | the same (null: ours)
grad_checkpointing   | actor_rollout_ref.model.enable_gradient_checkpointing | the same
lora_rank            | actor_rollout_ref.model.lora_rank                    | the same
lora_alpha           | actor_rollout_ref.model.lora_rank actor_rollout_ref.model.lora_alpha | lora_alpha, with lora_rank > 0
lora_target_modules  | actor_rollout_ref.model.lora_rank actor_rollout_ref.model.target_modules | target_modules (a list joined by commas), with lora_rank > 0
lr                   | actor_rollout_ref.actor.optim.lr                     | the same
weight_decay         | actor_rollout_ref.actor.optim.weight_decay           | the same
warmup_steps         | actor_rollout_ref.actor.optim.lr_warmup_steps actor_rollout_ref.actor.optim.lr_warmup_steps_ratio | lr_warmup_steps when >= 0, else ceil(ratio x the run's steps)
lr_schedule          | actor_rollout_ref.actor.optim.lr_scheduler_type actor_rollout_ref.actor.optim.warmup_style | constant or cosine (the deprecated warmup_style first)
min_lr_ratio         | actor_rollout_ref.actor.optim.min_lr_ratio           | the same (cosine only)
grad_clip            | actor_rollout_ref.actor.optim.clip_grad actor_rollout_ref.actor.grad_clip | either (the one set; 0.9.1 reads optim.clip_grad)
mini_batch_size      | actor_rollout_ref.actor.ppo_mini_batch_size          | prompts per optimizer step in both
micro_batch_size     | actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu actor_rollout_ref.actor.ppo_micro_batch_size | sequences per forward on each rank (the deprecated global one / ranks)
micro_batch_tokens   | actor_rollout_ref.actor.use_dynamic_bsz actor_rollout_ref.actor.ppo_max_token_len_per_gpu | ppo_max_token_len_per_gpu when use_dynamic_bsz, else 0
ppo_epochs           | actor_rollout_ref.actor.ppo_epochs                   | the same
clip_low             | actor_rollout_ref.actor.clip_ratio_low               | the same
clip_high            | actor_rollout_ref.actor.clip_ratio_high              | the same
clip_c               | actor_rollout_ref.actor.clip_ratio_c                 | the same
loss_agg             | actor_rollout_ref.actor.loss_agg_mode                | the same names
loss_scale_factor    | actor_rollout_ref.actor.loss_scale_factor            | the same; null: 0 (max_response_length)
entropy_coef         | actor_rollout_ref.actor.entropy_coeff                | the same
kl_coef              | actor_rollout_ref.actor.use_kl_loss actor_rollout_ref.actor.kl_loss_coef | kl_loss_coef if use_kl_loss, else 0
kl_kind              | actor_rollout_ref.actor.kl_loss_type                 | the same names
loss_mode            | actor_rollout_ref.actor.policy_loss.loss_mode        | the same names
clip_cov_ratio       | actor_rollout_ref.actor.policy_loss.clip_cov_ratio   | the same
clip_cov_lb          | actor_rollout_ref.actor.policy_loss.clip_cov_lb      | the same
clip_cov_ub          | actor_rollout_ref.actor.policy_loss.clip_cov_ub      | the same
kl_cov_ratio         | actor_rollout_ref.actor.policy_loss.kl_cov_ratio     | the same
ppo_kl_coef          | actor_rollout_ref.actor.policy_loss.ppo_kl_coef      | the same
tau_pos              | actor_rollout_ref.actor.tau_pos                      | the same
tau_neg              | actor_rollout_ref.actor.tau_neg                      | the same
offload              | actor_rollout_ref.actor.fsdp_config.param_offload actor_rollout_ref.actor.fsdp_config.optimizer_offload actor_rollout_ref.ref.fsdp_config.param_offload | on a GPU: params, optimizer or both (the reference's alone is refused: ours offloads it with the policy's); on a CPU: no effect
dtype                | actor_rollout_ref.actor.fsdp_config.dtype actor_rollout_ref.actor.fsdp_config.model_dtype actor_rollout_ref.rollout.dtype | bfloat16: bf16, float32: fp32 (master weights fp32 in both)
async_save           | actor_rollout_ref.actor.checkpoint.async_save        | the same
rollout              | actor_rollout_ref.rollout.name                       | vllm; hf (transformers)
group_size           | actor_rollout_ref.rollout.n                          | responses per prompt
temperature          | actor_rollout_ref.rollout.temperature                | the same
top_p                | actor_rollout_ref.rollout.top_p                      | the same
top_k                | actor_rollout_ref.rollout.top_k                      | the same; -1: off
gpu_memory_utilization | actor_rollout_ref.rollout.gpu_memory_utilization   | the same
tensor_parallel_size | actor_rollout_ref.rollout.tensor_model_parallel_size | the same
engine_logprobs      | actor_rollout_ref.rollout.calculate_log_probs        | the same
val_temperature      | actor_rollout_ref.rollout.val_kwargs.do_sample actor_rollout_ref.rollout.val_kwargs.temperature | temperature if do_sample, else 0 (greedy)
val_n                | actor_rollout_ref.rollout.val_kwargs.n               | the same
adv_estimator        | algorithm.adv_estimator                              | grpo, rloo, reinforce_plus_plus_baseline, grpo_passk (gae refused: no critic)
norm_adv_by_std      | algorithm.norm_adv_by_std_in_grpo                    | the same
filter_groups        | algorithm.filter_groups.enable                       | the same
max_gen_batches      | algorithm.filter_groups.enable algorithm.filter_groups.max_num_gen_batches | the same, with filter_groups (verl's 0, no limit, refused)
tis_cap              | algorithm.rollout_correction.rollout_is algorithm.rollout_correction.rollout_is_threshold | rollout_is token: the threshold; null: 0
epochs               | trainer.total_epochs                                 | the same
max_steps            | trainer.total_training_steps                         | the same; null: -1
test_freq            | trainer.test_freq                                    | the same; <= 0: -1 (never)
save_freq            | trainer.save_freq                                    | the same; <= 0: -1 (never)
val_before_train     | trainer.val_before_train                             | the same
logger               | trainer.logger                                       | console, wandb, tensorboard, file (jsonl); jsonl always
wandb_project        | trainer.logger trainer.project_name                  | project_name, with wandb in logger
wandb_run_name       | trainer.logger trainer.experiment_name               | experiment_name, with wandb in logger
out_dir              | trainer.default_local_dir trainer.project_name trainer.experiment_name | the run directory (checkpoints and all else)
resume               | trainer.resume_mode trainer.resume_from_path         | auto; disable: never; resume_path: the path
max_ckpt_to_keep     | trainer.max_actor_ckpt_to_keep                       | the same; null: -1
reward_fn            | custom_reward_function.path custom_reward_function.name reward.custom_reward_function.path reward.custom_reward_function.name | path:name (the top-level keys first)
(ranks)              | trainer.n_gpus_per_node trainer.nnodes               | their product must be torchrun's ranks
"""
NO_FILL = ("model", "train_data", "val_data", "rollout", "(ranks)")  # paths and the engine: verl's are placeholders


def rules(world=1, cuda=False):
    """The table for `world` ranks (torchrun's), on a machine with (cuda) or without a GPU."""
    convert = dict.fromkeys([name for name, _, _ in table(RULES)], same)
    convert.update(
        train_data=one_path("data.train_files"),
        val_data=one_path("data.val_files"),
        seed=lambda s: SKIP if s is None else s,
        lora_alpha=lambda n, a: a if n else SKIP,
        lora_target_modules=lambda n, t: (",".join(t) if isinstance(t, list) else t) if n else SKIP,
        warmup_steps=warmup,
        lr_schedule=lr_schedule,
        grad_clip=grad_clip,
        micro_batch_size=micro_batch(world),
        micro_batch_tokens=lambda on, n: n if on else 0,
        loss_scale_factor=lambda v: v or 0.0,
        kl_coef=lambda on, coef: coef if on else 0.0,
        offload=offload(cuda),
        dtype=dtype,
        rollout=lambda n: n if n in ("vllm", "hf") else refuse(R + "name", n, "we have vllm and hf"),
        val_temperature=lambda sample, t: t if sample else 0.0,
        adv_estimator=adv_estimator,
        max_gen_batches=filter_batches,
        tis_cap=tis_cap,
        max_steps=lambda s: -1 if s is None else s,
        test_freq=never_below_one,
        save_freq=never_below_one,
        logger=loggers,
        wandb_project=for_wandb,
        wandb_run_name=for_wandb,
        out_dir=out_dir,
        resume=resume,
        max_ckpt_to_keep=lambda n: -1 if n is None else n,
        reward_fn=reward_fn,
    )
    convert["(ranks)"] = ranks(world)
    return rule_table(RULES, convert, NO_FILL)


# the keys that change nothing here: the values we accept (* any), and why
NO_EFFECT = accepted("""
data.filter_overlong_prompts                         | *              | prompts over max_prompt_length are always dropped here, with a count
data.truncation                                      | ["error"]      | no prompt is truncated: longer ones are dropped
data.shuffle                                         | *              | the data order is always a seeded shuffle here (rollout.step_prompts)
data.prompt_key                                      | ["prompt"]     | rows hold their prompt in prompt
data.reward_fn_key                                   | ["data_source"] | the built-in reward is chosen by data_source
data.return_raw_chat                                 | *              | prompts are rendered with the chat template at start-up
data.dataloader_num_workers data.filter_overlong_prompts_workers | * | the data is read once, at start-up
data.val_batch_size                                  | *              | validation sends all its prompts to the engine at once
data.gen_batch_size                                  | *              | each rollout round takes --prompt-batch-size prompts
data.train_max_samples                               | [-1]           | every row of the file is used
data.trust_remote_code actor_rollout_ref.model.trust_remote_code | [False] | no code is run from a model directory
actor_rollout_ref.model.use_remove_padding           | *              | padding is never computed on here
actor_rollout_ref.model.use_shm                      | *              | the model is read from its directory
actor_rollout_ref.model.use_fused_kernels actor_rollout_ref.model.use_liger | * | the head's log-probs are computed a block at a time (logprobs.py)
actor_rollout_ref.model.enable_activation_offload    | [False]        | activations stay where they are (--grad-checkpointing saves memory)
actor_rollout_ref.hybrid_engine                      | [True]         | the engine is always colocated in every rank
actor_rollout_ref.actor.strategy                     | ["fsdp", "fsdp2"] | the policy is always FSDP2
actor_rollout_ref.actor.use_torch_compile            | *              | verl compiles its log-prob functions; --compile-blocks compiles the blocks
actor_rollout_ref.actor.shuffle                      | [False]        | mini-batches are taken in order
actor_rollout_ref.actor.clip_ratio                   | *              | verl 0.9.1 clips with clip_ratio_low and clip_ratio_high (0.2 each unless set)
actor_rollout_ref.actor.ulysses_sequence_parallel_size | [1]          | no sequence parallelism here
actor_rollout_ref.actor.entropy_from_logits_with_chunking actor_rollout_ref.actor.entropy_checkpointing | * | entropies are computed a block at a time (logprobs.py)
actor_rollout_ref.actor.optim.optimizer              | ["AdamW"]      | the optimizer is AdamW
actor_rollout_ref.actor.optim.betas                  | [[0.9, 0.999]] | AdamW's betas are (0.9, 0.999)
actor_rollout_ref.actor.optim.num_cycles             | [0.5]          | the cosine schedule is half a cycle
actor_rollout_ref.actor.optim.total_training_steps   | *              | the run's steps follow from the data, epochs and max_steps
actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params | *    | FSDP2 shards each decoder layer
actor_rollout_ref.actor.fsdp_config.fsdp_size        | [-1]           | FSDP2 shards over every trainer rank
actor_rollout_ref.rollout.mode                       | *              | the engine runs in this process
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu actor_rollout_ref.rollout.log_prob_micro_batch_size actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu actor_rollout_ref.ref.log_prob_micro_batch_size | * | the log-prob passes take --micro-batch-size sequences
actor_rollout_ref.rollout.load_format                | *              | the weights are streamed into the engine after every update (weight_sync.py)
actor_rollout_ref.rollout.layered_summon             | *              | each parameter is gathered and streamed on its own
actor_rollout_ref.rollout.enforce_eager actor_rollout_ref.rollout.free_cache_engine actor_rollout_ref.rollout.enable_chunked_prefill actor_rollout_ref.rollout.enable_prefix_caching actor_rollout_ref.rollout.max_num_batched_tokens actor_rollout_ref.rollout.max_num_seqs | * | vllm_engine.py sets the engine up for the machine
actor_rollout_ref.rollout.max_model_len              | *              | the engine's length is max_prompt_length + max_response_length
actor_rollout_ref.rollout.disable_log_stats          | *              | --verbose shows vLLM's messages
actor_rollout_ref.rollout.do_sample                  | [True]         | training rollouts sample
actor_rollout_ref.rollout.ignore_eos                 | [False]        | a response ends at the model's end-of-turn token
actor_rollout_ref.rollout.val_kwargs.top_p           | [1]            | validation samples from the whole distribution
actor_rollout_ref.rollout.val_kwargs.top_k           | [-1, 0]        | validation samples from the whole distribution
actor_rollout_ref.rollout.multi_turn.enable          | [False]        | multi-turn rollouts are --tools FILE.py (typed functions with docstrings)
algorithm.use_kl_in_reward                           | [False]        | the KL is a loss here (use_kl_loss), never in the reward
algorithm.kl_penalty algorithm.kl_ctrl.type algorithm.kl_ctrl.kl_coef | * | only with use_kl_in_reward
algorithm.gamma algorithm.lam                        | *              | GAE's and REINFORCE++'s discount; GRPO's advantages have none
algorithm.filter_groups.metric                       | ["reward", "score", "seq_reward"] | groups are compared by their rewards
algorithm.use_pf_ppo                                 | [False]        | no prioritized replay here
trainer.critic_warmup                                | [0]            | GRPO has no critic
trainer.balance_batch                                | *              | each rank takes its share of the prompts in order
trainer.log_val_generations trainer.rollout_data_dir trainer.validation_data_dir | * | every sample goes to samples/ in the run directory
trainer.device                                       | *              | CUDA when torch finds a GPU, else the CPU
trainer.val_only                                     | [False]        | eval.py validates a model without training
trainer.max_critic_ckpt_to_keep                      | *              | GRPO has no critic
trainer.default_hdfs_dir                             | [None]         | checkpoints stay in the run directory
trainer.del_local_ckpt_after_load                    | [False]        | checkpoints stay in the run directory
trainer.ray_wait_register_center_timeout             | *              | no Ray here
reward.reward_manager.name                           | ["naive"]      | each response is scored on its own (verl's naive manager)
reward_model.enable reward.reward_model.enable       | [None, False]  | a learned reward model is --reward-model DIR
""")
# whole sections with nothing in them to set
NO_EFFECT_SECTIONS = {
    "critic.": "GRPO has no critic",
    "global_profiler.": "--profile-step N records one step",
    "ray_kwargs.": "no Ray here",
    "transfer_queue.": "no transfer queue here",
}


def cpu_offload(cuda):
    """The offload keys on a machine without CUDA: named, no effect."""
    keys = (A + "fsdp_config.param_offload", A + "fsdp_config.optimizer_offload", REF + "fsdp_config.param_offload")
    return {} if cuda else {key: ("a CPU run keeps everything in CPU memory already", None) for key in keys}
