"""GRPO post-training of a causal LM: FSDP2 policy, a vLLM engine colocated in every rank.

    torchrun --nproc_per_node=1 train_grpo.py                  # the demo: tiny local model, synthetic task
    torchrun --nproc_per_node=8 train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --train-data data/gsm8k/train.parquet --val-data data/gsm8k/test.parquet

Every step: sample a global batch of prompts (sharded over ranks) -> generate n responses per
prompt with the rollout engine -> score them -> group-normalized advantages -> old log-probs
(recomputed by the trainer) and reference log-probs -> ppo_epochs x mini-batches x micro-batches
of the clipped surrogate + KL loss -> AdamW step -> copy the new weights into the engine ->
log -> validate -> checkpoint. After a crash, the same command resumes exactly (checkpoint.py).
Signals leaving their healthy band print one-line warnings as they happen, and every run ends
with a health report in <out-dir>/report/ (health.py).

What is kept from verl's GRPO: its data schema, formulas (loss.py, advantage.py), defaults
(clip 0.2, k3 KL loss with coefficient 0.001, token-mean, lr 1e-6) and metric names. What is
dropped: a critic (GRPO needs none), KL in the reward (we use the KL loss, as verl's GRPO
examples do), multi-turn rollouts and sequence packing.
"""

import ast
import dataclasses
import inspect
import json
import math
import os
import random
import resource
import sys
import textwrap
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import data_prep
import health
from advantage import grpo_advantages, zero_std_fraction
from eval import samples_table, validation_metrics
from loss import AGG_MODES, KL_KINDS, agg_denominator, agg_loss, entropy_from_logits, kl_penalty, logprobs_from_logits, policy_loss
from reward import BUILTIN_SOURCES, compute_score, load_reward_fn, score_responses
from rollout import check_model_path


@dataclass
class Args:
    # --- model and data
    model: str = "tiny"
    """Hugging Face model id or local directory; "tiny" builds the random-init demo model locally."""
    train_data: str = ""
    """Training parquet in verl's schema; empty: the synthetic task, written to <out-dir>/data."""
    val_data: str = ""
    """Validation parquet in verl's schema; empty: the synthetic task's test split."""
    out_dir: str = "runs/grpo"
    """Run directory: config.json, metrics.jsonl, samples/ and the final model."""
    reward_fn: str = ""
    """Custom reward, path/to/file.py:function_name (verl's signature); empty: reward.compute_score."""
    seed: int = 0
    """Seed for data order, sampling and the tiny model."""
    # --- schedule
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = -1
    """Stop after this many steps (-1: run all epochs)."""
    prompt_batch_size: int = 256
    """Prompts per step, over all ranks (verl's data.train_batch_size)."""
    group_size: int = 8
    """Responses sampled per prompt, n >= 2 (verl's rollout.n, TRL's num_generations). Not --n: torchrun takes that for its own --nnodes."""
    max_prompt_length: int = 512
    """Longer prompts are dropped from the data, with a printed count."""
    max_response_length: int = 1024
    """Maximum new tokens per response; longer ones are truncated (response_length/clip_ratio)."""
    # --- rollout
    rollout: str = "auto"
    """Generation engine: vllm, hf (transformers), or auto (vllm when importable)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts, > 0; the trainer's log-probs use it too."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling for training rollouts (-1: off)."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (CUDA only)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size (CUDA only)."""
    # --- update
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int = 64
    """Prompts per optimizer step, over all ranks (verl's ppo_mini_batch_size)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on each rank (gradient accumulation; verl's ..._per_gpu)."""
    micro_batch_tokens: int = 0
    """If > 0, micro-batches are sequences of similar length packed up to this many padded tokens
    per forward/backward instead (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu)."""
    lr: float = 1e-6
    """Peak AdamW learning rate (0 freezes the policy: a baseline or a test)."""
    lr_schedule: str = "constant"
    """constant or cosine, after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    min_lr_ratio: float = 0.0
    """Cosine schedule's final lr as a fraction of the peak, in [0, 1]."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this; a non-finite norm skips the step."""
    clip_low: float = 0.2
    """Clip ratio below 1 (PPO's epsilon), in (0, 1)."""
    clip_high: float = 0.2
    """Clip ratio above 1 (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_c: float = 3.0
    """Dual-clip bound for negative advantages, > 1."""
    loss_agg: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    kl_coef: float = 0.001
    """Weight of the KL loss to the frozen reference; 0 skips the reference model."""
    kl_kind: str = "k3"
    """KL estimator: k1, abs, k2, k3 (or verl's kl, mse, low_var_kl)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (verl's entropy_coeff)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std (GRPO); off: Dr. GRPO."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weight tokens by min(pi_trainer / pi_engine, cap), cap >= 1; 0: off."""
    engine_logprobs: bool = True
    """Have the engine return each sampled token's log-prob, for the engine-vs-trainer gap
    (training/rollout_*) and --tis-cap. Off: vLLM generation takes about a fifth less time on CPU; no gap metrics."""
    # --- precision and memory
    grad_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    # --- validation, logging, saving
    test_freq: int = 10
    """Validate every this many steps (-1: never)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0: greedy)."""
    val_max_prompts: int = -1
    """Validate on at most this many prompts (-1: all)."""
    val_n: int = 1
    """Validation samples per prompt: mean@n headlines, with std@n, best@k, worst@k, maj@k, pass@k (eval.py)."""
    early_stop_metric: str = ""
    """Stop when this validation metric (e.g. val-core/openai/gsm8k/reward/mean@1) stops improving; empty: off."""
    early_stop_patience: int = 3
    """Validations without improvement before stopping; the best policy is saved to <out-dir>/best_model."""
    wandb_project: str = ""
    """Log to this Weights & Biases project (WANDB_MODE=offline works without network); empty: off."""
    wandb_run_name: str = ""
    """Weights & Biases run name."""
    save_model: bool = True
    """Save the final policy in Hugging Face format to <out-dir>/final_model."""
    save_freq: int = 50
    """Checkpoint every this many steps and after the last one (-1: no checkpoints)."""
    max_ckpt_to_keep: int = -1
    """Keep only the newest this many checkpoints (-1: all); older ones go once a newer one is complete."""
    health_bands: str = ""
    """Override healthy bands of the live warnings and the end-of-run report, e.g. kl_max=0.05,target=0.9 (health.Bands)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in --out-dir; never; or a checkpoint path."""
    allow_changed: str = ""
    """Comma-separated flags (e.g. lr,kl_coef) that may differ from the run's when resuming it; the new
    values apply from the resumed step. Other differences are refused (checkpoint.RESUMABLE lists the
    flags that may always change: paths, logging, saving, how long to run)."""


# The demo (model "tiny") learns from scratch, which needs far larger steps than fine-tuning a
# pretrained model. These replace the defaults above unless given on the command line.
DEMO_OVERRIDES = dict(
    lr=5e-4, warmup_steps=5, prompt_batch_size=64, mini_batch_size=64, micro_batch_size=128,
    max_prompt_length=32, max_response_length=4, kl_coef=0.0, weight_decay=0.0, entropy_coef=0.01, max_steps=200, test_freq=10,
)  # fmt: skip


def field_docs(cls):
    """The docstring under each dataclass field, read from the source: they become --help."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        a.target.id: b.value.value
        for a, b in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
    }


# Flags with a fixed set of values: exactly those the code consumes (rollout.make_engine, lr_factor
# in main(), loss.agg_loss, loss.kl_penalty). --help lists them; argparse refuses anything else.
CHOICES = dict(rollout=("auto", "vllm", "hf"), lr_schedule=("constant", "cosine"), loss_agg=AGG_MODES, kl_kind=tuple(KL_KINDS))


def check_args(args, world=1):
    """Every flag's allowed values and the constraints between flags, checked before anything loads:
    a typo should cost seconds, not an engine load and a validation pass. Returns the problems, one
    line each naming the flag and what it accepts; [] when all is well. `world` is the number of
    ranks. A new flag gets its rule here."""
    floats = {f.name: getattr(args, f.name) for f in dataclasses.fields(Args) if f.type is float}
    not_finite = [f"--{name.replace('_', '-')} must be a finite number, got {v}" for name, v in floats.items() if not math.isfinite(v)]
    if not_finite:  # these alone: nan would also fail every comparison below
        return not_finite
    a = args  # short, so that each rule below fits on one line
    rules = [  # (what must hold, what to say when it does not)
        # ---- model and data: files we can look for now rather than after the model loads
        (a.model != "", "--model must be a Hugging Face model id or directory, or tiny"),
        (not a.train_data or os.path.exists(a.train_data), f"--train-data {a.train_data}: no such file or directory"),
        (not a.val_data or os.path.exists(a.val_data), f"--val-data {a.val_data}: no such file or directory"),
        (a.out_dir != "", "--out-dir must not be empty"),
        (not a.reward_fn or os.path.isfile(a.reward_fn.partition(":")[0]),
         f"--reward-fn {a.reward_fn}: no such file {a.reward_fn.partition(':')[0]!r}; expected path/to/file.py:function_name"),
        (0 <= a.seed < 2**32, f"--seed must be in [0, 2**32) (numpy's seed range), got {a.seed}"),
        # ---- schedule
        (a.epochs >= 1, f"--epochs must be >= 1, got {a.epochs}"),
        (a.max_steps == -1 or a.max_steps >= 1, f"--max-steps must be >= 1, or -1 to run all --epochs, got {a.max_steps}"),
        (a.prompt_batch_size >= 1, f"--prompt-batch-size must be >= 1, got {a.prompt_batch_size}"),
        # with one response per prompt there is nothing to compare with: advantage.py falls back to
        # the raw reward (REINFORCE without a baseline) and the health monitor misreads it
        (a.group_size >= 2, f"--group-size must be >= 2: GRPO scores each response against the others to its prompt, got {a.group_size}"),
        (a.max_prompt_length >= 1, f"--max-prompt-length must be >= 1, got {a.max_prompt_length}"),
        (a.max_response_length >= 1, f"--max-response-length must be >= 1, got {a.max_response_length}"),
        # ---- rollout
        (a.temperature > 0, f"--temperature must be > 0: sampling and the trainer's log-probs divide logits by it (greedy is --val-temperature 0), got {a.temperature}"),
        (0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}"),
        (a.top_k == -1 or a.top_k >= 1, f"--top-k must be >= 1, or -1 for off, got {a.top_k}"),
        (0 < a.gpu_memory_utilization <= 1, f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}"),
        (a.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}"),
        # ---- update
        (a.ppo_epochs >= 1, f"--ppo-epochs must be >= 1, got {a.ppo_epochs}"),
        (a.mini_batch_size >= 1, f"--mini-batch-size must be >= 1, got {a.mini_batch_size}"),
        (a.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {a.micro_batch_size}"),
        (a.micro_batch_tokens >= 0, f"--micro-batch-tokens must be >= 0 (0: off), got {a.micro_batch_tokens}"),
        (a.lr >= 0, f"--lr must be >= 0, got {a.lr}"),
        (a.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {a.warmup_steps}"),
        (0 <= a.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {a.min_lr_ratio}"),
        (a.min_lr_ratio == 0 or a.lr_schedule == "cosine", "--min-lr-ratio is only used by --lr-schedule cosine"),
        (a.weight_decay >= 0, f"--weight-decay must be >= 0, got {a.weight_decay}"),
        (a.grad_clip > 0, f"--grad-clip must be > 0, got {a.grad_clip}"),
        (0 < a.clip_low < 1, f"--clip-low must be in (0, 1): the ratio is clipped below at 1 - clip_low, got {a.clip_low}"),
        (a.clip_high > 0, f"--clip-high must be > 0, got {a.clip_high}"),
        (a.clip_c > 1, f"--clip-c must be > 1 for the dual clip to bound anything, got {a.clip_c}"),
        (a.kl_coef >= 0, f"--kl-coef must be >= 0 (0: no KL loss), got {a.kl_coef}"),
        (a.entropy_coef >= 0, f"--entropy-coef must be >= 0 (0: no bonus), got {a.entropy_coef}"),
        (a.tis_cap == 0 or a.tis_cap >= 1, f"--tis-cap must be >= 1 (a cap below 1 would down-weight tokens the engine and trainer agree on), or 0 for off, got {a.tis_cap}"),
        (a.tis_cap == 0 or a.engine_logprobs, "--tis-cap needs the engine's log-probs; drop --no-engine-logprobs"),
        # ---- what the trainer splits: each rank takes prompt_batch_size / world prompts and
        # mini_batch_size / world of them per optimizer step (so world | mini | prompt)
        (a.mini_batch_size < 1 or a.prompt_batch_size % a.mini_batch_size == 0,
         f"--prompt-batch-size ({a.prompt_batch_size}) must be a multiple of --mini-batch-size ({a.mini_batch_size})"),
        (a.mini_batch_size < 1 or a.mini_batch_size % world == 0, f"--mini-batch-size ({a.mini_batch_size}) must be a multiple of the number of ranks (WORLD_SIZE={world})"),
        # ---- validation, logging, saving
        (a.test_freq == -1 or a.test_freq >= 1, f"--test-freq must be >= 1, or -1 for never, got {a.test_freq}"),
        (a.val_temperature >= 0, f"--val-temperature must be >= 0 (0: greedy), got {a.val_temperature}"),
        (a.val_max_prompts == -1 or a.val_max_prompts >= 1, f"--val-max-prompts must be >= 1, or -1 for all, got {a.val_max_prompts}"),
        (a.val_n >= 1, f"--val-n must be >= 1, got {a.val_n}"),
        (not a.early_stop_metric or a.early_stop_metric.startswith(("val-core/", "val-aux/")),
         f"--early-stop-metric {a.early_stop_metric}: expected a validation metric, val-core/... or val-aux/... (e.g. val-core/openai/gsm8k/reward/mean@1)"),
        (not a.early_stop_metric or a.test_freq >= 1, "--early-stop-metric needs validation: set --test-freq >= 1"),
        (a.early_stop_patience >= 1, f"--early-stop-patience must be >= 1, got {a.early_stop_patience}"),
        (not a.wandb_run_name or a.wandb_project, "--wandb-run-name needs --wandb-project"),
        (a.save_freq == -1 or a.save_freq >= 1, f"--save-freq must be >= 1, or -1 for no checkpoints, got {a.save_freq}"),
        (a.max_ckpt_to_keep == -1 or a.max_ckpt_to_keep >= 1, f"--max-ckpt-to-keep must be >= 1, or -1 for all, got {a.max_ckpt_to_keep}"),
        (a.resume in ("auto", "never") or os.path.isdir(a.resume), f"--resume {a.resume}: no such directory; expected auto, never or a checkpoint directory"),
    ]  # fmt: skip
    problems = [message for ok, message in rules if not ok]
    fields = {f.name for f in dataclasses.fields(Args)}
    problems += [f"--allow-changed {name}: no such flag" for name in allowed_changes(a) if name not in fields]
    problems += [f"--{name.replace('_', '-')} {getattr(a, name)!r}: expected one of {', '.join(allowed)}" for name, allowed in CHOICES.items() if getattr(a, name) not in allowed]
    try:
        health.parse_bands(a.health_bands)
    except ValueError as e:
        problems.append(f"--health-bands {e}")
    return problems


def allowed_changes(args):
    """--allow-changed lr,kl-coef -> {"lr", "kl_coef"}."""
    return {name.strip().lstrip("-").replace("-", "_") for name in args.allow_changed.split(",") if name.strip()}


def parse_args(argv=None):
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    # no abbreviations: --max-st 5 would otherwise be --max-steps 5, then lost to the demo's max_steps.
    # A short usage line, so that an error is not buried under fifty flags.
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--flag value ...]   (--help lists every flag)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )  # fmt: skip
    docs = field_docs(Args)
    for f in dataclasses.fields(Args):
        flag, help_text = "--" + f.name.replace("_", "-"), f"{docs[f.name]} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=CHOICES.get(f.name), help=help_text)
    args = Args(**vars(parser.parse_args(argv)))
    if args.model == "tiny":
        given = {a.split("=")[0].lstrip("-").replace("-", "_").removeprefix("no_") for a in argv if a.startswith("--")}
        for key, value in DEMO_OVERRIDES.items():
            if key not in given:
                setattr(args, key, value)
    problems = check_args(args, world=int(os.environ.get("WORLD_SIZE", 1)))  # torchrun sets WORLD_SIZE
    if problems:
        parser.error("\n  ".join(problems))
    return args


# ----------------------------------------------------------------------------------------------
# Distributed helpers: every rank computes, rank 0 talks


def print0(*a, **kw):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


def reduce_metrics(metrics):
    """Average metrics over ranks; keys ending in /max or /min take the max or min."""
    if dist.get_world_size() == 1:
        return metrics
    keys = sorted(metrics)
    out = {}
    for op, pick in ((dist.ReduceOp.MAX, "/max"), (dist.ReduceOp.MIN, "/min"), (dist.ReduceOp.SUM, None)):
        sel = [k for k in keys if (k.endswith(pick) if pick else not k.endswith(("/max", "/min")))]
        if not sel:
            continue
        t = torch.tensor([float(metrics[k]) for k in sel], dtype=torch.float64, device=DEVICE)
        dist.all_reduce(t, op=op)
        if pick is None:
            t /= dist.get_world_size()
        out.update(zip(sel, t.tolist()))
    return out


def all_sum(x):
    t = torch.tensor(float(x), dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t)
    return t.item()


# ----------------------------------------------------------------------------------------------
# Batches: prompts left-padded, responses right-padded, so response tokens line up in columns


def make_batch(prompts, responses, pad_id):
    """Token id lists -> tensors. input_ids = [pad.. prompt | response ..pad]: [N, P + R].
    The logits that predict response token t sit at column P - 1 + t."""
    P, R = max(map(len, prompts)), max(max(map(len, responses)), 1)
    n = len(prompts)
    input_ids = torch.full((n, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p) : P] = torch.tensor(p)
        input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, P - len(p) : P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        responses=input_ids[:, P:], response_mask=attention_mask[:, P:].float(), prompt_width=P,
        prompt_lens=[len(p) for p in prompts], response_lens=[max(len(r), 1) for r in responses],
    )  # fmt: skip


def micro_batches(batch, rows, size, max_tokens=0):
    """Split the sequences `rows` (indices into the batch) into micro-batches: `size` at a time, or,
    with max_tokens > 0, sorted by length and packed while rows x padded width <= max_tokens."""
    if max_tokens <= 0:
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    p, r = batch["prompt_lens"], batch["response_lens"]
    out, cur, p_max, r_max = [], [], 0, 0
    for i in sorted(rows, key=lambda i: p[i] + r[i]):
        if cur and (len(cur) + 1) * (max(p_max, p[i]) + max(r_max, r[i])) > max_tokens:
            out.append(cur)
            cur, p_max, r_max = [], 0, 0
        cur.append(i)
        p_max, r_max = max(p_max, p[i]), max(r_max, r[i])
    return out + [cur]


def window(batch, rows):
    """The rows of a batch, cut to the columns they use: the padding every row of them has on the
    left of the prompts and the right of the responses is never computed on."""
    p, r, P = max(batch["prompt_lens"][i] for i in rows), max(batch["response_lens"][i] for i in rows), batch["prompt_width"]
    cols = slice(P - p, P + r)
    view = {k: batch[k][rows, cols] for k in ("input_ids", "attention_mask", "position_ids")}
    view.update(responses=batch["responses"][rows, :r], response_mask=batch["response_mask"][rows, :r], prompt_width=p)
    return view  # response tensors [b, r]


def response_logits(model, view):
    """Forward pass on a window of a batch; returns the logits that predict each response token.
    The LM head runs only on the last r + 1 positions (the window ends with the responses): with a
    real vocabulary, its logits on the prompt would be a large share of the FLOPs and the memory."""
    r = view["responses"].shape[1]
    out = model(
        input_ids=view["input_ids"].to(DEVICE),
        attention_mask=view["attention_mask"].to(DEVICE),
        position_ids=view["position_ids"].to(DEVICE),
        use_cache=False,
        logits_to_keep=r + 1,
    )
    return out.logits[:, :-1]  # [b, r, V]: position prompt_width - 1 + t predicts response token t


@torch.no_grad()
def compute_logprobs(model, batch, micro, max_tokens, temperature):
    """Per-token log-probs of the responses under `model`, micro-batch by micro-batch: [N, R]."""
    out = torch.zeros_like(batch["response_mask"])
    for rows in micro_batches(batch, list(range(out.shape[0])), micro, max_tokens):
        view = window(batch, rows)
        logp = logprobs_from_logits(response_logits(model, view), view["responses"].to(DEVICE), temperature)
        out[rows, : logp.shape[1]] = logp.float().cpu()
    return out


# ----------------------------------------------------------------------------------------------
# Model setup


def load_model(path, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(DEVICE)


def shard(model, mesh, mixed_precision):
    """FSDP2: shard each transformer block, then the rest (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_parameters(model, dtype):
    """Yields (hf_name, full tensor) one parameter at a time: each rank all-gathers its shards, so
    the extra memory is one parameter, not a second model."""
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, full.detach().to(dtype)


def save_hf(model, tokenizer, out_dir, rank):
    """Gather the full state dict to rank 0's CPU and write it in Hugging Face format."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        checkpoint.write_hf(state, model.config, model.generation_config, tokenizer, out_dir)
        print0(f"saved the policy to {out_dir}")
    dist.barrier()


# ----------------------------------------------------------------------------------------------


def main():
    global DEVICE
    args = parse_args()

    # ---------------- setup: processes, device, seeds
    if "RANK" not in os.environ:  # plain `python train_grpo.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    DEVICE = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE.type, (world,))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    checkpoint.die_with_launcher()  # under torchrun: no orphan worker left writing into the run directory

    # ---------------- the run directory: ours alone, and a resume continues the same run. Decided
    # by rank 0 before anything in it is written, and told to every rank.
    decision = [None, None]  # [checkpoint to resume from, why this run may not use the directory]
    if rank == 0:
        try:
            run_lock = checkpoint.lock_run_dir(args.out_dir)  # noqa: F841 (held until the process exits)
            decision[0] = checkpoint.check_run_dir(args.out_dir, args.resume, dataclasses.asdict(args), allowed_changes(args))
        except SystemExit as e:
            decision[1] = str(e)
    dist.broadcast_object_list(decision, src=0)
    resume_from, refusal = decision
    if refusal:
        raise SystemExit(refusal)
    os.makedirs(os.path.join(args.out_dir, "samples"), exist_ok=True)


    # ---------------- model and data paths (the demo builds its own, on rank 0)
    if args.model == "tiny":
        changed = ", ".join(f"{k}={v}" for k, v in DEMO_OVERRIDES.items() if getattr(args, k) == v)
        print0(f"demo: the tiny model learns from scratch, so these replace verl's fine-tuning defaults: {changed}")
        from models import build_tiny_model

        args.model = os.path.join(args.out_dir, "tiny_model")
        if rank == 0:
            build_tiny_model(args.model, data_prep.TASK_WORDS, seed=args.seed)
    if not args.train_data or not args.val_data:
        task_dir = os.path.join(args.out_dir, "data")
        if rank == 0:
            data_prep.write_task(task_dir, seed=args.seed)
        args.train_data = args.train_data or os.path.join(task_dir, "train.parquet")
        args.val_data = args.val_data or os.path.join(task_dir, "test.parquet")
    dist.barrier()
    try:  # a missing directory, weights or tokenizer, or a truncated download: named now, not by vLLM later
        check_model_path(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None

    print0("config:\n" + "\n".join(f"  {k:24s} {v}" for k, v in dataclasses.asdict(args).items()))

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except OSError as e:
        raise SystemExit(f"--model {args.model}: cannot load a tokenizer from it ({e})") from e
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def load_prompts(path, name):
        """Rows of verl's schema with their prompt token ids; over-long prompts dropped, counted."""
        # every row's data_source must have a built-in reward, unless a --reward-fn decides
        try:
            rows = data_prep.load_dataset(path, known_sources=None if args.reward_fn else BUILTIN_SOURCES)
        except data_prep.DataError as e:  # names the file, row and field: the message is the error
            raise SystemExit(str(e)) from None
        for row in rows:
            row["prompt_ids"] = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        kept = [r for r in rows if len(r["prompt_ids"]) <= args.max_prompt_length]
        if len(kept) < len(rows):
            print0(f"{name}: dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than max_prompt_length={args.max_prompt_length} tokens")
        if not kept:
            raise SystemExit(f"{path}: every prompt is longer than max_prompt_length={args.max_prompt_length} tokens")
        return kept

    train_rows = load_prompts(args.train_data, "train data")
    val_rows = load_prompts(args.val_data, "validation data")
    if args.val_max_prompts > 0:
        val_rows = val_rows[: args.val_max_prompts]
    if len(train_rows) < args.prompt_batch_size:
        raise SystemExit(f"{args.train_data}: {len(train_rows)} usable prompts, fewer than prompt_batch_size={args.prompt_batch_size}")
    reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else compute_score

    # ---------------- the engine first (it sets the process's thread count), then the policy
    from rollout import make_engine, stop_token_ids

    engine_dtype = "bfloat16" if cuda else "float32"
    engine = make_engine(
        args.rollout, args.model, max_model_len=args.max_prompt_length + args.max_response_length, dtype=engine_dtype,
        seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size, distributed=True, device=DEVICE,
        max_batch_size=args.prompt_batch_size // world * args.group_size,  # the transformers engine: a step's rollout in one batch
    )  # fmt: skip
    print0(f"rollout engine: {type(engine).__name__}")

    policy = load_model(args.model, torch.float32)  # fp32 master weights; bf16 compute on GPU
    if args.grad_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = shard(policy, mesh, mixed_precision=cuda)
    reference = None
    if args.kl_coef > 0:
        reference = shard(load_model(args.model, torch.float32).eval().requires_grad_(False), mesh, mixed_precision=cuda)
    engine_torch_dtype = getattr(torch, engine_dtype)
    engine.sleep()

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    steps_per_epoch = len(train_rows) // args.prompt_batch_size
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        if args.lr_schedule == "cosine":
            progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
            return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    wandb = None
    if args.wandb_project and rank == 0:
        import wandb

        wandb.init(project=args.wandb_project, name=args.wandb_run_name or None, config=dataclasses.asdict(args), dir=args.out_dir)

    def sampling_seeds(step, first, count):
        """One seed per prompt from (seed, step, the prompt's place in the global batch), so a
        prompt's samples do not depend on how the batch is split over ranks."""
        return [(args.seed * 1_000_003 + step * 100_003 + first + i) % 2**31 for i in range(count)]

    eos_ids = set(stop_token_ids(args.model))

    def decode(ids):
        """The text the reward sees: every token the model wrote except the final EOS. We keep the
        other special tokens (verl drops them): with them dropped, our tiny policy learned to pad
        its answer with <pad> and <bos> instead of ever stopping, and still got full reward."""
        if ids and ids[-1] in eos_ids:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=False)

    def score(rows, texts, first):
        """The reward of each (row, response) pair; `first` numbers the samples in error messages."""
        return score_responses(
            reward_fn, [r["data_source"] for r in rows], texts, [r["reward_model"]["ground_truth"] for r in rows],
            [r.get("extra_info") for r in rows], indices=range(first, first + len(rows)),
        )  # fmt: skip

    def write_samples(name, step, rows, texts, scores, mode):
        """Append readable samples to <out-dir>/samples/<name> (rank 0's share); returns them."""
        samples = [
            dict(step=step, prompt=tokenizer.decode(r["prompt_ids"]), response=text, ground_truth=r["reward_model"]["ground_truth"], score=s)
            for r, text, s in zip(rows, texts, scores)
        ]
        with open(os.path.join(args.out_dir, "samples", name), mode) as f:
            f.writelines(json.dumps(sample) + "\n" for sample in samples)
        return samples

    # ---------------- validation
    def validate(step):
        """Sample val_n responses per validation prompt (greedy by default); verl's val metrics."""
        per_rank = math.ceil(len(val_rows) / world)
        rows = val_rows[rank * per_rank : (rank + 1) * per_rank]
        engine.wake_up()
        out = engine.generate(
            [r["prompt_ids"] for r in rows], n=args.val_n, temperature=args.val_temperature, max_new_tokens=args.max_response_length,
            seeds=sampling_seeds(-1, rank * per_rank, len(rows)), logprobs=False,
        )  # fmt: skip
        engine.sleep()
        samples = [r for r in rows for _ in range(args.val_n)]
        texts = [decode(ids) for ids in out.response_ids]
        scores, extras = score(samples, texts, first=rank * per_rank * args.val_n)
        # every rank gets every score (they are small), so every rank computes the same metrics
        parts = all_gather(dict(sources=[r["data_source"] for r in samples], scores=scores, preds=extras.get("pred")))
        preds = None if any(p["preds"] is None for p in parts) else sum((p["preds"] for p in parts), [])
        metrics = validation_metrics(sum((p["sources"] for p in parts), []), sum((p["scores"] for p in parts), []), args.val_n, preds, seed=args.seed)
        if rank == 0:  # a few samples: on screen, in the run directory, in wandb
            kept = write_samples(f"val_step_{step}.jsonl", step, samples[:20], texts, scores, "w")
            print0(f"validation samples, step {step}:\n" + samples_table(kept[:5]))
            if wandb:
                columns = ["step", "prompt", "response", "ground_truth", "score"]
                wandb.log({"val/generations": wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in kept])}, step=step)
        return metrics

    def should_stop(history):
        """Early stopping from the metric history alone (so a resumed run decides the same way):
        True when the metric has not improved for early_stop_patience validations."""
        values = [(row["step"], row[args.early_stop_metric]) for row in history if args.early_stop_metric in row]
        if not values:
            return False
        best_at = max(range(len(values)), key=lambda i: (values[i][1], -i))  # the first time the best was reached
        return len(values) - 1 - best_at >= args.early_stop_patience

    def after_validation(step, metrics):
        """Check the early-stopping metric exists; save the policy whenever it is the best so far."""
        if not args.early_stop_metric:
            return
        if args.early_stop_metric not in metrics:
            raise SystemExit(f"--early-stop-metric {args.early_stop_metric}: no such validation metric; there are {sorted(metrics)}")
        previous = [row[args.early_stop_metric] for row in history[:-1] if args.early_stop_metric in row]
        if not previous or metrics[args.early_stop_metric] > max(previous):
            save_hf(policy, tokenizer, os.path.join(args.out_dir, "best_model"), rank)

    history = []  # every logged row; checkpoints carry it, so a resumed run's metrics.jsonl is whole
    monitor = health.Monitor(health.parse_bands(args.health_bands), total_steps)

    def log(step, metrics):
        history.append(dict(step=step, **metrics))
        for warning in monitor.update(history[-1]):  # the same on every rank: metrics are reduced
            print0(f"health: {warning}")
        if rank == 0:
            with open(os.path.join(args.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(history[-1]) + "\n")
            if wandb:
                wandb.log(metrics, step=step)

    # ---------------- resume: the newest complete checkpoint, unless told otherwise
    checkpointer = checkpoint.Checkpointer(args.out_dir, args.max_ckpt_to_keep, args.async_save) if args.save_freq > 0 else None
    start_step = 0
    if resume_from:
        state = checkpoint.load(resume_from, policy, optimizer, dataclasses.asdict(args))
        scheduler.load_state_dict(state["scheduler"])
        start_step, history = state["step"], state["metrics"]
        if start_step >= total_steps or (args.early_stop_metric and should_stop(history)):
            raise SystemExit(
                f"{args.out_dir}: this run has finished (step {start_step}, {'early-stopped' if start_step < total_steps else f'of {total_steps}'}). "
                "Raise --max-steps or --epochs to train it further, or pass a new --out-dir for a new run."
            )
        if {"lr", "weight_decay"} & allowed_changes(args):  # the restored optimizer and scheduler hold the old ones
            for group in optimizer.param_groups:
                group["initial_lr"], group["weight_decay"] = args.lr, args.weight_decay
            scheduler.base_lrs = [args.lr] * len(optimizer.param_groups)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * lr_factor(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what actor/lr reports
        for row in history:  # the monitor picks up where it was, without repeating old warnings
            monitor.update(row)
        engine.wake_up()
        engine.update_weights(full_parameters(policy, engine_torch_dtype))
        engine.sleep()
        print0(f"resumed from {resume_from} at step {start_step}")
    if rank == 0:  # rewrite the run's files to what the checkpoint knows; later rows are redone
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=2)
        with open(os.path.join(args.out_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in history)
        train_samples = os.path.join(args.out_dir, "samples", "train.jsonl")
        if os.path.exists(train_samples):
            kept = [line for line in open(train_samples) if json.loads(line)["step"] <= start_step]
            with open(train_samples, "w") as f:
                f.writelines(kept)
    if args.val_before_train and args.test_freq > 0 and start_step == 0:
        val = validate(0)
        print0("validation before training: " + ", ".join(f"{k}={v:.4f}" for k, v in val.items() if k.startswith("val-core")))
        log(0, val)
        after_validation(0, val)

    # ---------------- the loop
    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=start_step, desc="Training Progress", disable=rank != 0, dynamic_ncols=True)
    local_prompts = args.prompt_batch_size // world
    mini_local = args.mini_batch_size // world * args.group_size  # sequences per optimizer step on this rank
    on_policy = args.ppo_epochs == 1 and args.mini_batch_size == args.prompt_batch_size
    order, order_epoch = [], None
    for step in range(start_step + 1, total_steps + 1):
        t_step = time.perf_counter()
        timing, metrics = {}, {}

        # ---- the prompts of this step: a global batch from a seeded shuffle, this rank's share
        epoch, index_in_epoch = divmod(step - 1, steps_per_epoch)
        if epoch != order_epoch:  # the order is a function of (seed, epoch): nothing to save for resume
            order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
            order_epoch = epoch
        first = index_in_epoch * args.prompt_batch_size + rank * local_prompts
        rows = [train_rows[i] for i in order[first : first + local_prompts]]

        # ---- rollout: n responses per prompt
        t = time.perf_counter()
        engine.wake_up()
        out = engine.generate(
            [r["prompt_ids"] for r in rows], n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_new_tokens=args.max_response_length, seeds=sampling_seeds(step, rank * local_prompts, len(rows)),
            logprobs=args.engine_logprobs,
        )  # fmt: skip
        engine.sleep()
        timing["gen"] = time.perf_counter() - t
        checkpoint.crash_point("rollout", step)
        samples = [r for r in rows for _ in range(args.group_size)]  # prompt-major, like the rollout

        # ---- reward
        t = time.perf_counter()
        texts = [decode(ids) for ids in out.response_ids]
        scores, extras = score(samples, texts, first=first * args.group_size)
        timing["reward"] = time.perf_counter() - t

        # ---- advantages: each prompt's group lives on one rank, so this is local
        advantages = grpo_advantages(scores, args.group_size, norm_by_std=args.norm_adv_by_std)  # [N]
        batch = make_batch([r["prompt_ids"] for r in samples], out.response_ids, pad_id)
        mask = batch["response_mask"]  # [N, R]
        engine_logp = torch.zeros_like(mask)
        for i, lp in enumerate(out.logprobs):
            engine_logp[i, : len(lp)] = torch.tensor(lp)
        adv_tokens = advantages[:, None] * mask  # [N, R]

        # ---- old and reference log-probs
        t = time.perf_counter()
        old_logp = None if on_policy else compute_logprobs(policy, batch, args.micro_batch_size, args.micro_batch_tokens, args.temperature)
        timing["old_log_prob"] = time.perf_counter() - t
        t = time.perf_counter()
        ref_logp = compute_logprobs(reference, batch, args.micro_batch_size, args.micro_batch_tokens, args.temperature) if reference else None
        timing["ref"] = time.perf_counter() - t

        # ---- policy update: ppo_epochs x mini-batches x micro-batches
        t = time.perf_counter()
        policy.train()
        stats, trainer_logp = [], torch.zeros_like(mask)
        for _ in range(args.ppo_epochs):
            for m0 in range(0, mask.shape[0], mini_local):
                mini = slice(m0, m0 + mini_local)
                # each micro-batch's loss is weighted so the summed gradient is agg_loss over the
                # whole global mini-batch; FSDP averages gradients over ranks, hence the * world
                whole = agg_denominator(mask[mini], args.loss_agg)
                whole = None if whole is None else all_sum(whole)
                optimizer.zero_grad(set_to_none=True)
                rows = list(range(m0, min(m0 + mini_local, mask.shape[0])))
                for mb in micro_batches(batch, rows, args.micro_batch_size, args.micro_batch_tokens):
                    view = window(batch, mb)  # only the columns these rows use
                    m, r = view["response_mask"].to(DEVICE), view["responses"].shape[1]  # [b, r]
                    logits = response_logits(policy, view)
                    logp = logprobs_from_logits(logits, view["responses"].to(DEVICE), args.temperature)
                    old = logp.detach() if old_logp is None else old_logp[mb, :r].to(DEVICE)
                    if args.engine_logprobs:  # for the engine-vs-trainer gap; a device sync, so only when asked
                        trainer_logp[mb, :r] = old.float().cpu()
                    is_weights = None
                    if args.tis_cap > 0:
                        is_weights = torch.exp(old - engine_logp[mb, :r].to(DEVICE)).clamp(max=args.tis_cap) * m
                    pg_loss, pg_metrics = policy_loss(
                        logp, old, adv_tokens[mb, :r].to(DEVICE), m, args.clip_low, args.clip_high, args.clip_c,
                        args.loss_agg, rollout_is_weights=is_weights, norm_len=args.max_response_length,
                    )  # fmt: skip
                    loss = pg_loss
                    kl_loss = torch.zeros(())
                    if reference is not None:
                        kl = kl_penalty(logp, ref_logp[mb, :r].to(DEVICE), args.kl_kind)
                        kl_loss = agg_loss(kl, m, args.loss_agg, args.max_response_length)
                        loss = loss + args.kl_coef * kl_loss
                    with torch.set_grad_enabled(args.entropy_coef > 0):
                        entropy = agg_loss(entropy_from_logits(logits), m, args.loss_agg, args.max_response_length)
                    if args.entropy_coef > 0:
                        loss = loss - args.entropy_coef * entropy
                    piece = agg_denominator(m, args.loss_agg)
                    weight = world if whole is None else piece / max(whole, 1) * world
                    (loss * weight).backward()
                    checkpoint.crash_point("update", step)
                    stats.append(dict(pg_loss=pg_loss.item(), kl_loss=kl_loss.item(), entropy=entropy.item(), policy_loss=loss.item(),
                                      tokens=m.sum().item(), **{k: v.item() for k, v in pg_metrics.items()}))  # fmt: skip
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
                if math.isfinite(grad_norm):
                    optimizer.step()
                else:
                    metrics["actor/skipped_updates"] = metrics.get("actor/skipped_updates", 0) + 1
                    print0(f"step {step}: gradient norm is {grad_norm}; skipping this optimizer step")
                optimizer.zero_grad(set_to_none=True)
                stats[-1]["grad_norm"] = grad_norm
        metrics["actor/lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        timing["update_actor"] = time.perf_counter() - t

        # ---- copy the new weights into the engine, one parameter at a time
        t = time.perf_counter()
        engine.wake_up()
        engine.update_weights(full_parameters(policy, engine_torch_dtype))
        engine.sleep()
        timing["update_weights"] = time.perf_counter() - t
        timing["step"] = time.perf_counter() - t_step

        # ---- metrics, verl's names, reduced over ranks
        def token_mean(key):
            """A per-micro-batch token mean, averaged over all micro-batches of all ranks by tokens."""
            return all_sum(sum(s[key] * s["tokens"] for s in stats)) / max(all_sum(sum(s["tokens"] for s in stats)), 1)

        for key in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "policy_loss"):
            metrics[f"actor/{key}"] = token_mean(key)
        grad_norms = [s["grad_norm"] for s in stats if "grad_norm" in s]  # one per optimizer step, equal on all ranks
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        resp_len = mask.sum(-1)
        prompt_len = torch.tensor([len(r["prompt_ids"]) for r in samples], dtype=torch.float)
        score_t = torch.tensor(scores)
        for name, t_ in (("critic/score", score_t), ("critic/advantages", advantages), ("response_length", resp_len), ("prompt_length", prompt_len)):
            metrics.update({f"{name}/mean": t_.mean().item(), f"{name}/max": t_.max().item(), f"{name}/min": t_.min().item()})
        metrics["response_length/clip_ratio"] = float(np.mean(out.truncated))
        metrics["frac_reward_zero_std"] = zero_std_fraction(scores, args.group_size)
        if args.engine_logprobs:  # how far the engine's sampling distribution is from the trained policy
            gap = (trainer_logp - engine_logp).abs() * mask
            prob_gap = (trainer_logp.exp() - engine_logp.exp()).abs() * mask
            metrics["training/rollout_probs_diff_max"] = prob_gap.max().item()
            metrics["training/rollout_probs_diff_mean"] = (prob_gap.sum() / mask.sum().clamp(min=1)).item()
            metrics["training/rollout_logprob_diff_max"] = gap.max().item()
        for key, values in extras.items():
            numeric = [float(v) for v in values if isinstance(v, (int, float))]
            if numeric:
                metrics[f"reward_extra/{key}/mean"] = sum(numeric) / len(numeric)
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = mask.sum().item() + prompt_len.sum().item()
        metrics["perf/total_num_tokens"] = all_sum(tokens)  # prompt + response tokens, all ranks
        metrics["perf/throughput"] = tokens / timing["step"]  # tokens/s per rank, as verl reports it
        metrics["perf/max_memory_allocated_gb"] = (
            torch.cuda.max_memory_allocated() / 2**30 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        )
        metrics = reduce_metrics(metrics)
        metrics["training/epoch"] = epoch

        if args.test_freq > 0 and (step % args.test_freq == 0 or step == total_steps):
            t = time.perf_counter()
            metrics.update(validate(step))
            metrics["timing_s/testing"] = time.perf_counter() - t
        log(step, metrics)
        if any(k.startswith("val-") for k in metrics):
            after_validation(step, metrics)
        stop = args.early_stop_metric and should_stop(history)
        if rank == 0:  # the first prompt's group
            write_samples("train.jsonl", step, samples[: args.group_size], texts, scores, "a")
        bar.set_postfix(
            policy_loss=f"{metrics['actor/policy_loss']:.4f}", pg_loss=f"{metrics['actor/pg_loss']:.4f}",
            entropy=f"{metrics['actor/entropy']:.4f}", kl_loss=f"{metrics['actor/kl_loss']:.5f}",
            adv_mean=f"{metrics['critic/advantages/mean']:.4f}", reward=f"{metrics['critic/score/mean']:.4f}",
            grad_norm=f"{metrics['actor/grad_norm']:.2f}",
        )  # fmt: skip
        bar.update(1)
        if any(k.startswith("val-core") for k in metrics):
            bar.write("step {}: {}".format(step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("val-core"))))

        # ---- checkpoint: everything needed to continue this run exactly
        if checkpointer:
            checkpointer.poll()  # publish a finished background save now, not at the next save
        if checkpointer and (step % args.save_freq == 0 or step == total_steps or stop):
            trainer_state = dict(epoch=epoch, scheduler=scheduler.state_dict(), config=dataclasses.asdict(args), metrics=history)
            checkpointer.save(step, policy, optimizer, trainer_state, tokenizer)
        if stop:
            bar.write(f"early stop at step {step}: {args.early_stop_metric} has not improved for {args.early_stop_patience} validations")
            break
    bar.close()
    if checkpointer:
        checkpointer.wait()  # a background save must finish before we exit

    # ---------------- save the policy (never the reference) in Hugging Face format
    if args.save_model:
        save_hf(policy, tokenizer, os.path.join(args.out_dir, "final_model"), rank)
    if rank == 0:  # last, so nothing is lost if it fails: the end-of-run health report, from the run directory alone
        path, verdicts = health.write_report(args.out_dir)
        print0(f"health report: {path}: {verdicts['overall']} ({verdicts['problem']} problem, {verdicts['watch']} watch, {verdicts['healthy']} healthy)")
    if wandb:
        wandb.finish()
    engine.close()  # before destroy_process_group, or vLLM's shutdown fails
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed it
        dist.destroy_process_group()


def all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    main()
