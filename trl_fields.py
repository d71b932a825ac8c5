"""TRL's GRPOConfig fields as our flags: a TRL recipe's YAML (open-r1's recipes/*/grpo/config_*.yaml, or TRL's own
`trl grpo --config`), with ModelConfig's model_name_or_path and dtype and ScriptArguments' dataset_name and
reward_funcs, read as TRL 1.16.0 reads them (its trl/trainer/grpo_config.py and grpo_trainer.py, the reference for
every field). TRL's defaults fill what a recipe leaves out, named at start-up where they differ from ours; fields
earlier TRL versions had and recipes still carry (max_prompt_length, warmup_ratio) are read by what they meant.
Batch sizes are converted by meaning with torchrun's world size W: TRL counts completions per device, and one of
our steps is one generation batch:

    prompts per step     = per_device_train_batch_size x W x steps_per_generation / num_generations
    prompts per update   = per_device_train_batch_size x W x gradient_accumulation_steps / num_generations
    optimizer steps/step = steps_per_generation / gradient_accumulation_steps x num_iterations  (TRL's steps)
"""

import math
import os

from translate import SKIP, Ratio, accepted, key_table, refuse, rule_table, table

# every field a rule reads: TRL 1.16.0's default and type (tests/test_recipes.py checks both against TRL's own);
# ModelConfig's, ScriptArguments', open-r1's and the fields earlier versions had, marked
KEYS = key_table("""
model_name_or_path            | null          | str|null
dtype                         | float32       | str|null
torch_dtype                   | null          | str|null
dataset_name                  | null          | str|null
dataset_train_split           | train         | str
dataset_test_split            | test          | str
system_prompt                 | null          | str|null
dataset_prompt_column         | prompt        | str
reward_funcs                  | null          | list|null
reward_weights                | null          | list|null
reward_model_name_or_path     | null          | str|null
output_dir                    | null          | str|null
per_device_train_batch_size   | 8             | int
gradient_accumulation_steps   | 1             | int
steps_per_generation          | null          | int|null
generation_batch_size         | null          | int|null
num_generations               | 8             | int
num_iterations                | 1             | int
num_train_epochs              | 3.0           | float
max_steps                     | -1            | int
learning_rate                 | 1e-6          | float
lr_scheduler_type             | linear        | str
lr_scheduler_kwargs           | null          | dict|null
warmup_steps                  | 0             | float
warmup_ratio                  | null          | float|null
weight_decay                  | 0.0           | float
max_grad_norm                 | 1.0           | float
bf16                          | null          | bool|null
fp16                          | false         | bool
gradient_checkpointing        | true          | bool
torch_compile                 | false         | bool
seed                          | 42            | int
max_completion_length         | 512           | int
max_prompt_length             | null          | int|null
temperature                   | 1.0           | float
top_p                         | 1.0           | float
top_k                         | 0             | int
use_vllm                      | false         | bool
vllm_mode                     | colocate      | str
vllm_gpu_memory_utilization   | 0.3           | float
vllm_tensor_parallel_size     | 1             | int
vllm_importance_sampling_correction | true    | bool
vllm_importance_sampling_mode | sequence_mask | str
vllm_importance_sampling_clip_max | 3.0       | float|null
beta                          | 0.0           | float
use_bias_correction_kl        | true          | bool
epsilon                       | 0.2           | float
epsilon_high                  | null          | float|null
loss_type                     | dapo          | str
importance_sampling_level     | token         | str
scale_rewards                 | group         | str|bool
mask_truncated_completions    | false         | bool
entropy_coef                  | 0.0           | float
sapo_temperature_pos          | 1.0           | float
sapo_temperature_neg          | 1.05          | float
max_tool_calling_iterations   | null          | int|null
eval_strategy                 | no            | str
evaluation_strategy           | null          | str|null
eval_steps                    | null          | float|null
eval_on_start                 | false         | bool
logging_steps                 | 10            | float
num_generations_eval          | null          | int|null
save_strategy                 | steps         | str
save_steps                    | 500           | float
save_total_limit              | null          | int|null
report_to                     | none          | str|list
run_name                      | null          | str|null
project                       | huggingface   | str
resume_from_checkpoint        | null          | str|bool|null
ddp_timeout                   | 1800          | int
use_peft                      | false         | bool
lora_r                        | 16            | int
lora_alpha                    | 32            | int
lora_dropout                  | 0.05          | float
lora_target_modules           | null          | str|list|null
""")
DEFAULTS = {key: default for key, (default, _) in KEYS.items()}
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")
BATCH += ("generation_batch_size", "num_generations", "num_iterations")
# TRL's and open-r1's reward registries: names, not functions we can load
TRL_REGISTRY = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")  # trl/scripts/grpo.py's
OPEN_R1_REGISTRY = dict(  # src/open_r1/rewards.py's get_reward_funcs: name -> the function (or its factory)
    accuracy="accuracy_reward", format="format_reward", tag_count="tag_count_reward", length="len_reward",
    reasoning_steps="reasoning_steps_reward", cosine="get_cosine_scaled_reward(...)", code="code_reward",
    repetition_penalty="get_repetition_penalty_reward(...)", binary_code="binary_code_reward", ioi_code="ioi_code_reward",
    cf_code="cf_code_reward", code_format="get_code_format_reward(...)", soft_overlong_punishment="get_soft_overlong_punishment(...)",
)  # fmt: skip


def same(value):
    return value


class Batches:
    """TRL's batch fields for W ranks, as TRL's GRPOConfig.__post_init__ resolves them."""

    def __init__(self, world, per_device, accumulation, steps_per_gen, gen_batch, n, iterations):
        if steps_per_gen is not None and gen_batch is not None:
            refuse("generation_batch_size", gen_batch, "TRL takes it or steps_per_generation, not both")
        if gen_batch is not None:
            if gen_batch % (per_device * world):
                refuse("generation_batch_size", gen_batch, f"must be a multiple of {per_device} x {world} ranks")
            steps_per_gen = gen_batch // (per_device * world)
        self.steps_per_gen = steps_per_gen or accumulation
        completions = per_device * world * self.steps_per_gen
        if completions % n:
            refuse("num_generations", n, f"must divide the {completions} completions of a generation batch")
        if (per_device * world * accumulation) % n:
            why = f"must divide the {per_device * world * accumulation} completions of one optimizer step"
            refuse("num_generations", n, why + ": ours updates on whole groups")
        if self.steps_per_gen % accumulation:
            refuse("steps_per_generation", self.steps_per_gen, "must be a multiple of gradient_accumulation_steps")
        self.prompts, self.mini = completions // n, per_device * world * accumulation // n
        self.updates = self.steps_per_gen // accumulation * iterations  # TRL's steps in one of ours

    def steps(self, key, count):
        """TRL's optimizer steps (or a share of the run, when below 1) in our steps, rounded up."""
        if 0 < count < 1:
            return Ratio(count)
        return math.ceil(count / self.updates)


def batches(world, fn):
    return lambda *v: fn(Batches(world, *v[: len(BATCH)]), *v[len(BATCH) :])


def split_path(name, split, key="dataset_name"):
    """A local dataset's split: the file itself, or DIR/SPLIT.jsonl|.json|.parquet, or DIR/SPLIT (a save_to_disk
    split or a directory of its shards)."""
    if name is None:
        return SKIP
    if os.path.isfile(name):
        return name
    if not os.path.isdir(name):
        refuse(key, name, "not a local file or directory (nothing is downloaded here): point it at a local copy")
    for candidate in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet", split):
        if os.path.exists(os.path.join(name, candidate)):
            return os.path.join(name, candidate)
    refuse(key, name, f"holds no {split}.jsonl, {split}.json, {split}.parquet or {split}/ for the {split} split")


def evaluates(strategy, old):
    strategy = old or strategy
    if strategy not in ("no", "steps", "epoch"):
        refuse("eval_strategy", strategy, "no, steps or epoch")
    return strategy != "no"


def val_path(name, train_split, test_split, strategy, old):
    if not evaluates(strategy, old):  # never read for validation: --test-freq -1, --no-val-before-train
        return split_path(name, train_split)
    if name is not None and os.path.isfile(name):
        refuse("dataset_name", name, "is one file, and eval_strategy evaluates: give the test split with --val-data")
    return split_path(name, test_split)


def compute_dtype(bf16, fp16, dtype, torch_dtype):
    dtype = torch_dtype or dtype
    if fp16 or dtype == "float16":
        refuse("fp16" if fp16 else "dtype", True if fp16 else dtype, "we have bf16 and fp32, not fp16")
    if dtype not in ("float32", "bfloat16", "auto", None):
        refuse("dtype", dtype, "bfloat16, float32 or auto")
    return "bf16" if bf16 or bf16 is None or dtype == "bfloat16" else "fp32"


def schedule(kind):
    if kind in ("constant", "constant_with_warmup"):
        return "constant"
    if kind in ("cosine", "cosine_with_min_lr"):
        return "cosine"
    refuse("lr_scheduler_type", kind, "TRL's default linear and the others are not ours: set constant or cosine")


def min_lr(kind, kwargs, lr):
    if kind != "cosine_with_min_lr":
        return 0.0
    kwargs = kwargs or {}
    if "min_lr_rate" in kwargs:
        return kwargs["min_lr_rate"]
    return kwargs["min_lr"] / lr if "min_lr" in kwargs else refuse("lr_scheduler_kwargs", kwargs, "needs min_lr_rate")


def warmup(b, kind, steps, ratio):
    if kind == "constant":
        return 0  # transformers' constant schedule has no warmup
    if steps:
        return b.steps("warmup_steps", steps)
    return Ratio(ratio) if ratio else 0


def every(strategy_key):
    def freq(b, strategy, steps, fallback=None):
        if strategy == "no":
            return -1
        if strategy == "epoch":
            return Ratio(1.0, per_epoch=True)
        if strategy != "steps":
            refuse(strategy_key, strategy, "no, steps or epoch")
        return b.steps(strategy_key, steps if steps is not None else fallback)

    return freq


def losses(kind, level):
    aggs = dict(dapo="token-mean", grpo="seq-mean-token-mean", dr_grpo="seq-mean-token-sum-norm", cispo="token-mean")
    aggs.update(sapo="seq-mean-token-mean")
    if kind not in aggs:
        refuse("loss_type", kind, f"not one we have; we have {', '.join(aggs)}")
    if level == "sequence" and kind != "grpo":
        refuse("importance_sampling_level", level, "GSPO here averages each sequence's tokens: set loss_type: grpo")
    if level not in ("token", "sequence"):
        refuse("importance_sampling_level", level, "token or sequence")
    mode = "gspo" if level == "sequence" else {"cispo": "cispo", "sapo": "sapo"}.get(kind, "vanilla")
    return aggs[kind], mode


def kl_coef(beta, corrected):
    if beta and corrected:
        refuse(
            "use_bias_correction_kl",
            corrected,
            "TRL 1.16 weights the KL by the ratio; ours is the plain KL loss: set false",
        )
    return beta


def reward_specs(names):
    specs = []
    for name in names or []:
        if name in TRL_REGISTRY + ("get_soft_overlong_punishment",):
            instead = "--overlong-buffer-len L" if name.startswith("get_") else f"--reward-fn trl.rewards:{name}"
            refuse("reward_funcs", name, f"a name in TRL's registry: use {instead} (trl installed)")
        if name in OPEN_R1_REGISTRY:
            where = f"path/to/open_r1/rewards.py:{OPEN_R1_REGISTRY[name]}"
            refuse(
                "reward_funcs", name, f"a name in open-r1's registry: use --reward-fn {where} (your copy of the file)"
            )
        if "." not in name:
            refuse(
                "reward_funcs", name, "expected a dotted import path, my_rewards.accuracy (or --reward-fn FILE:FUNC)"
            )
        module, fn = name.rsplit(".", 1)
        file = module.replace(".", "/") + ".py"  # TRL's script imports from the current directory first
        specs.append(f"{file if os.path.isfile(file) else module}:{fn}")
    return ",".join(specs) if specs else SKIP


def weights(values, model):
    if not values:
        return SKIP
    return ",".join(str(w) for w in (values[1:] if model else values)) or SKIP


def report(names):
    names = [names] if isinstance(names, str) else names
    bad = [n for n in names if n not in ("none", "wandb", "tensorboard")]
    if bad:
        refuse("report_to", names, f"{bad}: we have wandb and tensorboard (console and metrics.jsonl are always on)")
    return ",".join(["console", "jsonl"] + [n for n in names if n != "none"])


B = " ".join(BATCH)  # the batch fields, which several rules read (Batches)
RULES = f"""
model                | model_name_or_path                                   | the model directory or hub id
train_data           | dataset_name dataset_train_split                     | a local file, or its directory's train split (SPLIT.jsonl, .json, .parquet or SPLIT/)
val_data             | dataset_name dataset_train_split dataset_test_split eval_strategy evaluation_strategy | its test split when it evaluates; else the train split, never read
prompt_column        | dataset_prompt_column                                | the same: the column whose text is the user's turn
system_prompt        | system_prompt                                        | the same; null: none
reward_fn            | reward_funcs                                         | dotted paths: module:function (a module file under the current directory: FILE.py:function); registry names refused
reward_weights       | reward_weights reward_model_name_or_path             | the functions' weights
reward_model         | reward_model_name_or_path                            | a local directory
reward_model_weight  | reward_weights reward_model_name_or_path             | the reward model's weight: the first of reward_weights
reward_model_only    | reward_funcs reward_model_name_or_path               | a reward model and no functions
out_dir              | output_dir                                           | the same; TRL's default trainer_output
resume               | resume_from_checkpoint                               | a path; true: auto; null (TRL starts afresh): never
dtype                | bf16 fp16 dtype torch_dtype                          | bf16 (TRL's default, mixed precision) or dtype bfloat16: bf16; else fp32; fp16 refused
prompt_batch_size    | {B}                                                  | per_device_train_batch_size x ranks x steps_per_generation / num_generations
mini_batch_size      | {B}                                                  | per_device_train_batch_size x ranks x gradient_accumulation_steps / num_generations
micro_batch_size     | per_device_train_batch_size                          | sequences per forward on each rank
group_size           | num_generations                                      | the same
ppo_epochs           | num_iterations                                       | the same
epochs               | num_train_epochs                                     | a whole number
max_steps            | {B} max_steps                                        | TRL's optimizer steps / those in one of our steps, rounded up
lr                   | learning_rate                                        | the same
lr_schedule          | lr_scheduler_type                                    | constant(_with_warmup): constant; cosine(_with_min_lr): cosine; linear (TRL's default) refused
min_lr_ratio         | lr_scheduler_type lr_scheduler_kwargs learning_rate  | cosine_with_min_lr's min_lr_rate (or min_lr / learning_rate); else 0
warmup_steps         | {B} lr_scheduler_type warmup_steps warmup_ratio      | in our steps, rounded up; below 1 or warmup_ratio: ceil(share x the run's steps); constant: 0
weight_decay         | weight_decay                                         | the same
grad_clip            | max_grad_norm                                        | the same (0, no clipping, refused)
grad_checkpointing   | gradient_checkpointing                               | the same
compile_blocks       | torch_compile                                        | compiles the decoder blocks' MLPs and norms (TRL's, the whole model)
seed                 | seed                                                 | the same
max_response_length  | max_completion_length                                | tokens
max_prompt_length    | max_prompt_length                                    | tokens; longer prompts are dropped (TRL cut them from the left)
temperature          | temperature                                          | the same
top_p                | top_p                                                | the same
top_k                | top_k                                                | the same; 0 (off): -1
rollout              | use_vllm vllm_mode                                   | vllm (colocate); false: hf (transformers); server refused
gpu_memory_utilization | use_vllm vllm_gpu_memory_utilization               | with use_vllm
tensor_parallel_size | vllm_tensor_parallel_size                            | the same
tis_cap              | use_vllm vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max | token_truncate: clip_max; the other modes: 0 (named at start-up)
kl_coef              | beta use_bias_correction_kl                          | beta, with use_bias_correction_kl false (ours is the plain KL loss)
clip_low             | epsilon                                              | the same
clip_high            | epsilon epsilon_high                                 | epsilon_high, else epsilon
loss_agg             | loss_type importance_sampling_level                  | dapo, cispo: token-mean; grpo, sapo: seq-mean-token-mean; dr_grpo: seq-mean-token-sum-norm
loss_mode            | loss_type importance_sampling_level                  | cispo, sapo; importance_sampling_level sequence: gspo; else vanilla
tau_pos              | loss_type sapo_temperature_pos                       | with loss_type sapo
tau_neg              | loss_type sapo_temperature_neg                       | with loss_type sapo
norm_adv_by_std      | scale_rewards                                        | group, true: true; none, false: false; batch refused
mask_truncated       | mask_truncated_completions                           | the same
entropy_coef         | entropy_coef                                         | the same
max_turns            | max_tool_calling_iterations                          | the same
test_freq            | {B} eval_strategy evaluation_strategy eval_steps logging_steps | steps: eval_steps (else logging_steps) in our steps; epoch: an epoch's steps; no: -1
val_before_train     | eval_strategy evaluation_strategy eval_on_start      | eval_on_start, when it evaluates
val_temperature      | eval_strategy evaluation_strategy temperature        | temperature, when it evaluates (TRL samples its evaluation)
val_n                | eval_strategy evaluation_strategy num_generations_eval num_generations | num_generations_eval, else num_generations, when it evaluates
save_freq            | {B} save_strategy save_steps                         | steps: save_steps in our steps; epoch: an epoch's steps; no: -1
max_ckpt_to_keep     | save_total_limit                                     | the same; null: -1
logger               | report_to                                            | console,jsonl + wandb, tensorboard
wandb_project        | report_to project                                    | project, with wandb
wandb_run_name       | report_to run_name                                   | run_name, with wandb
collective_timeout   | ddp_timeout                                          | seconds
lora_rank            | use_peft lora_r                                      | lora_r with use_peft, else 0
lora_alpha           | use_peft lora_alpha                                  | with use_peft
lora_dropout         | use_peft lora_dropout                                | with use_peft
lora_target_modules  | use_peft lora_target_modules                         | with use_peft (a list joined by commas); null refused: name them
"""
NO_FILL = ("model", "train_data", "val_data", "collective_timeout")


def rules(world=1, cuda=False):
    """The table for `world` ranks (torchrun's)."""
    convert = dict.fromkeys([name for name, _, _ in table(RULES)], same)
    convert.update(
        train_data=split_path,
        system_prompt=lambda text: text or "",
        val_data=val_path,
        reward_fn=reward_specs,
        reward_weights=weights,
        reward_model=lambda p: p or "",
        reward_model_weight=lambda w, m: w[0] if w and m else SKIP,
        reward_model_only=lambda f, m: not f if m else SKIP,
        out_dir=lambda d: d or "trainer_output",
        resume=lambda p: "auto" if p is True else p or "never",
        dtype=compute_dtype,
        prompt_batch_size=batches(world, lambda b: b.prompts),
        mini_batch_size=batches(world, lambda b: b.mini),
        epochs=lambda e: int(e) if e == int(e) else refuse("num_train_epochs", e, "a whole number of epochs"),
        max_steps=batches(world, lambda b, m: m if m < 1 else b.steps("max_steps", m)),
        lr_schedule=schedule,
        min_lr_ratio=min_lr,
        warmup_steps=batches(world, warmup),
        grad_clip=lambda g: g or refuse("max_grad_norm", g, "ours always clips: give a large value"),
        max_prompt_length=lambda n: SKIP if n is None else n,
        top_k=lambda k: k or -1,
        rollout=rollout_engine,
        gpu_memory_utilization=lambda v, g: g if v else SKIP,
        tis_cap=tis_cap,
        kl_coef=kl_coef,
        clip_high=lambda e, h: e if h is None else h,
        loss_agg=lambda k, s: losses(k, s)[0],
        loss_mode=lambda k, s: losses(k, s)[1],
        tau_pos=lambda k, t: t if k == "sapo" else SKIP,
        tau_neg=lambda k, t: t if k == "sapo" else SKIP,
        norm_adv_by_std=scale,
        max_turns=lambda n: SKIP if n is None else n,
        test_freq=batches(world, lambda b, s, o, n, f: every("eval_steps")(b, o or s, n, f)),
        val_before_train=lambda s, o, e: e and evaluates(s, o),
        val_temperature=lambda s, o, t: t if evaluates(s, o) else SKIP,
        val_n=lambda s, o, e, n: (e or n) if evaluates(s, o) else SKIP,
        save_freq=batches(world, every("save_steps")),
        max_ckpt_to_keep=lambda n: -1 if n is None else n,
        logger=report,
        wandb_project=lambda r, p: p if "wandb" in r else SKIP,
        wandb_run_name=lambda r, n: n if "wandb" in r and n else SKIP,
        collective_timeout=float,
        lora_rank=lambda p, n: n if p else 0,
        lora_alpha=lambda p, a: float(a) if p else SKIP,
        lora_dropout=lambda p, d: d if p else SKIP,
        lora_target_modules=lora_targets,
    )
    return rule_table(RULES, convert, NO_FILL)


def rollout_engine(vllm, mode):
    if vllm and mode != "colocate":
        refuse("vllm_mode", mode, "the engine runs in every rank here (colocate); --rollout-ranks K is our server mode")
    return "vllm" if vllm else "hf"


def tis_cap(vllm, on, mode, cap):
    if not (vllm and on) or mode != "token_truncate":
        return 0.0  # TRL's default sequence_mask has no counterpart: named at start-up as not applied
    return cap


def scale(value):
    ours = {"group": True, True: True, "none": False, False: False}
    return ours[value] if value in ours else refuse("scale_rewards", value, "group or none (batch is not ours)")


def lora_targets(peft, modules):
    if not peft:
        return SKIP
    if modules is None:
        refuse(
            "lora_target_modules", modules, "peft's default depends on the model: name them (all-linear, q_proj,...)"
        )
    return ",".join(modules) if isinstance(modules, list) else modules


# the fields that change nothing here: the values we accept (* any), and why
NO_EFFECT = accepted("""
optim | ["adamw_torch", "adamw_torch_fused", "adamw_hf"] | the optimizer is AdamW
adam_beta1 adam_beta2 adam_epsilon | [0.9, 0.999, 1e-08] | AdamW's (0.9, 0.999, 1e-8)
optim_args optim_target_modules router_aux_loss_coef min_p delta off_policy_mask_threshold vllm_importance_sampling_clip_min vllm_structured_outputs_regex vllm_guided_decoding_regex neftune_noise_alpha model_init_kwargs deepspeed parallelism_config dataset_config dataset_mixture lora_target_parameters lora_modules_to_save chat_template vllm_importance_sampling_cap | [None] | not one we have: leave it null
auto_find_batch_size fp16_full_eval sync_ref_model use_adaptive_entropy use_rslora use_dora load_in_8bit load_in_4bit dataset_streaming trust_remote_code cast_lm_head_to_fp32 | [False] | not one we have: leave it false
label_smoothing_factor | [0] | GRPO has no labels
repetition_penalty | [1] | rollouts sample exactly the trainer's distribution
generation_kwargs chat_template_kwargs | [None, {}] | rollouts sample exactly the trainer's distribution
top_entropy_quantile | [1] | every token is in the loss
multi_objective_aggregation | ["sum_then_normalize"] | the weighted rewards are summed, then normalized
train_sampling_strategy | ["random"] | the data order is a seeded shuffle
lora_task_type | ["CAUSAL_LM"] | a causal LM
shuffle_dataset data_seed | * | the data order is always a seeded shuffle (--seed)
average_tokens_across_devices | * | token-mean is over the optimizer step's tokens on every rank
tf32 bf16_full_eval use_cpu no_cuda | * | the device and dtype are --dtype's, on CUDA when torch finds it
gradient_checkpointing_kwargs | * | checkpointing is torch's non-reentrant kind
torch_compile_backend torch_compile_mode | * | --compile-blocks uses torch.compile's defaults
use_liger_kernel liger_kernel_config use_liger_loss | * | the head's log-probs are computed a block at a time (logprobs.py)
use_cache cache_implementation pad_to_multiple_of ds3_gather_for_generation use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged | * | the engines choose (vllm_engine.py, hf_engine.py)
vllm_model_impl vllm_enable_sleep_mode vllm_max_model_length vllm_max_model_len vllm_device vllm_dtype vllm_enable_prefix_caching | * | vllm_engine.py sets the engine up (its length: max_prompt_length + max_response_length)
vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port | * | vllm_mode server only, which is not ours
torch_empty_cache_steps skip_memory_metrics debug local_rank label_names length_column_name ignore_bias_buffers disable_dropout bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage accelerator_config | * | not a setting here
remove_unused_columns | * | every column of the dataset reaches the reward functions
attn_implementation | * | the model's own attention (transformers' sdpa; vLLM's in the engine)
model_revision | * | the model is a local directory (a revision is the Hub's)
fsdp fsdp_config | * | the policy is always FSDP2, each decoder layer sharded over the ranks
dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order | * | the data is read once, at start-up
ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend | * | the policy is FSDP2 over gloo or NCCL
logging_strategy logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level log_level_replica disable_tqdm logging_dir log_completions log_multimodal num_completions_to_print log_unique_prompts wandb_log_unique_prompts log_completions_hub_repo trackio_space_id trackio_bucket_id trackio_static_space_id wandb_entity wandb_run_group | * | every step is logged (metrics.jsonl), and every sample (samples/)
eval_delay per_device_eval_batch_size prediction_loss_only eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics do_train do_eval do_predict benchmarks load_best_model_at_end metric_for_best_model greater_is_better | * | validation follows eval_strategy (--test-freq); the best model: --early-stop-metric
save_only_model save_on_each_node enable_jit_checkpoint overwrite_output_dir save_safetensors ignore_data_skip restore_callback_states_from_checkpoint full_determinism callbacks | * | checkpoints hold everything an exact resume needs
push_to_hub hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision hub_model_revision overwrite_hub_revision push_to_hub_revision | * | nothing is pushed to the Hub (no network): the model is in out_dir/final_model
ref_model_mixup_alpha ref_model_sync_steps | * | only with sync_ref_model
entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target | * | only with use_adaptive_entropy
vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg | * | only with loss_type vespo, not ours
cosine_min_value_wrong cosine_max_value_wrong cosine_min_value_correct cosine_max_value_correct cosine_max_len repetition_n_grams repetition_max_penalty code_language code_eval_test_batch_size code_eval_scoring_mode parallel_code_exec_per_proc e2b_router_url morph_router_url code_provider ioi_provider max_completion_len soft_punish_cache | * | open-r1's reward settings: your reward file (--reward-fn) holds them
wandb_project | * | open-r1's: TRL's project names the wandb project
""")


def notes(values):
    """[(field, why)] for the settings TRL would act on that we do not: its default importance-sampling correction."""
    if values["use_vllm"] and values["vllm_importance_sampling_correction"]:
        mode = values["vllm_importance_sampling_mode"]
        if mode != "token_truncate":
            why = f"TRL 1.16's {mode} (its default with use_vllm) has no counterpart here and is not applied; "
            return [("vllm_importance_sampling_mode", why + "token_truncate is --tis-cap")]
    return []
