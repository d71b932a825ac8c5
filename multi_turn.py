"""Multi-turn rollouts with tools (--tools): the model calls a function, reads its result, goes on.

Each sample's response interleaves the model's turns with what the chat template and the tools add
between them, all in one token budget (--max-response-length):

    prompt | model: ...<tool_call>{...}</tool_call> | <|im_end|> user <tool_response>20126</tool_response>
           | assistant: | model: The answer is 20126.<|im_end|>

A turn ends at EOS or at the end of a tool call (tools.tool_call_stops). Its calls run in the tool
worker (tools.run_calls: an error of any kind is a message for the model, never the end of the run),
and their results are appended as the chat template's token delta (tools.delta_ids): the model's
tokens are never re-tokenized. model_mask marks the model's own tokens: only they get loss, KL,
entropy and advantage, and only they have engine log-probs (0 elsewhere). All samples of a step
advance turn by turn in batched engine calls; turn 1 draws as a single-turn rollout does, each later
turn from a seed of (the sample's seed, turn), so 1 and 2 ranks, and a resumed run, draw the same.
"""

import dataclasses

import tools
from engine import Rollout, sample_seeds
from reward import response_text


@dataclasses.dataclass
class ToolSetup:
    """What the loop needs besides the engine: the tools' worker and schemas, and its limits."""

    worker: object  # tools.ToolWorker: runs the calls
    schemas: list  # one JSON schema per tool, as chat templates take `tools`
    tokenizer: object
    eos_ids: set  # what ends the model's turn (engine.stop_token_ids)
    max_turns: int  # model turns per sample (--max-turns)
    timeout: float  # seconds per call (--tool-timeout)
    max_chars: int  # characters of a result the model reads (--max-tool-response-length)
    stops: tuple = ((), ())  # (token ids, strings) that end a turn after a tool call

    def close(self):
        self.worker.close()


def start_tools(spec, tokenizer, eos_ids, *, max_turns, timeout, max_chars):
    """The ToolSetup of --tools `spec`: its tools loaded in a worker process of their own."""
    worker, schemas = tools.start_tools(spec, timeout)
    stops = tools.tool_call_stops(tokenizer)
    return ToolSetup(worker, schemas, tokenizer, set(eos_ids), max_turns, timeout, max_chars, stops)


def row_tools(row, setup):
    """(tools_kwargs, schemas) of a row: verl's extra_info.tools_kwargs, and the schemas without the
    arguments the row passes itself (tools.row_schemas)."""
    kwargs = (row.get("extra_info") or {}).get("tools_kwargs") or {}
    return kwargs, tools.row_schemas(setup.schemas, kwargs)


@dataclasses.dataclass
class Turns:
    """One sample's conversation after its prompt: the model's turns ({"role": "assistant"}, its text
    without a final EOS) and the tools' results ({"role": "tool"}), and each call's status."""

    conversation: list = dataclasses.field(default_factory=list)
    statuses: list = dataclasses.field(default_factory=list)  # tools.STATUSES, one per call

    @property
    def num_turns(self):
        return sum(m["role"] == "assistant" for m in self.conversation)

    def answer(self):
        """The model's last turn: what the reward scores (a tool's result is never taken for its answer)."""
        return next(m["content"] for m in reversed(self.conversation) if m["role"] == "assistant")

    def shown(self):
        """The conversation for the sample tables: the model's text as written, each result marked."""
        parts = [m["content"] if m["role"] == "assistant" else f"\n[tool] {m['content']}\n" for m in self.conversation]
        return "".join(parts)


def turn_seed(seed, turn):
    """The seed of a sample's turn (from 2; turn 1 uses the sample's own seed, as a single-turn rollout)."""
    return (seed * 1_000_003 + turn * 7_919) % 2**31


def generate_turns(engine, rows, setup, *, n, seeds, max_new_tokens, **sampling):
    """n multi-turn responses to each row's prompt (row["prompt_ids"], rendered with the tools): a
    Rollout, prompt-major, whose response_ids hold every token after the prompt, logprobs the engine's
    for the model's tokens (0.0 for the others), model_mask 1 on the model's tokens, and turns one
    Turns per sample. A sample ends when its turn has no tool call, at its --max-turns'th turn (its
    calls are not run), or when its tokens, or the next results', would not fit max_new_tokens
    (truncated). sampling: the engine's temperature, top_p, top_k, logprobs."""
    samples = [r for r in rows for _ in range(n)]
    empty = lambda: [[] for _ in samples]  # noqa: E731
    out = Rollout(empty(), empty(), [False] * len(samples), model_mask=empty(), turns=[Turns() for _ in samples])
    stop = dict(stop_token_ids=list(setup.stops[0]), stop=list(setup.stops[1]))
    prompts = [r["prompt_ids"] for r in rows]
    turn = engine.generate(prompts, n=n, seeds=seeds, max_new_tokens=max_new_tokens, **stop, **sampling)
    active, seeds = list(range(len(samples))), sample_seeds(seeds, len(rows), n)
    for t in range(1, setup.max_turns + 1):
        if t > 1:
            prefixes = [samples[i]["prompt_ids"] + out.response_ids[i] for i in active]
            budgets = [max_new_tokens - len(out.response_ids[i]) for i in active]
            turn_seeds = [turn_seed(seeds[i], t) for i in active]
            turn = engine.generate(prefixes, n=1, seeds=turn_seeds, max_new_tokens=budgets, **stop, **sampling)
        going = []
        for k, i in enumerate(active):
            ids = turn.response_ids[k]
            append(out, i, ids, turn.logprobs[k] if turn.logprobs else [], 1)
            out.turns[i].conversation.append(
                {"role": "assistant", "content": response_text(setup.tokenizer, ids, setup.eos_ids)}
            )
            if turn.truncated[k]:
                out.truncated[i] = True
            elif t < setup.max_turns and run_turn(out, i, samples[i], ids, setup, max_new_tokens):
                going.append(i)
        active = going
        if not active:
            break
    if not sampling.get("logprobs", True):
        out.logprobs = []
    return out


def append(out, i, ids, logprobs, mine):
    """Append tokens to sample i: the model's (mine = 1, with their log-probs) or the template's (0)."""
    out.response_ids[i] += ids
    out.logprobs[i] += logprobs or [0.0] * len(ids)
    out.model_mask[i] += [mine] * len(ids)


def run_turn(out, i, row, ids, setup, max_new_tokens):
    """Run the calls of sample i's last turn (ids) and append their results; False when the sample ends
    here: its turn called no tool, or the results would leave no room for another token (truncated)."""
    turns = out.turns[i]
    calls = tools.parse_calls(turns.conversation[-1]["content"])
    if not calls:
        return False
    tools_kwargs, schemas = row_tools(row, setup)
    results, statuses = tools.run_calls(calls, setup.worker, tools_kwargs, setup.timeout, setup.max_chars)
    turns.statuses += statuses
    messages = list(row["prompt"]) + turns.conversation
    ended = bool(ids) and ids[-1] in setup.eos_ids  # at EOS, or right after </tool_call>
    delta = tools.delta_ids(setup.tokenizer, messages, results, schemas, ended)
    turns.conversation += results
    if len(out.response_ids[i]) + len(delta) >= max_new_tokens:
        out.truncated[i] = True
        return False
    append(out, i, delta, [], 0)
    return True


# ----------------------------------------------------------------------------------------------
# Metrics, verl's names where it has them


def turn_metrics(counts):
    """num_turns/{mean,max,min} and tool/*, from (num_turns, statuses) of every sample (all ranks'):
    tool/calls_per_sample, tool/use_rate (the share of samples that called a tool), tool/errors (calls
    that did not return a result whole: every status but ok), tool/timeouts, and a count of each
    failure status (tool/malformed, tool/unknown_tool, ...)."""
    turns = [k for k, _ in counts]
    statuses = [s for _, ss in counts for s in ss]
    metrics = {"num_turns/mean": sum(turns) / len(turns), "num_turns/max": max(turns), "num_turns/min": min(turns)}
    metrics["tool/calls_per_sample"] = len(statuses) / len(counts)
    metrics["tool/use_rate"] = sum(bool(ss) for _, ss in counts) / len(counts)
    metrics["tool/errors"] = sum(s != "ok" for s in statuses)
    metrics["tool/timeouts"] = statuses.count("timeout")
    metrics.update({f"tool/{s}": statuses.count(s) for s in tools.STATUSES if s not in ("ok", "timeout")})
    return metrics


def turn_counts(turns):
    """What turn_metrics needs of this rank's samples, small enough to gather: (num_turns, statuses)."""
    return [(t.num_turns, list(t.statuses)) for t in turns]
