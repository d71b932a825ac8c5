"""The constraints between flags that belong to one feature, for config.check_args: where rollouts are
made (--rollout-ranks, --max-staleness, --stream-rollouts, --tensor-parallel-size), how long a
worker's call may take (--reward-timeout, --tool-timeout), and which reward functions to load
(--reward-fn, --reward-weights; eval.py takes the same two), and the teacher's (--teacher, --distill-*). They live here, below config.py, not in
rollout_ranks.py and reward_worker.py: the flags import no feature module."""

import math
import os


def placement_rules(a, world):
    """config.check_args' rules for --max-staleness, --rollout-ranks and --tensor-parallel-size, with
    `world` ranks in all."""
    tp = a.tensor_parallel_size
    return [
        (
            a.max_staleness + a.rollout_ranks == 0 or a.engine_logprobs,
            "--max-staleness and --rollout-ranks need the engine's log-probs: drop --no-engine-logprobs",
        ),
        (a.rollout_ranks < world, f"--rollout-ranks {a.rollout_ranks} leaves no trainer rank (WORLD_SIZE={world})"),
        (
            a.rollout_ranks == 0 or a.tensor_parallel_size == 1,
            "--rollout-ranks: each rollout rank runs a whole engine; use --tensor-parallel-size 1",
        ),
        (
            a.rollout_ranks == 0 or a.prompt_batch_size % a.rollout_ranks == 0,
            f"--prompt-batch-size ({a.prompt_batch_size}) must be a multiple of --rollout-ranks ({a.rollout_ranks})",
        ),
        (
            not a.stream_rollouts or a.rollout_ranks and a.max_staleness,
            "--stream-rollouts needs --rollout-ranks K >= 1 and --max-staleness S >= 1",
        ),
        (not a.stream_rollouts or a.rollout != "hf", "--stream-rollouts needs the vLLM engine: drop --rollout hf"),
        # --tensor-parallel-size T: T consecutive ranks run one vLLM engine on the same requests (rollout.collect_rollout)
        (world % max(tp, 1) == 0, f"--tensor-parallel-size {tp} must divide the number of ranks (WORLD_SIZE={world})"),
        (tp == 1 or a.rollout != "hf", "--tensor-parallel-size > 1 is vLLM's: drop --rollout hf, or use 1"),
        (
            tp == 1 or a.engine_logprobs,
            "--tensor-parallel-size > 1 needs the engine's log-probs (each step checks them against the policy's): "
            "drop --no-engine-logprobs",
        ),
        (
            tp == 1 or not a.tools,
            "--tensor-parallel-size > 1 with --tools: a group's ranks must send the same requests, and a tool's result "
            "(a timeout) may differ between them; use --tensor-parallel-size 1",
        ),
        (
            not a.stream_rollouts or not (a.tools or a.filter_groups),
            "--stream-rollouts streams single-turn groups one by one: drop --tools and --filter-groups",
        ),
    ]


def timeout_rules(args):
    """config.check_args' rules for --reward-timeout and --tool-timeout: each below --collective-timeout.
    While one rank waits on a call, the others wait for that rank in a collective: if they may give up first,
    they stop the run over a call that was still allowed to finish. Equal is refused too: their clock may
    have started before the call did. (A batch of slow calls may still outlast it: reward_worker.waits() then
    says so.)"""
    limit = args.collective_timeout
    return [
        (
            not used or timeout < limit,
            f"{flag} ({timeout:g}) must be less than --collective-timeout ({limit:g}): while one {what} call runs, "
            f"the other ranks wait for this one and give up first; lower {flag} or raise --collective-timeout",
        )
        for flag, timeout, used, what in (
            ("--reward-timeout", args.reward_timeout, args.reward_fn, "--reward-fn"),
            ("--tool-timeout", args.tool_timeout, args.tools, "--tools"),
        )
    ]


def reward_rules(args):
    """config.check_args' rules for --reward-fn and --reward-weights (eval.py takes the same two flags)."""
    specs, weights = reward_specs(args), reward_weights(args)
    return [
        *[
            (
                os.path.isfile(spec.partition(":")[0]) or module_path(spec.partition(":")[0]),
                f"--reward-fn {spec}: no such file {spec.partition(':')[0]!r}; expected path/to/file.py:function_name "
                "(or an installed module's module.path:function_name)",
            )
            for spec in specs
        ],
        (
            not args.reward_weights or len(weights or []) == len(specs) > 0,
            f"--reward-weights {args.reward_weights}: expected one number per --reward-fn ({len(specs)} given)",
        ),
    ]


def module_path(path):
    """Whether a --reward-fn spec's part before ':' names an installed module (trl.rewards), not a file: dotted
    names and no ".py". Whether it imports is checked when the reward worker loads it (reward.load_reward_fn)."""
    return not path.endswith(".py") and all(part.isidentifier() for part in path.split("."))


def reward_specs(args):
    """--reward-fn a.py:f --reward-fn b.py:g (or a.py:f,b.py:g) -> ["a.py:f", "b.py:g"]."""
    return [spec.strip() for spec in args.reward_fn.split(",") if spec.strip()]


def reward_weights(args):
    """--reward-weights 1,0.5 -> [1.0, 0.5]; None when not given or not numbers (check_args says so)."""
    try:
        weights = [float(w) for w in args.reward_weights.split(",")] if args.reward_weights else None
    except ValueError:
        return None
    return weights if weights and all(math.isfinite(w) for w in weights) else None


def distill_rules(a):
    """config.check_args' rules for on-policy distillation: pure distillation, OPSD, and --distill-loss' settings,
    each of one mode only (verl refuses k1 back-propagated: its gradient does not depend on the teacher)."""
    topk, k1 = a.distill_loss == "forward_kl_topk", a.distill_loss in ("k1", "kl")
    return [
        (a.reward or a.teacher, "--no-reward (pure distillation) needs --teacher DIR"),
        (a.reward or a.distill_coef > 0, "--no-reward with --distill-coef 0 leaves no advantage to train on"),
        (a.teacher != "self" or a.teacher_prompt_key, "--teacher self needs --teacher-prompt-key: else its term is 0"),
        (
            not (a.teacher_prompt_key and a.tools),
            "--teacher-prompt-key with --tools: the teacher's prompt would lack the tools' schemas; use one of them",
        ),
        (topk or a.distill_topk == 32, f"--distill-topk {a.distill_topk} needs --distill-loss forward_kl_topk"),
        (topk or a.distill_logp_clamp == 0, "--distill-logp-clamp needs --distill-loss forward_kl_topk"),
        (
            k1 or a.distill_clip == 0,
            f"--distill-clip is the k1 advantage's own clip; --distill-loss {a.distill_loss} is back-propagated as a "
            "loss, with no ratio to clip: drop --distill-clip, or use --distill-loss k1",
        ),
    ]


def curriculum_rules(a):
    """config.check_args' rules for --curriculum (curriculum.py): levels rise at validations, and the rows it
    replaces must not be in rollouts made ahead."""
    return [
        (not a.curriculum or a.test_freq > 0, "--curriculum raises levels at validations: give --test-freq N >= 1"),
        (
            not a.curriculum or a.max_staleness + a.rollout_ranks == 0,
            "--curriculum replaces rows at validations: not with rollouts made ahead (--max-staleness, --rollout-ranks)",
        ),
    ]
