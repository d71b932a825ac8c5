"""Evaluation: verl's validation metrics, and a standalone evaluator for any Hugging Face model.

    python eval.py --model runs/grpo/final_model --data runs/grpo/data/test.parquet --n 8 --temperature 0.6
    torchrun --nproc_per_node=2 eval.py --model ... --data ... --samples 8   # the data is split over ranks
    python eval.py report runs/grpo [--bands kl_max=0.05,target=0.9]        # a run's health report (report.py)

Per data source, over each prompt's n samples (then averaged over prompts):
    mean@n                 the average score
    std@n                  the standard deviation of the n scores
    best@k / worst@k       the expected max / min score of k samples drawn from the n (bootstrap,
                           fixed seed), for k = 2, 4, 8, ... up to n; reported as /mean and /std
    maj@k                  the score of the majority answer among k samples, when the reward returns
                           a "pred" to vote on (verl's convention)
    pass@k                 unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), c full scores
Names follow verl: val-core/<data_source>/reward/mean@n (the headline), val-aux/... for the rest.
"""

import argparse
import json
import math
import os
import sys
from collections import Counter, defaultdict

import numpy as np

# ----------------------------------------------------------------------------------------------
# Metrics of one prompt's n samples


def pass_at_k(n, c, k):
    """Unbiased estimate of P(at least one of k samples is correct) from c correct out of n."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bootstrap(values, k, reduce, n_boot=1000, seed=42):
    """Mean and std of `reduce` over n_boot draws of k values (with replacement), fixed seed.
    `reduce` maps the [n_boot, k] array of drawn values to [n_boot] results."""
    rng = np.random.default_rng(seed)
    draws = np.asarray(values)[rng.integers(0, len(values), size=(n_boot, k))]  # [n_boot, k]
    results = reduce(draws)
    return float(np.mean(results)), float(np.std(results))


def majority(scores, preds):
    """The score of the most common prediction (ties: the first seen)."""
    winner = Counter(preds).most_common(1)[0][0]
    return scores[preds.index(winner)]


def sample_sizes(n):
    """k = 2, 4, 8, ... below n, then n itself."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n > 1 else []


def prompt_metrics(scores, preds=None, full_score=1.0, seed=42):
    """Every metric of one prompt's n samples, as {name: value}."""
    n = len(scores)
    out = {f"mean@{n}": float(np.mean(scores))}
    if n > 1:
        out[f"std@{n}"] = float(np.std(scores))
    correct = sum(s >= full_score for s in scores)
    for k in sample_sizes(n):
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = bootstrap(scores, k, lambda d: d.max(1), seed=seed)
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = bootstrap(scores, k, lambda d: d.min(1), seed=seed)
        if preds is not None:  # draw sample indices, vote among their predictions
            vote = lambda d: np.array([majority([scores[i] for i in row], [preds[i] for i in row]) for row in d])  # noqa: E731
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = bootstrap(list(range(n)), k, vote, seed=seed)
    for k in [1] + sample_sizes(n):
        out[f"pass@{k}"] = pass_at_k(n, correct, k)
    return out


def validation_metrics(data_sources, scores, group_size, preds=None, seed=42):
    """verl-named metrics per data source from prompt-major samples (each prompt's n adjacent)."""
    by_source = defaultdict(list)
    # maj@k for the sources whose reward gives a pred (a response without an answer: None, a vote like
    # any other); not for a source whose reward gives none (GSM8K's float beside MATH's dict)
    voting = {s for s, p in zip(data_sources, preds or []) if p is not None}
    for i in range(0, len(scores), group_size):
        group_preds = preds[i : i + group_size] if data_sources[i] in voting else None
        by_source[data_sources[i]].append(prompt_metrics(scores[i : i + group_size], group_preds, seed=seed))
    metrics = {}
    for source, rows in sorted(by_source.items()):
        for name in rows[0]:
            section = "val-core" if name == f"mean@{group_size}" else "val-aux"
            metrics[f"{section}/{source}/reward/{name}"] = float(np.mean([r[name] for r in rows]))
    return metrics


def samples_table(samples, width=48):
    """Samples ({prompt, response, ground_truth, score}) as a plain-text table, one line each.
    Prompts keep their end (where the question is); newlines are shown as \\n."""

    def cell(text, keep_end=False):
        text = str(text).replace("\n", "\\n")
        if len(text) <= width:
            return text.ljust(width)
        return ("..." + text[-(width - 3) :]) if keep_end else (text[: width - 3] + "...")

    lines = [f"{'prompt':{width}s} | {'response':{width}s} | {'ground_truth':12s} | score"]
    lines.append("-" * len(lines[0]))
    for s in samples:
        lines.append(
            f"{cell(s['prompt'], keep_end=True)} | {cell(s['response'])} | {str(s['ground_truth'])[:12]:12s} | {s['score']:.3f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Validation: the trainer's, every --test-freq steps, and this file's standalone evaluation


def validate(
    engine,
    rows,
    tokenizer,
    reward_fn,
    eos_ids,
    *,
    n,
    temperature,
    max_new_tokens,
    seed,
    top_p=1.0,
    rank=0,
    world=1,
    keep=20,
    errors="raise",
    where="validation",
    tools=None,
    tp=1,
    step=0,
):
    """Sample n responses to each row's prompt (row["prompt_ids"], data_prep.load_prompts) with
    `engine`, score them, and compute verl's validation metrics over every rank's samples.

    Each rank takes its contiguous share of `rows`; each prompt's seed comes from its place in the
    whole list (rollout.sampling_seeds), so 1 and 2 ranks draw the same samples. Returns (metrics,
    the first `keep` of this rank's samples as {prompt, response, ground_truth, score}).
    errors and where go to reward.score_rows (--reward-errors; "validation at step 2" for its messages);
    with errors="skip", val-aux/reward/errors counts the samples of all ranks that scored 0 for a reward error.
    With `tools` (multi_turn.ToolSetup) the samples are multi-turn conversations, and val-aux/num_turns/*
    and val-aux/tool/* describe them. tp: the ranks of a tensor-parallel group (rollout.collect_rollout)
    generate one share together, each rank `rank` of `world` groups; one copy of each share counts.
    TRL-style reward functions (trl_rewards.py) see `step` as trainer_state.global_step; a prompt-only
    dataset's rows, which have no data_source, are named prompt_data.PROMPT_ONLY_SOURCE."""
    from distributed import all_gather
    from multi_turn import turn_counts, turn_metrics
    from prompt_data import PROMPT_ONLY_SOURCE
    from rollout import VALIDATION_STEP, generate, response_texts, sampling_seeds
    from run_log import sample_records
    from trl_rewards import function_metrics, score_rows

    per_rank = math.ceil(len(rows) / world)
    first = rank * per_rank
    mine = rows[first : first + per_rank]
    seeds = sampling_seeds(seed, VALIDATION_STEP, first, len(mine))
    kw = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seeds=seeds, logprobs=False)
    out = generate(engine, mine, tools, **kw)
    samples = [r for r in mine for _ in range(n)]  # prompt-major, like the rollout
    texts = response_texts(out, tokenizer, eos_ids)
    conversations = [t.conversation for t in out.turns] if tools else None
    # what training's rollout.score_samples gives reward functions: the tokens and whether each was cut off
    kw = dict(response_ids=out.response_ids, truncated=out.truncated, conversations=conversations)
    scores, extras = score_rows(reward_fn, samples, texts, first=first * n, errors=errors, where=where, step=step, **kw)
    # every rank gets every score (they are small), so every rank computes the same metrics
    local = dict(
        sources=[r.get("data_source", PROMPT_ONLY_SOURCE) for r in samples], scores=scores, preds=extras.get("pred")
    )
    local.update(errors=sum(extras.get("reward_error", [])), turns=turn_counts(out.turns))
    local["rewards"] = {k: v for k, v in extras.items() if k.startswith("rewards/")}  # TRL-style functions' values
    parts = all_gather(local)[::tp] if world > 1 else [local]
    preds = None if any(p["preds"] is None for p in parts) else sum((p["preds"] for p in parts), [])
    sources, all_scores = sum((p["sources"] for p in parts), []), sum((p["scores"] for p in parts), [])
    metrics = validation_metrics(sources, all_scores, n, preds, seed=seed)
    metrics.update(function_metrics([p["rewards"] for p in parts], prefix="val-aux/"))  # training's rewards/*
    if errors == "skip":
        metrics["val-aux/reward/errors"] = sum(p["errors"] for p in parts)
    if tools:
        metrics.update({f"val-aux/{k}": v for k, v in turn_metrics(sum((p["turns"] for p in parts), [])).items()})
        texts = [t.shown() for t in out.turns]  # the tables show the whole conversation
    return metrics, sample_records(tokenizer, samples[:keep], texts, scores, extras)


# The trainer's validation, every --test-freq steps


def run_validation(step, *, engine, val_rows, tokenizer, reward_fn, eos_ids, args, rank, world, log, tools):
    """eval.validate on the validation prompts; its samples go to the run's log. Returns the metrics."""
    how = dict(val_rows=val_rows, tokenizer=tokenizer, reward_fn=reward_fn, eos_ids=eos_ids, args=args, tools=tools)
    metrics, samples = validate_step(step, engine=engine, rank=rank, world=world, **how)
    return log_validation(step, metrics, samples, log)


def validate_step(step, *, engine, val_rows, tokenizer, reward_fn, eos_ids, args, rank, world, tools):
    """The validation after `step` updates with the trainer's flags: (metrics, samples)."""
    engine.wake_up()
    kw = dict(n=args.val_n, temperature=args.val_temperature, max_new_tokens=args.max_response_length, seed=args.seed)
    kw.update(errors=args.reward_errors, where=f"validation at step {step}", tools=tools, step=step)
    tp = args.tensor_parallel_size  # a TP group's ranks generate its share together
    metrics, samples = validate(
        engine, val_rows, tokenizer, reward_fn, eos_ids, rank=rank // tp, world=world // tp, tp=tp, **kw
    )
    engine.sleep()
    return metrics, samples


def log_validation(step, metrics, samples, log):
    """A validation's samples into the run's log; returns its metrics."""
    log.samples(f"val_step_{step}.jsonl", step, samples, mode="w", table="val/generations")
    if step == 0:  # once, so the console shows what the prompts and responses look like
        log.write(f"validation samples, step 0:\n{samples_table(samples[:3])}")
    return metrics


def keep_best(history, args, policy, tokenizer, rank):
    """With --early-stop-metric: check the metric exists; save the policy whenever it is the best so far."""
    import torch

    from policy import save_hf
    from run_log import is_best

    if not args.early_stop_metric:
        return
    if args.early_stop_metric not in history[-1]:
        names = sorted(k for k in history[-1] if k.startswith("val-"))
        raise SystemExit(f"--early-stop-metric {args.early_stop_metric}: no such validation metric; there are {names}")
    if is_best(history, args.early_stop_metric):
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        save_hf(
            policy, tokenizer, os.path.join(args.out_dir, "best_model"), rank, step=history[-1]["step"], dtype=dtype
        )


# ----------------------------------------------------------------------------------------------
# Standalone evaluation


def report(argv):
    """`python eval.py report RUN_DIR`: write the run's health report (report.py) and print it."""
    import report
    from bands import parse_bands

    parser = argparse.ArgumentParser(
        prog="eval.py report",
        description=report.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", help="a train_grpo.py --out-dir (holds metrics.jsonl)")
    parser.add_argument("--bands", default=None, help="name=value,... (bands.Bands); default: the run's --health-bands")
    args = parser.parse_args(argv)
    try:
        bands = None if args.bands is None else parse_bands(args.bands)
    except ValueError as e:
        parser.error(f"--bands {e}")
    try:
        path, verdicts = report.write_report(args.run_dir, bands)
    except (OSError, ValueError) as e:
        raise SystemExit(f"eval.py report: {e}") from None
    print(open(path).read())
    print(f"wrote {path}: {verdicts['overall']}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report(argv[1:])
    from cli import Append
    from flag_rules import reward_rules, reward_specs, reward_weights  # the trainer's --reward-fn/--reward-weights

    # no abbreviations: a misspelt flag is an error, not silently some other flag
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory or hub id")
    parser.add_argument("--data", required=True, help="parquet in verl's schema")
    parser.add_argument(
        "--n",
        "--samples",
        dest="n",
        type=int,
        default=1,
        help="samples per prompt, >= 1 (under torchrun write --samples: torchrun takes --n for itself)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="maximum response length, >= 1")
    parser.add_argument("--max-prompts", type=int, default=-1, help="evaluate at most this many prompts (-1: all)")
    parser.add_argument(
        "--rollout",
        default="auto",
        choices=("auto", "vllm", "hf"),
        help="generation engine (rollout.make_engine); auto: vllm when importable",
    )
    parser.add_argument(
        "--reward-fn",
        action=Append,
        default="",
        help="path/to/file.py:function_name; repeat for several (summed with --reward-weights); empty: reward.compute_score",
    )
    parser.add_argument(
        "--reward-weights", default="", help="comma-separated weights, one per --reward-fn; empty: all 1"
    )
    parser.add_argument("--tools", default="", help="file.py or file.py:fn1,fn2: multi-turn, as train_grpo.py --tools")
    parser.add_argument("--max-turns", type=int, default=5, help="with --tools: the model's turns per sample, >= 1")
    parser.add_argument("--tool-timeout", type=float, default=10.0, help="with --tools: seconds per call, > 0")
    parser.add_argument(
        "--max-tool-response-length", type=int, default=256, help="with --tools: characters of a result, >= 1"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="the engine's dtype; auto: bf16 on CUDA and on CPUs with native bf16 matmuls, else fp32",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed, >= 0")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="let vLLM print its start-up configuration and progress (off: only its warnings and errors)",
    )
    parser.add_argument(
        "--out",
        default="",
        help="write the metrics as JSON here (default: eval_<data name>.json beside the model if it is a directory)",
    )
    args = parser.parse_args(argv)
    rules = [  # (what must hold, what to say when it does not), checked before anything loads
        (args.n >= 1, f"--n/--samples must be >= 1, got {args.n}"),
        (
            0 <= args.temperature < math.inf,
            f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}",
        ),
        (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
        (args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (
            args.max_prompts == -1 or args.max_prompts >= 1,
            f"--max-prompts must be >= 1, or -1 for all, got {args.max_prompts}",
        ),
        (args.seed >= 0, f"--seed must be >= 0, got {args.seed}"),
        (not args.tools or os.path.isfile(args.tools.partition(":")[0]), f"--tools {args.tools}: no such file"),
        (args.max_turns >= 1, f"--max-turns must be >= 1, got {args.max_turns}"),
        (0 < args.tool_timeout < math.inf, f"--tool-timeout must be > 0 seconds, got {args.tool_timeout}"),
        (
            args.max_tool_response_length >= 1,
            f"--max-tool-response-length must be >= 1, got {args.max_tool_response_length}",
        ),
        *reward_rules(args),
    ]
    problems = [message for ok, message in rules if not ok]
    if problems:
        parser.error("\n  ".join(problems))

    if not args.verbose:  # read once, as torch loads: console.py says what this keeps off the console
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    import data_prep
    from chat_template import ChatTemplateError
    from console import quiet
    from engine import stop_token_ids
    from memory import free_memory_gib
    from model_dir import check_model_path, context_length
    from policy import compute_dtype
    from reward import BUILTIN_SOURCES, compute_score, load_reward_fns
    from rollout import make_engine
    from trl_rewards import check_data

    quiet(args.verbose)

    distributed = "RANK" in os.environ
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # read now: vLLM's CPU platform overwrites it
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    try:
        check_model_path(args.model)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--model: {err}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)  # see check_model_path
    except OSError as err:  # not a local directory, so transformers took it for a hub id
        raise SystemExit(
            f"--model {args.model}: not a local model directory, and it cannot be loaded as a Hugging Face hub id ({err})"
        ) from None
    tools = None
    if args.tools:
        from multi_turn import start_tools

        limits = dict(max_turns=args.max_turns, timeout=args.tool_timeout, max_chars=args.max_tool_response_length)
        try:
            tools = start_tools(args.tools, tokenizer, stop_token_ids(args.model), **limits)
        except RuntimeError as err:  # names the file and the function
            raise SystemExit(str(err)) from None
    try:
        known = None if args.reward_fn else BUILTIN_SOURCES
        rows, _ = data_prep.load_prompts(args.data, tokenizer, known, schemas=tools.schemas if tools else None)
    except (data_prep.DataError, ChatTemplateError) as err:
        raise SystemExit(str(err)) from None
    if args.max_prompts > 0:
        rows = rows[: args.max_prompts]
    try:  # before the engine loads: reward functions that cannot load, or cannot score these rows, say so now
        reward_fn = load_reward_fns(reward_specs(args), reward_weights(args)) if args.reward_fn else compute_score
        check_data(reward_fn, rows, args.data)  # a RewardError
    except RuntimeError as err:
        raise SystemExit(str(err)) from None
    max_len = max(len(r["prompt_ids"]) for r in rows) + args.max_new_tokens
    limit, source = context_length(args.model)  # a local directory's, by vLLM's rule
    if limit is None and not os.path.isdir(args.model):  # a hub id: its downloaded config's
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=False)
        limit, source = getattr(config, "max_position_embeddings", None), "max_position_embeddings"
    if limit and max_len > limit:  # responses stop at the model's context length instead
        print(
            f"the longest prompt + --max-new-tokens is {max_len} tokens; the model has {limit} positions, "
            f"so responses stop there ({source})"
        )
        max_len = limit
    dtype, why = compute_dtype(args.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if rank == 0:
        print(f"dtype: {str(dtype).removeprefix('torch.')} ({why})")
    engine = make_engine(
        args.rollout,
        args.model,
        max_model_len=max_len,
        dtype=str(dtype).removeprefix("torch."),
        seed=args.seed,
        distributed=distributed,
        verbose=args.verbose,
        sequences=math.ceil(len(rows) / world) * args.n,  # vLLM's KV cache on CPU: this rank's sequences
        memory_gib=free_memory_gib(torch.device("cpu"), ranks_here),  # and its free memory
    )
    metrics, _ = validate(
        engine,
        rows,
        tokenizer,
        reward_fn,
        stop_token_ids(args.model),
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        rank=rank,
        world=world,
        tools=tools,
    )
    if tools:
        tools.close()
    engine.close()  # after validate's gather: under torchrun, vLLM's shutdown takes the process group down with it
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return
    width = max(map(len, metrics))
    print("\n".join(f"{k:{width}s}  {v:.4f}" for k, v in metrics.items()))
    path = args.out or (
        os.path.join(args.model, f"eval_{os.path.splitext(os.path.basename(args.data))[0]}.json")
        if os.path.isdir(args.model)
        else "eval.json"
    )
    with open(path, "w") as f:
        json.dump(
            dict(
                model=args.model,
                data=args.data,
                n=args.n,
                temperature=args.temperature,
                prompts=len(rows),
                metrics=metrics,
            ),
            f,
            indent=2,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
