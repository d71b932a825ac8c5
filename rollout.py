"""A step's rollout: each rank asks its engine for n responses to each of its prompts (with --tools,
multi-turn conversations: multi_turn.py), scores them, and, with --filter-groups (DAPO's dynamic
sampling), keeps generating until enough groups differ.

The engines (vllm_engine.py, hf_engine.py) share one interface, engine.py's: generate(prompts, n,
...) -> Rollout with each response token's log-prob, update_weights, sleep and wake_up.

Seeds: a prompt's seed comes from (run seed, step, its place in the global batch), and its n samples
get seeds s*n .. s*n+n-1 (engine.sample_seeds). So a prompt's samples depend neither on the other
prompts nor on the rank, and a resumed run draws what the uninterrupted one drew. The two engines draw
different samples.
"""

import dataclasses

import torch

import reward_model
from distributed import all_gather
from engine import Rollout
from memory import free_memory_gib
from reward import is_trl, overlong_penalty, response_text, row_inputs, score_responses
from run_log import timed
from trl_rewards import score_rows

# ----------------------------------------------------------------------------------------------
# One training step's samples on this rank


def collect_rollout(
    engine, train_rows, step, *, args, rank, world, tokenizer, reward, eos_ids, timing, device, tools=None
):
    """This step's samples on this rank (StepRollout): n responses to each of its prompts from the engine, seeded
    by the prompt's place in the global batch, their texts and their rewards (score_samples). With
    --filter-groups (DAPO's dynamic sampling), filtered_rollout: more batches of prompts until enough groups
    have rewards that differ."""
    scoring = dict(tokenizer=tokenizer, reward=reward, eos_ids=eos_ids, tools=tools)  # what the rewards need
    if args.filter_groups:
        return filtered_rollout(engine, train_rows, step, args=args, rank=rank, world=world, timing=timing,
                                device=device, **scoring)  # fmt: skip
    return generate_and_score(
        engine, train_rows, step, 0, args=args, rank=rank, world=world, timing=timing, device=device, **scoring
    )


def generate_and_score(
    engine, train_rows, step, batch, *, args, rank, world, tokenizer, reward, eos_ids, timing, device, tools
):
    """Generation batch `batch` of step `step` on this rank (0, then 1, 2, ... with --filter-groups): its share
    of the batch's prompts (step_prompts), n responses to each (the engine: vllm_engine.py or hf_engine.py;
    with --tools, multi-turn conversations), their texts and rewards. A StepRollout."""
    n, tp = args.group_size, args.tensor_parallel_size  # tp ranks run one engine and generate their group's prompts
    indices, first = step_prompts(train_rows, step, batch, args=args, rank=rank // tp, world=world // tp)
    rows = [train_rows[i] for i in indices]
    with timed(timing, "gen"):
        engine.wake_up()
        seeds = sampling_seeds(args.seed, step, batch * args.prompt_batch_size + first, len(rows))
        kw = dict(n=n, seeds=seeds, max_new_tokens=args.max_response_length, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, logprobs=args.engine_logprobs)  # fmt: skip
        if tools is None:
            out = engine.generate([r["prompt_ids"] for r in rows], **kw)  # vllm_engine.py, hf_engine.py
        else:  # multi-turn conversations
            out = generate(engine, rows, tools, **kw)
        engine.sleep()
    if tp > 1:  # every rank of a tensor-parallel group generated the group's prompts: keep this rank's
        indices, rows, first, out = tensor_parallel_share(indices, rows, first, out, rank=rank, args=args, world=world)
    with timed(timing, "reward"):
        samples = [r for r in rows for _ in range(n)]  # prompt-major, like the rollout
        texts = response_texts(out, tokenizer, eos_ids)
        where = f"step {step}" + (f", generation batch {batch + 1}" if batch else "")  # errors name the sample's
        scores, extras = score_samples(  # place in this generation batch, all ranks' (first * n)
            reward, samples, texts, out, first=first * n, args=args, device=device, where=where, step=step
        )
    return StepRollout(
        rows, out.response_ids, out.logprobs, out.truncated, texts, scores, extras, filter_metrics={},
        model_mask=out.model_mask, turns=out.turns, indices=indices,
    )  # fmt: skip


def step_prompts(train_rows, step, batch, *, args, rank, world):
    """This rank's prompts in generation batch `batch` (0, then 1, 2, ... with --filter-groups) of
    `step` (from 1): its share of a global batch. Batch 0 walks the epoch in an order shuffled by
    (seed, epoch), so resuming needs nothing saved; further batches draw prompts from a shuffle seeded
    by (seed, step, batch). Returns (indices into train_rows, the place of this rank's first prompt)."""
    epoch, index_in_epoch = divmod(step - 1, len(train_rows) // args.prompt_batch_size)
    seed = args.seed + epoch if batch == 0 else args.seed * 1_000_003 + step * 1_009 + batch
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed)).tolist()
    local = args.prompt_batch_size // world
    first = (index_in_epoch if batch == 0 else 0) * args.prompt_batch_size + rank * local
    return order[first : first + local], rank * local


def sampling_seeds(seed, step, first, count):
    """One seed per prompt from (run seed, step, the prompt's place in the global batch: first, first
    + 1, ...), so a prompt's seeds depend neither on how the batch is split over ranks nor on the other
    prompts, and a resumed run draws what the uninterrupted one drew. (Its samples also follow the
    engine's floats, which can move by ~1e-6 nats with what else shares the engine's batch.)"""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % 2**31 for i in range(count)]


def response_texts(out, tokenizer, eos_ids):
    """The text the reward scores of each response: its tokens without a final EOS (reward.response_text),
    or, multi-turn, the model's last turn."""
    if out.turns:
        return [t.answer() for t in out.turns]
    return [response_text(tokenizer, ids, eos_ids) for ids in out.response_ids]


def score_samples(reward, samples, texts, out, *, first, args, device, where="", step=0):
    """The rewards of one generation batch on this rank: the reward functions (which also see each
    response's token ids and whether it was cut off), plus the reward model's score (--reward-model),
    plus DAPO's overlong punishment. `reward` is (reward function, (reward model, its tokenizer) or None);
    reward errors name the sample as "{where}, sample {first + i} of the batch" (reward.score_rows); TRL-style
    functions see `step` as trainer_state.global_step (trl_rewards.score_rows). Returns (scores, extras: the logged parts, one value per sample)."""
    reward_fn, rm = reward
    seen = dict(response_ids=out.response_ids, truncated=out.truncated)  # in extra_info (reward.score_rows)
    seen["conversations"] = [t.conversation for t in out.turns] if out.turns else None
    if is_trl(reward_fn):  # TRL-style functions: one call each for the batch (trl_rewards.py)
        scores, extras = score_rows(
            reward_fn, samples, texts, first, **seen, errors=args.reward_errors, where=where, step=step
        )
    else:  # verl's: one call per sample, with verl's keyword arguments
        inputs = row_inputs(samples, texts, first, **seen)
        scores, extras = score_responses(reward_fn, **inputs, errors=args.reward_errors, where=where)
    if rm is not None:  # reward = rule + w x model, or w x model alone
        extras["rule"] = scores
        model, rm_tokenizer = rm
        extras["reward_model"] = reward_model.score(model, rm_tokenizer, samples, texts, args.micro_batch_size, device)
        w = args.reward_model_weight
        scores = [w * m + (0.0 if args.reward_model_only else s) for s, m in zip(scores, extras["reward_model"])]
    if args.overlong_buffer_len > 0:  # DAPO: long responses lose up to the factor, linearly
        lengths = [len(ids) for ids in out.response_ids]
        extras["overlong_penalty"] = overlong_penalty(
            lengths, args.max_response_length, args.overlong_buffer_len, args.overlong_penalty_factor
        )
        scores = [s + p for s, p in zip(scores, extras["overlong_penalty"])]
    return scores, extras


@dataclasses.dataclass
class StepRollout:
    """One step's samples on this rank, prompt-major: each prompt's n samples are consecutive."""

    rows: list  # [B] this rank's prompts (verl's rows, with "prompt_ids")
    response_ids: list  # [B*n] token ids of each response
    logprobs: list  # [B*n] the engine's per-token log-probs ([] with --no-engine-logprobs)
    truncated: list  # [B*n] whether each response was cut off at --max-response-length
    texts: list  # [B*n] the decoded responses, as the reward saw them
    scores: list  # [B*n] rewards
    extras: dict  # name -> [B*n]: the reward's logged parts
    filter_metrics: dict  # filter/* with --filter-groups, else {}
    model_mask: list = dataclasses.field(default_factory=list)  # [B*n] multi-turn: 1 on the model's tokens
    turns: list = dataclasses.field(default_factory=list)  # [B*n] multi-turn: multi_turn.Turns
    indices: list = dataclasses.field(default_factory=list)  # [B] each prompt's row in the training data
    versions: list = dataclasses.field(default_factory=list)  # [B*n] the policy version that generated each
    # --rollout-ranks (rollout_ranks.py): the rollout ranks' metrics of making it (timing_s/*: the slowest's; with
    # --stream-rollouts rollout/interrupted); the probe gap of their last weight check
    remote_metrics: dict = dataclasses.field(default_factory=dict)
    weight_sync_gap: float | None = None


# ----------------------------------------------------------------------------------------------
# --filter-groups, tensor-parallel groups, multi-turn, streamed groups (a reader can skip these)


def filtered_rollout(engine, train_rows, step, *, args, rank, world, timing, device, **scoring):
    """--filter-groups (DAPO's dynamic sampling): groups whose rewards are all equal are dropped and further
    generation batches (generate_and_score) are made until prompt_batch_size informative groups are held, or
    --max-gen-batches ran out: then the step trains on what it has, its informative groups repeated to fill
    the batch (each counts more; filter/* says so). The groups are dealt out to the ranks in their global
    order, so 1 and 2 ranks that drew the same samples train on the same groups. A StepRollout."""
    n, local, pool = args.group_size, args.prompt_batch_size // world, {}
    for batch in range(args.max_gen_batches):
        ro = generate_and_score(
            engine, train_rows, step, batch, args=args, rank=rank, world=world, timing=timing, device=device, **scoring
        )
        # every rank's samples, as columns in global order, added to those of earlier batches
        texts = ro.texts
        mine = dict(row=[i for i in ro.indices for _ in range(n)], ids=ro.response_ids, text=texts, score=ro.scores)
        mine.update(truncated=ro.truncated, logp=ro.logprobs or [[]] * len(texts))
        mine.update(model_mask=ro.model_mask or [[]] * len(texts), turns=ro.turns or [None] * len(texts))
        mine["extra"] = [{k: v[i] for k, v in ro.extras.items()} for i in range(len(texts))]  # keys may differ by rank
        pool = {k: pool.get(k, []) + sum((part[k] for part in all_gather(mine)), []) for k in mine}
        groups = [pool["score"][g : g + n] for g in range(0, len(pool["score"]), n)]
        informative = [g for g, group in enumerate(groups) if len(set(group)) > 1]
        if len(informative) >= args.prompt_batch_size:
            break
    uninformative = sorted(set(range(len(groups))) - set(informative))
    have = informative or uninformative  # nothing informative at all: a step with nothing to learn
    chosen = [have[i % len(have)] for i in range(args.prompt_batch_size)][rank * local : (rank + 1) * local]
    mine = {k: [v[g * n + j] for g in chosen for j in range(n)] for k, v in pool.items()}  # this rank's share
    extras = {k: [e.get(k) for e in mine["extra"]] for k in sorted({k for e in mine["extra"] for k in e})}
    metrics = {"filter/kept_groups": min(len(informative), args.prompt_batch_size)}
    metrics.update({"filter/dropped_groups": len(uninformative), "filter/gen_batches": batch + 1})
    rows, logprobs = [train_rows[i] for i in mine["row"][::n]], mine["logp"] if args.engine_logprobs else []
    multi = scoring["tools"] is not None  # the multi-turn columns
    return StepRollout(
        rows,
        mine["ids"],
        logprobs,
        mine["truncated"],
        mine["text"],
        mine["score"],
        extras,
        metrics,
        mine["model_mask"] if multi else [],
        mine["turns"] if multi else [],
        mine["row"][::n],
    )


def tensor_parallel_share(indices, rows, first, out, *, rank, args, world):
    """This rank's part of its tensor-parallel group's generation: (indices, rows, place of the first prompt,
    Rollout). With --tensor-parallel-size T, the T consecutive ranks of a group run one vLLM engine SPMD
    (external_launcher): each layer sums the ranks' partial results, so they must submit the same requests, or
    the engine mixes their sequences (1.3 nats off the policy's log-probs, measured) or its collectives fail.
    So a group generates its share of the global batch on every one of its ranks, and each rank keeps its part:
    the prompts, seeds and split over ranks of T = 1."""
    local = args.prompt_batch_size // world
    kept = slice(rank % args.tensor_parallel_size * local, (rank % args.tensor_parallel_size + 1) * local)
    return indices[kept], rows[kept], first + kept.start, rollout_part(out, kept, args.group_size)


def rollout_part(out, prompts, n):
    """The samples of `prompts` (a slice of the generated prompts, n samples each) of a Rollout."""
    cut = slice(prompts.start * n, prompts.stop * n)
    return Rollout(*(getattr(out, f.name)[cut] for f in dataclasses.fields(Rollout)))


def generate(engine, rows, tools, *, n, seeds, max_new_tokens, **sampling):
    """n responses to each row's prompt (a Rollout): one turn each, or with `tools` (a
    multi_turn.ToolSetup) the multi-turn conversations of multi_turn.generate_turns."""
    if tools is not None:
        from multi_turn import generate_turns

        return generate_turns(engine, rows, tools, n=n, seeds=seeds, max_new_tokens=max_new_tokens, **sampling)
    prompts = [r["prompt_ids"] for r in rows]
    return engine.generate(prompts, n=n, seeds=seeds, max_new_tokens=max_new_tokens, **sampling)


def score_group(train_rows, index, out, *, step, place, args, tokenizer, reward, eos_ids, device):
    """One prompt's group (--stream-rollouts): the StepRollout of row `index`'s n samples `out` (a Rollout),
    scored as collect_rollout scores them; place: the prompt's in the step's global batch."""
    row, texts, n = train_rows[index], response_texts(out, tokenizer, eos_ids), args.group_size
    where = f"step {step}"
    scores, extras = score_samples(
        reward, [row] * n, texts, out, first=place * n, args=args, device=device, where=where, step=step
    )
    return StepRollout([row], out.response_ids, out.logprobs, out.truncated, texts, scores, extras, {}, indices=[index])


# ----------------------------------------------------------------------------------------------
# The engine


def make_engine(kind, model_path, *, verbose=False, **kwargs):
    """The rollout engine `kind`: "vllm", "hf", or "auto" (vLLM when it can be imported). verbose=True
    shows vLLM's INFO logs (its configuration at start-up, each weight sync); otherwise only its warnings."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except ImportError:
            kind = "hf"
    if kind == "vllm":
        from vllm_engine import VLLMEngine

        return VLLMEngine(model_path, verbose=verbose, **kwargs)
    if kind == "hf":
        from hf_engine import HFEngine

        return HFEngine(model_path, verbose=verbose, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'auto', 'vllm' or 'hf'")


def start_engine(args, world, ranks_here, device, dtype, trains=True):
    """The rollout engine for --rollout, computing in `dtype` (the policy's: --dtype). With
    --tensor-parallel-size T, each T consecutive ranks run one engine together and generate their
    group's prompts (collect_rollout). trains: this rank also trains (not a rollout rank)."""
    groups = world // args.tensor_parallel_size
    # one rank that trains: the transformers engine generates with the policy's own weights (HFEngine.share), but
    # not with LoRA (it takes the merged weights) or --offload params (it would copy each layer in per token)
    shares_policy = args.engine_shares_policy and trains and world == 1 and not args.lora_rank
    return make_engine(
        args.rollout,
        args.model,
        max_model_len=args.max_prompt_length + args.max_response_length,
        dtype=str(dtype).removeprefix("torch."),
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed=True,
        device=device,
        verbose=args.verbose,
        max_batch_size=args.prompt_batch_size // groups * args.group_size,  # HFEngine: a step's rollout in one batch
        shares_policy=shares_policy and args.offload not in ("params", "both"),  # HFEngine
        cuda_graphs=args.cuda_graphs,  # HFEngine
        sequences=args.prompt_batch_size // groups * args.group_size,  # vLLM's KV cache on CPU: the same rollout
        memory_gib=free_memory_gib(device, ranks_here),
    )


VALIDATION_STEP = -1  # validation's seeds: the same at every validation, apart from training's
