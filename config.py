"""The run's flags: one dataclass, a docstring under every field (cli.py makes them --help), and the
checks on them, made before anything loads: a typo should cost seconds, not an engine load.

    python train_grpo.py --help

Args' defaults are verl's GRPO defaults; DEMO_OVERRIDES replaces some for the tiny demo model. A new
flag is a field with its docstring; the range of its values goes next to it (see rule), and a
constraint between flags (or on files, ranks, the GPU) goes in check_args."""

import dataclasses
import math
import os
from dataclasses import dataclass

from bands import parse_bands
from flag_rules import curriculum_rules, distill_rules, placement_rules, reward_rules, timeout_rules


def rule(default, must_be, ok, loss_mode=None):
    """A field whose values must pass ok(value): otherwise check_args says "--flag must be <must_be>, got <value>".
    With loss_mode, a setting of that --loss-mode only: check_args refuses it changed under another mode."""
    return dataclasses.field(default=default, metadata=dict(must_be=must_be, ok=ok, loss_mode=loss_mode))


def one_of(default, choices):
    """A field with a fixed set of values, exactly those the code consumes (tests/test_config.py holds them
    equal to loss.py's and advantage.py's): --help lists them, argparse refuses anything else, and so does
    check_args (for an Args built in code)."""
    return dataclasses.field(default=default, metadata=dict(choices=choices))


@dataclass
class Args:
    # --- model and data
    model: str = "tiny"
    """Hugging Face model id or local directory; "tiny" builds the random-init demo model locally."""
    train_data: str = ""
    """Training parquet in verl's schema; empty: the synthetic task, written to <out-dir>/data."""
    val_data: str = ""
    """Validation parquet in verl's schema; empty: the synthetic task's test split."""
    prompt_column: str = rule("prompt", "a column's name", lambda v: bool(v.strip()))
    """TRL's prompt-only data: the column whose text is the user's turn (open-r1's dataset_prompt_column)."""
    system_prompt: str = ""
    """TRL's prompt-only data: a system message put before each prompt (open-r1's system_prompt)."""
    out_dir: str = "runs/grpo"
    """Run directory: config.json, metrics.jsonl, samples/ and the final model."""
    reward_fn: str = ""
    """Custom reward, path/to/file.py:function_name (verl's signature); empty: reward.compute_score. Repeat
    the flag (or separate with commas) for several, summed with --reward-weights."""
    reward_weights: str = ""
    """Comma-separated weights, one per --reward-fn (TRL's reward_weights); empty: all 1. Each function's
    score is logged as reward_extra/<file>.<function>/mean."""
    reward_errors: str = one_of("raise", ("raise", "skip"))
    """A reward function that raises, exits, times out or returns no number: raise stops the run naming the
    step and sample; skip scores that sample 0, warns, and counts it in reward/errors (validation too)."""
    reward_timeout: float = rule(300.0, "> 0 seconds", lambda v: v > 0)
    """Seconds one --reward-fn call may take before it counts as a reward error (its worker process is killed)."""
    reward_model: str = ""
    """A learned reward model (reward_model.py): a Hugging Face sequence classifier with one output,
    which scores (prompt, response) with its own chat template; empty: none."""
    reward_model_weight: float = 1.0
    """The reward is the rule reward + this x the reward model's score."""
    reward_model_only: bool = False
    """The reward is this weight x the reward model's score alone; the rule reward is still logged
    (reward_extra/rule/mean) and still scores validation."""
    # --- multi-turn rollouts with tools (multi_turn.py)
    tools: str = ""
    """Tools (TRL's: typed functions with docstrings) the model may call: file.py or file.py:fn1,fn2; empty: single-turn."""
    max_turns: int = rule(5, ">= 1", lambda v: v >= 1)
    """With --tools: the model's turns per sample, all inside --max-response-length (verl's max_assistant_turns)."""
    tool_timeout: float = rule(10.0, "> 0 seconds", lambda v: v > 0)
    """With --tools: seconds one call may run before it is stopped; the model reads an error instead."""
    max_tool_response_length: int = rule(256, ">= 1", lambda v: v >= 1)
    """With --tools: characters of a tool's result the model reads; the rest is cut, with a note (verl's name)."""
    seed: int = rule(0, "in [0, 2**32) (numpy's seed range)", lambda v: 0 <= v < 2**32)
    """Seed for data order, sampling and the tiny model."""
    # --- schedule
    epochs: int = rule(1, ">= 1", lambda v: v >= 1)
    """Passes over the training data."""
    max_steps: int = rule(-1, ">= 1, or -1 to run all --epochs", lambda v: v == -1 or v >= 1)
    """Stop after this many steps (-1: run all epochs)."""
    prompt_batch_size: int = rule(256, ">= 1", lambda v: v >= 1)
    """Prompts per step, over all ranks (verl's data.train_batch_size)."""
    # with n = 1 there is no baseline: advantage.py falls back to the raw reward and the health monitor misreads it
    group_size: int = rule(8, ">= 2: GRPO scores each response against the others to its prompt", lambda v: v >= 2)
    """Responses sampled per prompt, n >= 2 (verl's rollout.n, TRL's num_generations). Not --n: torchrun takes that for its own --nnodes."""
    max_prompt_length: int = rule(512, ">= 1", lambda v: v >= 1)
    """Longer prompts are dropped from the data, with a printed count."""
    max_response_length: int = rule(1024, ">= 1", lambda v: v >= 1)
    """Maximum new tokens per response; longer ones are truncated (response_length/clip_ratio)."""
    # --- rollout
    rollout: str = one_of("auto", ("auto", "vllm", "hf"))  # rollout.make_engine
    """Generation engine: vllm, hf (transformers), or auto (vllm when importable)."""
    temperature: float = rule(
        1.0,
        "> 0: sampling and the trainer's log-probs divide logits by it (greedy is --val-temperature 0)",
        lambda v: v > 0,
    )
    """Sampling temperature for training rollouts, > 0; the trainer's log-probs use it too."""
    top_p: float = rule(1.0, "in (0, 1]", lambda v: 0 < v <= 1)
    """Nucleus sampling for training rollouts, in (0, 1]."""
    top_k: int = rule(-1, ">= 1, or -1 for off", lambda v: v == -1 or v >= 1)
    """Top-k sampling for training rollouts (-1: off)."""
    gpu_memory_utilization: float = rule(0.5, "in (0, 1]", lambda v: 0 < v <= 1)
    """Share of GPU memory vLLM may take (CUDA only)."""
    tensor_parallel_size: int = rule(1, ">= 1", lambda v: v >= 1)
    """vLLM tensor parallelism: this many consecutive ranks share one engine (a divisor of the ranks)."""
    engine_shares_policy: bool = True
    """With the transformers engine (--rollout hf) on one rank: generate with the policy's own weights, as TRL does
    without vLLM (no copy, no sync); not with LoRA or --offload params, or 2+ ranks, whose engine's copy is synced."""
    cuda_graphs: bool = True
    """The transformers engine on CUDA: each new token is one replay of a CUDA graph of the decode step (a static
    KV cache; captured once per batch), not a Python launch of every kernel. --no-cuda-graphs: eagerly."""
    # --- update
    ppo_epochs: int = rule(1, ">= 1", lambda v: v >= 1)
    """Passes over each step's rollouts."""
    mini_batch_size: int = rule(64, ">= 1", lambda v: v >= 1)
    """Prompts per optimizer step, over all ranks (verl's ppo_mini_batch_size)."""
    micro_batch_size: int = rule(16, ">= 1", lambda v: v >= 1)
    """Sequences per forward/backward on each rank (gradient accumulation; verl's ..._per_gpu)."""
    micro_batch_tokens: int = rule(0, ">= 0 (0: off)", lambda v: v >= 0)
    """If > 0, micro-batches are sequences of similar length packed up to this many padded tokens per forward/backward
    (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu); with --share-prompts, whole groups, each prompt once."""
    share_prompts: bool = True
    """Run each prompt once per group in the update and the log-prob passes, its n responses on top of its KV cache:
    the same numbers (to float rounding) for fewer tokens. Micro-batches then hold whole groups (at least one). Off
    by default with --grad-checkpointing, which drops the cache."""
    lr: float = rule(1e-6, ">= 0", lambda v: v >= 0)
    """Peak AdamW learning rate (0 freezes the policy: a test). With --lora-rank, about 10x full fine-tuning's."""
    lr_schedule: str = one_of("constant", ("constant", "cosine"))  # adamw.lr_factor
    """constant or cosine, after warmup."""
    warmup_steps: int = rule(0, ">= 0", lambda v: v >= 0)
    """Linear warmup steps."""
    min_lr_ratio: float = rule(0.0, "in [0, 1]", lambda v: 0 <= v <= 1)
    """Cosine schedule's final lr as a fraction of the peak, in [0, 1]."""
    weight_decay: float = rule(0.01, ">= 0", lambda v: v >= 0)
    """AdamW weight decay."""
    grad_clip: float = rule(1.0, "> 0", lambda v: v > 0)
    """Clip the gradient norm to this; a non-finite norm skips the step."""
    clip_low: float = rule(0.2, "in (0, 1): the ratio is clipped below at 1 - clip_low", lambda v: 0 < v < 1)
    """Clip ratio below 1 (PPO's epsilon), in (0, 1)."""
    clip_high: float = rule(0.2, "> 0", lambda v: v > 0)
    """Clip ratio above 1 (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_c: float = rule(3.0, "> 1 for the dual clip to bound anything", lambda v: v > 1)
    """Dual-clip bound for negative advantages, > 1."""
    loss_agg: str = one_of(
        "token-mean", ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    )
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (loss.agg_loss)."""
    loss_scale_factor: float = rule(0.0, "> 0, or 0 for --max-response-length", lambda v: v >= 0)
    """seq-mean-token-sum-norm (Dr. GRPO) divides the mean of the sequences' token sums by this constant
    (verl's loss_scale_factor); 0: --max-response-length."""
    kl_coef: float = rule(0.001, ">= 0 (0: no KL loss)", lambda v: v >= 0)
    """Weight of the KL loss to the frozen reference; 0 skips the reference model."""
    kl_kind: str = one_of("k3", ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"))
    """KL estimator: k1, abs, k2, k3 (or verl's kl, mse, low_var_kl)."""
    entropy_coef: float = rule(0.0, ">= 0 (0: no bonus)", lambda v: v >= 0)
    """Weight of an entropy bonus (verl's entropy_coeff)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std (GRPO); off: Dr. GRPO."""
    tis_cap: float = rule(
        0.0,
        ">= 1 (a cap below 1 would down-weight tokens the engine and trainer agree on), or 0 for off",
        lambda v: v == 0 or v >= 1,
    )
    """Truncated importance sampling: weight tokens by min(pi_trainer / pi_engine, cap), cap >= 1; 0: off."""
    # --- the GRPO family: what verl and TRL users switch between (README: "Recipes")
    adv_estimator: str = one_of("grpo", ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk"))
    """Advantages (verl's algorithm.adv_estimator): grpo, rloo (leave-one-out baseline), reinforce_plus_plus_baseline
    (group baseline, whitened over the batch's tokens) or grpo_passk (pass@k: only a group's unique best learns)."""
    loss_mode: str = one_of("vanilla", ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov"))
    """Policy loss (loss.py states each): vanilla (PPO's clip per token), gspo (one ratio per sequence; e.g. --clip-low
    3e-4 --clip-high 4e-4), cispo, sapo (--tau-pos/--tau-neg), geo_mean (GMPO; the paper's --clip-low 0.4 --clip-high
    0.4), clip_cov, kl_cov (--clip-cov-*, --kl-cov-ratio, --ppo-kl-coef). gspo, sapo, geo_mean: seq-mean-token-mean."""
    tau_pos: float = rule(1.0, "> 0", lambda v: v > 0, loss_mode="sapo")
    """SAPO's gate temperature for tokens with A > 0: the larger, the faster the update fades as the ratio leaves 1."""
    tau_neg: float = rule(1.05, "> 0", lambda v: v > 0, loss_mode="sapo")
    """SAPO's gate temperature for tokens with A <= 0 (verl suggests a little above --tau-pos)."""
    clip_cov_ratio: float = rule(2e-4, "in (0, 1]", lambda v: 0 < v <= 1, loss_mode="clip_cov")
    """Clip-Cov: the share of a micro-batch's tokens whose gradient is cut, drawn among those of high covariance."""
    clip_cov_lb: float = rule(1.0, ">= 0: it cuts tokens of high covariance", lambda v: v >= 0, loss_mode="clip_cov")
    """Clip-Cov: only tokens whose covariance of advantage and log-prob is above this may be cut."""
    clip_cov_ub: float = rule(5.0, "> 0", lambda v: v > 0, loss_mode="clip_cov")
    """Clip-Cov: only tokens whose covariance is below this may be cut (must be > --clip-cov-lb)."""
    kl_cov_ratio: float = rule(2e-4, "in (0, 1]", lambda v: 0 < v <= 1, loss_mode="kl_cov")
    """KL-Cov: the share of a micro-batch's tokens, those of largest covariance, that get the KL penalty."""
    ppo_kl_coef: float = rule(0.1, ">= 0", lambda v: v >= 0, loss_mode="kl_cov")
    """KL-Cov: the weight of the penalty |logp - old_logp| on those tokens."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more prompts until the step
    holds --prompt-batch-size informative groups."""
    max_gen_batches: int = rule(10, ">= 1", lambda v: v >= 1)
    """With --filter-groups: at most this many rollouts per step; then the step trains on the informative groups it
    has, repeated to fill the batch, and says so (filter/*)."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment: a response within this many tokens of --max-response-length loses up to
    --overlong-penalty-factor, linearly (0: off)."""
    overlong_penalty_factor: float = rule(1.0, ">= 0", lambda v: v >= 0)
    """The most a response at --max-response-length loses to the overlong punishment."""
    mask_truncated: bool = False
    """Truncated responses count for nothing in the loss (TRL's mask_truncated_completions)."""
    engine_logprobs: bool = True
    """Have the engine return each sampled token's log-prob, for the engine-vs-trainer gap
    (training/rollout_*) and --tis-cap. Off: vLLM generation takes about a fifth less time on CPU; no gap metrics."""
    max_staleness: int = rule(0, ">= 0", lambda v: v >= 0)
    """Train on rollouts up to this many policy updates old (TRL's max_staleness; async_rollout.py): step t trains on
    what version t-1-S generated, with AReaL's decoupled loss (--tis-cap: 2 unless given). 0: synchronous."""
    rollout_ranks: int = rule(0, ">= 0", lambda v: v >= 0)
    """The last K torchrun ranks only generate, the others train (rollout_ranks.py); with --max-staleness >= 1
    both sides work at once. 0: every rank trains and generates in turn."""
    stream_rollouts: bool = False
    """With --rollout-ranks and --max-staleness: the rollout ranks generate without pause, loading each new version
    mid-answer, and send each group as it ends (verl's fully async; stream_rollouts.py). Resumes validly, not exactly."""
    # --- on-policy distillation (distill.py, docs/distill.md)
    teacher: str = ""
    """A frozen teacher model directory with --model's tokenizer: each model token's advantage gets --distill-coef x
    (teacher log-prob - student log-prob), the reverse KL's estimate (OPD). --model's own directory: the initial
    policy (the reference copy, or with LoRA the base); self: the current policy (OPSD, no copy); empty: none."""
    distill_coef: float = rule(1.0, ">= 0", lambda v: v >= 0)
    """beta, the weight of the teacher's term in each token's advantage (slime's --opd-kl-coef, default 1)."""
    reward: bool = True
    """Train on the reward's group advantage. --no-reward (with --teacher): pure distillation, the teacher's term
    alone; training rows need no reward_model.ground_truth (rows with one are still scored, for critic/score)."""
    teacher_prompt_key: str = ""
    """OPSD: the teacher reads this column of each training row (or key of its extra_info), chat messages or a
    string, as its prompt (e.g. the question with its solution), then the student's response ids exactly."""
    distill_loss: str = one_of("k1", ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "forward_kl_topk"))
    """The teacher's term (verl's distillation loss_mode, loss.DISTILL_LOSSES): k1 (kl), the reverse KL's estimate as
    an advantage; k2 (mse), k3 (low_var_kl), abs: that estimate's variants, back-propagated as a loss; forward_kl_topk:
    the forward KL over the teacher's --distill-topk most likely tokens at every position, back-propagated."""
    distill_topk: int = rule(32, ">= 1", lambda v: v >= 1)
    """forward_kl_topk: how many of the teacher's likeliest tokens each position compares (verl's topk); 32, or fewer."""
    distill_loss_clamp: float = rule(0.0, "> 0, or 0 for off", lambda v: v >= 0)
    """Each token's distillation loss clamped to [-C, C] (verl's loss_max_clamp); 0: off."""
    distill_logp_clamp: float = rule(0.0, "< 0, or 0 for off", lambda v: v <= 0)
    """forward_kl_topk: both models' top-k log-probs clamped below at this (verl's log_prob_min_clamp, e.g. -10)."""
    distill_clip: float = rule(0.0, "in (0, 1), or 0 for off", lambda v: 0 <= v < 1)
    """k1: 0 adds the teacher's term to the reward's advantage (one surrogate, --clip-low/--clip-high); C > 0 gives
    it a clipped surrogate of its own, ratio in [1 - C, 1 + C] (verl's use_policy_gradient, clip_ratio 0.2)."""
    # --- LoRA (lora.py): train low-rank adapters on the frozen model instead of every weight
    lora_rank: int = rule(0, ">= 0 (0: full fine-tuning)", lambda v: v >= 0)
    """LoRA rank r (0: off, full fine-tuning). LoRA usually wants about 10x full fine-tuning's --lr
    (SmolLM2's example: 1e-4 instead of 1e-5)."""
    lora_alpha: float = rule(32.0, "> 0", lambda v: v > 0)
    """LoRA alpha: the adapters' output is scaled by alpha / r (verl's examples use 32)."""
    lora_target_modules: str = "all-linear"
    """Comma-separated module names that get adapters (e.g. q_proj,v_proj); all-linear: every linear layer of
    the blocks, not the LM head."""
    lora_dropout: float = rule(0.0, "in [0, 1)", lambda v: 0 <= v < 1)
    """Dropout on the adapters' input. Above 0 the trainer's log-probs are no longer the engine's
    sampling distribution, so the PPO ratio starts away from 1."""
    # --- precision and memory
    dtype: str = one_of("fp32", ("auto", "fp32", "bf16"))
    """The compute dtype of the policy, the engine, the reference and a reward model. bf16: FSDP2 mixed
    precision (bf16 forward and backward; fp32 master weights, optimizer states and gradient reduction),
    the same code on CPU and GPU. auto: bf16 on CUDA and on CPUs with native bf16 matmuls (avx512_bf16 or
    AMX), else fp32. The run says which at start-up. Why fp32 stays the default: docs/precision.md."""
    grad_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile_blocks: bool = False
    """torch.compile the policy's MLPs and RMSNorms in every decoder layer, and its final norm (TRL's
    torch_compile compiles the whole model). On one H200, in-process: the update went from 20.1 to 27.0
    percent MFU, its peak 7.4 GiB lower (docs/benchmarks/gpu.md); not yet run inside the trainer on a GPU.
    On a CPU it made no clear difference (0.94x, fp32). The first update compiles (34 s cold on 2 CPU
    cores); where compiling fails (no Triton, no C++ compiler), they run uncompiled, said on stderr. Works
    with LoRA and --grad-checkpointing; not with --offload params."""
    offload: str = one_of("none", ("none", "optimizer", "params", "both"))
    """Keep parts of the policy in CPU memory, to fit a larger model on a GPU (verl's param_offload and
    optimizer_offload). optimizer: AdamW's two states live in CPU memory and visit the GPU for each
    optimizer step. params: FSDP2's CPUOffloadPolicy: the sharded parameters (and the reference's) and
    their gradients live in CPU memory, FSDP2 copies each layer in for its forward and backward, and the
    optimizer steps on the CPU, so its states are there too: both is the same as params. CUDA only."""
    # --- validation, logging, saving
    test_freq: int = rule(10, ">= 1, or -1 for never", lambda v: v == -1 or v >= 1)
    """Validate every this many steps (-1: never)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_temperature: float = rule(0.0, ">= 0 (0: greedy)", lambda v: v >= 0)
    """Validation sampling temperature (0: greedy)."""
    val_max_prompts: int = rule(-1, ">= 1, or -1 for all", lambda v: v == -1 or v >= 1)
    """Validate on at most this many prompts (-1: all)."""
    val_n: int = rule(1, ">= 1", lambda v: v >= 1)
    """Validation samples per prompt: mean@n headlines, with std@n, best@k, worst@k, maj@k, pass@k (eval.py)."""
    curriculum: bool = False
    """reasoning-gym tasks (data written with --level) go up a level after a validation at the threshold (curriculum.py)."""
    curriculum_threshold: float = rule(0.8, "in [0, 1]", lambda v: 0 <= v <= 1)
    """With --curriculum: the held-out accuracy (val-core/.../mean@n) at which a task goes up a level."""
    early_stop_metric: str = ""
    """Stop when this validation metric (e.g. val-core/openai/gsm8k/reward/mean@1) stops improving; empty: off."""
    early_stop_patience: int = rule(3, ">= 1", lambda v: v >= 1)
    """Validations without improvement before stopping; the best policy is saved to <out-dir>/best_model."""
    logger: str = "console,jsonl"
    """Where metrics go, comma-separated (verl's trainer.logger): console (the progress bar and a line per
    validation), jsonl (<out-dir>/metrics.jsonl, the run's record: required), wandb, tensorboard (<out-dir>/tensorboard)."""
    wandb_project: str = ""
    """Weights & Biases project, for --logger ...,wandb (WANDB_MODE=offline works without network)."""
    wandb_run_name: str = ""
    """Weights & Biases run name."""
    verbose: bool = False
    """Let vLLM print its start-up configuration and per-step messages (off: only its warnings and errors)."""
    save_model: bool = True
    """Save the final policy in Hugging Face format to <out-dir>/final_model."""
    profile_step: int = rule(0, ">= 0 (0: none)", lambda v: v >= 0)
    """Record this training step with torch.profiler (0: none): its ops and CUDA kernels by self time, with the
    step's phases, in OUT_DIR/profile_step_N.txt (verl's global_profiler.steps, for one step)."""
    save_freq: int = rule(50, ">= 1, or -1 for no checkpoints", lambda v: v == -1 or v >= 1)
    """Checkpoint every this many steps and after the last one (-1: no checkpoints)."""
    max_ckpt_to_keep: int = rule(-1, ">= 1, or -1 for all", lambda v: v == -1 or v >= 1)
    """Keep only the newest this many checkpoints (-1: all); older ones go once a newer one is complete."""
    health_bands: str = ""
    """Override healthy bands of the live warnings and the end-of-run report, e.g. kl_max=0.05,target=0.9 (bands.Bands)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    collective_timeout: float = rule(600.0, "> 0 seconds", lambda v: v > 0)
    """Seconds a rank waits for the others in a collective before the run stops with a message (a dead or stuck peer);
    above --reward-timeout and --tool-timeout. Raise it if ranks wait longer, e.g. for rank 0 writing a large model."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in --out-dir; never; or a checkpoint path."""
    allow_changed: str = ""
    """Comma-separated flags (e.g. lr,kl_coef) that may differ from the run's when resuming it; the new
    values apply from the resumed step. Other differences are refused (run_dir.RESUMABLE lists the
    flags that may always change: paths, logging, saving, how long to run)."""


# The demo (model "tiny") learns from scratch, which needs far larger steps than fine-tuning a
# pretrained model. These replace the defaults above unless given on the command line.
DEMO_OVERRIDES = dict(lr=3e-4, warmup_steps=5, prompt_batch_size=64, mini_batch_size=64, micro_batch_size=128)
DEMO_OVERRIDES.update(max_prompt_length=32, max_response_length=4, kl_coef=0.0, weight_decay=0.0, entropy_coef=0.01)
DEMO_OVERRIDES.update(group_size=16, lr_schedule="cosine", min_lr_ratio=0.1, max_steps=150, test_freq=10)


def check_args(args, world=1, cuda=None):
    """Every flag's allowed values and the constraints between flags, checked before anything loads: the problems,
    one line each naming the flag and what it accepts; [] if none. `world`: ranks; `cuda`: a GPU? (None: torch says)"""
    fields, a = dataclasses.fields(Args), args  # a: short, so that each rule below fits on one line
    not_finite = [f for f in fields if f.type is float and not math.isfinite(getattr(a, f.name))]
    if not_finite:  # these alone: nan would also fail every comparison below
        return [f"{flag(f.name)} must be a finite number, got {getattr(a, f.name)}" for f in not_finite]
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    problems = [  # each field's own range: rule(...) in Args
        f"{flag(f.name)} must be {f.metadata['must_be']}, got {getattr(args, f.name)}"
        for f in fields
        if "ok" in f.metadata and not f.metadata["ok"](getattr(args, f.name))
    ]
    rules = [  # (what must hold, what to say when it does not)
        # ---- model and data: files we can look for now rather than after the model loads
        (a.model != "", "--model must be a Hugging Face model id or directory, or tiny"),
        (not a.train_data or os.path.exists(a.train_data), f"--train-data {a.train_data}: no such file or directory"),
        (not a.val_data or os.path.exists(a.val_data), f"--val-data {a.val_data}: no such file or directory"),
        (a.out_dir != "", "--out-dir must not be empty"),
        *reward_rules(a),
        (not a.reward_model or os.path.isdir(a.reward_model), f"--reward-model {a.reward_model}: no such directory"),
        (a.reward_model or not a.reward_model_only, "--reward-model-only needs --reward-model DIR"),
        (not a.tools or os.path.isfile(a.tools.partition(":")[0]), f"--tools {a.tools}: no such file"),
        *[(a.tools or getattr(a, n) == getattr(Args, n), f"{flag(n)} needs --tools") for n in TOOL_SETTINGS],
        *[(a.teacher or getattr(a, n) == getattr(Args, n), f"{flag(n)} needs --teacher DIR") for n in DISTILL_SETTINGS],
        *distill_rules(a),
        *curriculum_rules(a),
        # ---- between flags (and a list that must not be empty)
        (a.min_lr_ratio == 0 or a.lr_schedule == "cosine", "--min-lr-ratio is only used by --lr-schedule cosine"),
        (a.tis_cap == 0 or a.engine_logprobs, "--tis-cap needs the engine's log-probs; drop --no-engine-logprobs"),
        (
            a.engine_shares_policy or a.rollout != "vllm",
            "--no-engine-shares-policy is a setting of the transformers engine (--rollout hf); vLLM always has its own copy",
        ),
        *timeout_rules(a),  # a reward function's or a tool's call must end before the other ranks give up waiting
        *placement_rules(a, world),
        (a.lora_target_modules.strip(",") != "", "--lora-target-modules must name modules, or be all-linear"),
        *[
            (
                a.lora_rank > 0 or getattr(a, name) == getattr(Args, name),
                f"{flag(name)} {getattr(a, name)} is a LoRA setting and LoRA is off: add --lora-rank R (R > 0)",
            )
            for name in ("lora_alpha", "lora_target_modules", "lora_dropout")
        ],
        *[
            (
                a.loss_mode == mode or getattr(a, f.name) == f.default,
                f"{flag(f.name)} {getattr(a, f.name)} is a {mode} setting and --loss-mode is {a.loss_mode}: add --loss-mode {mode}",
            )
            for f in fields
            if (mode := f.metadata.get("loss_mode"))
        ],
        (
            a.clip_cov_ub > a.clip_cov_lb,
            f"--clip-cov-ub ({a.clip_cov_ub}) must be > --clip-cov-lb ({a.clip_cov_lb}): no token could be cut",
        ),
        (
            0 <= a.overlong_buffer_len < a.max_response_length or a.overlong_buffer_len == 0,
            f"--overlong-buffer-len must be in [0, --max-response-length ({a.max_response_length})), got {a.overlong_buffer_len}",
        ),
        # ---- what the trainer splits: each rank takes prompt_batch_size / world prompts and
        # mini_batch_size / world of them per optimizer step (so world | mini | prompt)
        (
            a.mini_batch_size < 1 or a.prompt_batch_size % a.mini_batch_size == 0,
            f"--prompt-batch-size ({a.prompt_batch_size}) must be a multiple of --mini-batch-size ({a.mini_batch_size})",
        ),
        (
            a.mini_batch_size < 1 or a.mini_batch_size % max(world - a.rollout_ranks, 1) == 0,
            f"--mini-batch-size ({a.mini_batch_size}) must be a multiple of the number of ranks (WORLD_SIZE={world}"
            + (f" less --rollout-ranks {a.rollout_ranks})" if a.rollout_ranks else ")"),
        ),
        (
            a.offload == "none" or cuda,
            f"--offload {a.offload}: it moves GPU memory to the CPU, and this machine has no CUDA GPU (a CPU run "
            "keeps everything in CPU memory already): use --offload none",
        ),
        (
            not (a.compile_blocks and a.offload in ("params", "both")),
            f"--compile-blocks with --offload {a.offload}: not yet run together (FSDP2 copies each layer in from CPU "
            "memory); use one of them",
        ),
        (
            not (a.share_prompts and a.grad_checkpointing),
            "--share-prompts needs the KV cache, which --grad-checkpointing drops: use one of them",
        ),
        # ---- validation, logging, saving
        (
            not a.early_stop_metric or a.early_stop_metric.startswith(("val-core/", "val-aux/")),
            f"--early-stop-metric {a.early_stop_metric}: expected a validation metric, val-core/... or val-aux/... (e.g. val-core/openai/gsm8k/reward/mean@1)",
        ),
        (not a.early_stop_metric or a.test_freq >= 1, "--early-stop-metric needs validation: set --test-freq >= 1"),
        (
            "jsonl" in loggers(a),
            f"--logger {a.logger}: jsonl is required: metrics.jsonl is the run's record (resume and the health report read it)",
        ),
        ("wandb" not in loggers(a) or a.wandb_project, "--logger wandb needs --wandb-project NAME"),
        (not a.wandb_project or "wandb" in loggers(a), "--wandb-project needs wandb in --logger (e.g. jsonl,wandb)"),
        (not a.wandb_run_name or a.wandb_project, "--wandb-run-name needs --wandb-project"),
        (
            a.resume in ("auto", "never") or os.path.isdir(a.resume),
            f"--resume {a.resume}: no such directory; expected auto, never or a checkpoint directory",
        ),
    ]
    problems += [message for ok, message in rules if not ok]
    problems += [
        f"--logger {name}: expected some of {', '.join(LOGGERS)}" for name in loggers(a) if name not in LOGGERS
    ]
    problems += [f"--allow-changed {n}: no such flag" for n in allowed_changes(a) if n not in {f.name for f in fields}]
    problems += [
        f"{flag(f.name)} {getattr(a, f.name)!r}: expected one of {', '.join(f.metadata['choices'])}"
        for f in fields
        if "choices" in f.metadata and getattr(a, f.name) not in f.metadata["choices"]
    ]
    try:
        parse_bands(a.health_bands)
    except ValueError as e:
        problems.append(f"--health-bands {e}")
    return problems


def flag(name):
    """lora_alpha -> --lora-alpha."""
    return "--" + name.replace("_", "-")


LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
TOOL_SETTINGS = ("max_turns", "tool_timeout", "max_tool_response_length")
DISTILL_SETTINGS = ("distill_coef", "teacher_prompt_key", "distill_loss", "distill_topk", "distill_loss_clamp")
DISTILL_SETTINGS += ("distill_logp_clamp", "distill_clip")


def loggers(args):
    """--logger console,jsonl -> ["console", "jsonl"]."""
    return [name.strip() for name in args.logger.split(",") if name.strip()]


def allowed_changes(args):
    """--allow-changed lr,kl-coef -> {"lr", "kl_coef"}."""
    return {name.strip().lstrip("-").replace("-", "_") for name in args.allow_changed.split(",") if name.strip()}
