"""What every rank sets up before it trains or generates, a trainer and a rollout rank alike: the seeds, the
device mesh and compute dtype, the tokenizer and the tokens that end a response, the tools, the data and the
reward functions; and, at the end, closing what it started. train_grpo.py and rollout_rank.py call these in
the same order, so both sides of a run read the same inputs the same way. Before any of it loads, the trainer
checks the inputs its flags name (check_inputs)."""

import collections
import os
import random

import numpy as np
import torch
import torch.distributed as dist

import data_prep
import distill
import lora
import reward_model
import run_dir
from chat_template import ChatTemplateError
from distributed import print0
from engine import stop_token_ids
from flag_rules import reward_specs, reward_weights
from model_dir import check_context_length, check_model_path
from multi_turn import start_tools
from policy import compute_dtype
from prompt_data import PROMPT_ONLY_SOURCE, DataError
from reward import BUILTIN_SOURCES, compute_score, load_reward_fns
from tasks.common import split_counts
from trl_rewards import check_data
from user_errors import RewardError


def check_inputs(args):
    """Everything named by a flag is checked before the engine loads: a missing directory, weights or
    tokenizer, or a truncated download is named now, not by vLLM later."""
    try:
        check_model_path(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None
    try:  # vLLM's own error for this suggests VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which gives NaN past the positions
        check_context_length(args.model, args.max_prompt_length, args.max_response_length)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.lora_rank:
        lora.check_targets(args.model, args.lora_target_modules)
    if args.reward_model:  # its directory is checked like the policy's, before anything loads
        reward_model.check_reward_model(args.reward_model)
    if args.teacher:  # a model directory with the student's tokenizer (distill.py)
        distill.check_teacher(args)


def start(args, world, device):
    """Seeds, the device mesh of `world` ranks, no orphan worker after the launcher dies, and the compute
    dtype (args.dtype resolved to bf16 or fp32, what the config, checkpoints and export record). Returns
    (mesh, dtype, why that dtype)."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    run_dir.die_with_launcher()  # under torchrun: no orphan worker left writing into the run directory
    dtype, why = compute_dtype(args.dtype, device)  # resolved before the resume check: auto resumes a bf16 run
    args.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
    return mesh, dtype, why


def ranks_here():
    """Ranks on this machine; read before the engine starts: vLLM's CPU platform overwrites it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def tokenizer_and_tools(args):
    """(tokenizer, pad id, the token ids that end a response, the tools or None): --tools runs multi-turn
    rollouts, the tools in a worker process (multi_turn.py)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    except OSError as e:
        raise SystemExit(f"--model {args.model}: cannot load a tokenizer from it ({e})") from e
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = set(stop_token_ids(args.model))
    tools = None
    if args.tools:
        limits = dict(max_turns=args.max_turns, timeout=args.tool_timeout, max_chars=args.max_tool_response_length)
        try:
            tools = start_tools(args.tools, tokenizer, eos_ids, **limits)
        except RuntimeError as e:  # the file does not load, or a function has no type hints or docstring
            raise SystemExit(str(e)) from None
    return tokenizer, pad_id, eos_ids, tools


def read_data(args, tokenizer, tools):
    """(train rows, validation rows, the run's steps: --epochs over the data, at most --max-steps); with
    --teacher-prompt-key, each training row's teacher prompt rendered (distill.teacher_prompts), and the rows whose
    teacher prompt does not fit the teacher's positions dropped (distill.fitting_teacher_prompts)."""
    train_rows, val_rows = load_data(args, tokenizer, tools.schemas if tools else None)
    distill.teacher_prompts(args, tokenizer, train_rows)
    train_rows = distill.fitting_teacher_prompts(args, train_rows)  # those that fit the teacher's positions
    distill.prompt_only_rows(args, train_rows)  # pure distillation on prompts alone: nothing to score
    total_steps = args.epochs * (len(train_rows) // args.prompt_batch_size)
    total_steps = min(total_steps, args.max_steps) if args.max_steps > 0 else total_steps
    return train_rows, val_rows, total_steps


def load_data(args, tokenizer, schemas=None):
    """The training and validation rows of verl's schema with their prompt token ids (row["prompt_ids"]);
    prompts longer than --max-prompt-length are dropped and counted; --val-max-prompts keeps the first validation
    rows of each data_source (first_of_each_source)."""
    known = None if args.reward_fn else BUILTIN_SOURCES  # without --reward-fn, every row needs a built-in reward
    out = []
    for path, name, truth in (
        (args.train_data, "train data", getattr(args, "reward", True)),
        (args.val_data, "validation data", True),
    ):
        try:  # --no-reward: training rows need no ground truth (nor a built-in data_source)
            rows, dropped = data_prep.load_prompts(
                path, tokenizer, known if truth else None, args.max_prompt_length, schemas, truth,
                prompt_column=args.prompt_column, system_prompt=args.system_prompt,
            )  # fmt: skip
        except (DataError, ChatTemplateError) as e:  # names the file (row and field): the message is the error
            raise SystemExit(str(e)) from None
        if dropped:
            limit = f"max_prompt_length={args.max_prompt_length}"
            print0(f"{name}: dropped {dropped} of {len(rows) + dropped} prompts longer than {limit} tokens")
        out.append(rows)
    train_rows, val_rows = out[0], out[1]
    if 0 < args.val_max_prompts < len(val_rows):
        val_rows, said = first_of_each_source(val_rows, args.val_max_prompts)
        if said:
            print0(f"validation data: --val-max-prompts {args.val_max_prompts}: {said}")
    if len(train_rows) < args.prompt_batch_size:
        batch = f"prompt_batch_size={args.prompt_batch_size}"
        raise SystemExit(f"{args.train_data}: {len(train_rows)} usable prompts, fewer than {batch}")
    return train_rows, val_rows


def first_of_each_source(rows, most):
    """(`most` of `rows`, a sentence saying how they were chosen, or None for rows of one data_source): each
    data_source's first rows, as many as its share of the rows (split_counts), in file order. The first `most`
    rows of a file written task by task would validate its first task alone, and no metric would say so. The
    sentence names any data_source too small for one row."""
    sources = [row.get("data_source", PROMPT_ONLY_SOURCE) for row in rows]  # TRL's prompt-only rows name none
    sizes = collections.Counter(sources)  # in file order
    counts = dict(zip(sizes, split_counts(most, list(sizes.values()))))
    if len(sizes) == 1:
        return rows[:most], None
    kept, left = [], dict(counts)
    for row, source in zip(rows, sources):
        if left[source]:
            kept.append(row)
            left[source] -= 1
    shares = ", ".join(f"{source} {n}" for source, n in counts.items() if n)
    said = f"{most} of {len(rows)} prompts, the first of each data_source in proportion: {shares}"
    dropped = [source for source, n in counts.items() if not n]
    if dropped:
        said += f"; none of {', '.join(dropped)}, too small a share for one (raise --val-max-prompts to validate it)"
    return kept, said


def reward_fn(args, train_rows=(), val_rows=(), scores=True):
    """The reward: --reward-fn's functions in a worker process (reward.py), else the built-in compute_score (with
    --no-reward, where a row has a ground truth: distill.labelled_reward); scores=False (a trainer beside rollout
    ranks, which score): no worker is started. The functions are checked against both datasets now, before the
    engine and the model load (trl_rewards.check_data)."""
    specs = reward_specs(args)
    if specs and scores:
        fn = load_reward_fns(specs, reward_weights(args), args.reward_timeout)
        try:
            check_data(fn, train_rows, args.train_data)
            check_data(fn, val_rows, args.val_data)
        except RewardError as e:
            fn.close()
            raise SystemExit(str(e)) from None
        return fn
    return compute_score if args.reward else distill.labelled_reward


def close(engine, tools, source=None, early=False):
    """Free the engine (before destroy_process_group, or vLLM's shutdown fails) and the tool worker; the
    rollout source (rollout_source.py) says the run ended `early`, or waits until its last weights are taken."""
    if engine:
        engine.close()
    if tools:
        tools.close()
    if source:
        source.close(early)
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed it
        dist.destroy_process_group()
