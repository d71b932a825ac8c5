"""Tools for multi-turn rollouts: the model calls a function, reads its result, and goes on.

A tool is a plain Python function with type hints and a Google-style docstring, as TRL takes them:
`--tools FILE.py` (every public function defined there) or `--tools FILE.py:fn1,fn2`. Its JSON schema
is transformers' get_json_schema. Tools run in a worker process (reward_worker.py), so a tool that
raises, exits, crashes or hangs gives the model an error message, never the end of the run; the
model's arguments are JSON, never eval'ed.

Calls and results use the Hermes format of Qwen2.5's chat template: <tool_call>{"name": ...,
"arguments": {...}}</tool_call> in the model's turn, each result in <tool_response></tool_response>.
A template that ignores `tools` (SmolLM2's) gets the same instructions in a system message
(tool_prompt). For the multi-turn loop, delta_ids gives the tokens the template adds after the
model's turn, so the tokens the model wrote are never re-tokenized: the trainer trains on them and
masks out the rest.
"""

import functools
import importlib.util
import inspect
import json
import os
import sys
from typing import NamedTuple

from reward_worker import TIMED_OUT, Worker
from user_errors import describe, safe_repr

# What happened to each call (run_calls): the model reads each failure as an "error: ..." message
STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "truncated")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_FORMAT = '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'

# ----------------------------------------------------------------------------------------------
# Loading: in the tool worker, since a tools file is the user's code


def load_tools(spec):
    """{name: function} for 'path/to/file.py' (each public function defined in that file: its name does
    not start with "_", and it was not imported from elsewhere) or 'path/to/file.py:fn1,fn2'. Runs the
    file's code: the trainer calls it only in the tool worker (start_tools)."""
    path, _, names = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--tools {spec!r}: tools file {path!r} does not exist; expected path/to/file.py or path/to/file.py:fn1,fn2"
        )
    module_name = f"user_tools_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # where dataclasses and typing look a function's module up
    module_spec.loader.exec_module(module)
    public = {
        k: v
        for k, v in vars(module).items()
        if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module_name
    }
    if not names:
        if not public:
            raise ValueError(f"tools file {path!r} defines no public functions (names that do not start with '_')")
        return public
    tools = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if not callable(getattr(module, name, None)):
            raise AttributeError(
                f"tools file {path!r} has no function {name!r}; its public functions: {sorted(public)}"
            )
        tools[name] = getattr(module, name)
    return tools


def tool_schema(path, name, fn):
    """The JSON schema of tool `name` (transformers' get_json_schema), as chat templates take `tools`."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # no docstring, an argument without a type hint or without its docstring line
        raise ValueError(
            f"tools file {path!r}, function {name!r}: {e}. A tool needs a type hint on every argument and a "
            "Google-style docstring: a description, then 'Args:' with a line for each argument"
        ) from None
    schema["function"]["name"] = name  # the name the model calls it by, even for `alias = fn`
    return schema


def load_in_worker(setup):
    """The tool worker's loader (reward_worker.Worker): the tools of setup = (spec, with_schemas), and
    (answer, their schemas, or None without with_schemas)."""
    spec, with_schemas = setup
    tools = load_tools(spec)
    schemas = [tool_schema(spec.partition(":")[0], name, fn) for name, fn in tools.items()] if with_schemas else None
    return functools.partial(call_tool, tools), schemas


def call_tool(tools, request):
    """The worker's answer to one request (name, arguments, extra, max_chars): ((status, text), None).
    `extra` (the row's tools_kwargs) wins over the model's arguments of the same name."""
    name, arguments, extra, max_chars = request
    if name not in tools:
        return ("unknown_tool", f"error: unknown tool {name!r}; available: {', '.join(tools)}"), None
    kwargs = {**arguments, **extra}
    signature = inspect.signature(tools[name])
    try:
        signature.bind(**kwargs)
    except TypeError as e:  # a missing argument, or one the tool does not take
        shown = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in extra])
        return ("bad_arguments", f"error: bad arguments for {name}: {e}; expected {name}{shown}"), None
    try:
        result = tools[name](**kwargs)
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    except (Exception, SystemExit) as e:
        return ("raised", f"error: {name} {describe(e)}"), None
    if len(text) > max_chars:
        cut = f"{text[:max_chars]}\n[output cut: {len(text)} characters, the first {max_chars} shown]"
        return ("truncated", cut), None
    return ("ok", text), None


class ToolWorker(Worker):
    """The tools' worker process (reward_worker.Worker), so named in its messages."""

    what, timeout_flag = "tool worker", "--tool-timeout"

    def waiting_on(self, request):  # "tool calculator (calculator.py)": what a rank stopped mid-call names
        return f"tool {request[0]} ({os.path.basename(self.setup[0].partition(':')[0])})"


def start_tools(spec, timeout=30.0):
    """The tools of --tools `spec`, loaded in a worker process of their own: (worker, schemas), one JSON
    schema per tool, for render_prompt. A file that cannot be loaded, or a function without type hints
    or docstring, raises RuntimeError naming the file and function. `timeout` is each call's default."""
    worker = ToolWorker("tools:load_in_worker", (spec, True), timeout, f"--tools {spec}: could not load the tools")
    worker.setup = (spec, False)  # a restart (after a tool hung or crashed) reloads the tools, not transformers
    return worker, worker.info


# ----------------------------------------------------------------------------------------------
# Parsing the model's calls, and running them


class Call(NamedTuple):
    """A tool call the model wrote: its name and arguments, or (both None) the problem with it."""

    name: str | None
    arguments: dict | None
    problem: str | None = None


def parse_calls(text):
    """Every call in the <tool_call>...</tool_call> blocks of `text`, in order, as a Call. A call without
    its closing tag, with invalid JSON, or with JSON that is not {"name": str, "arguments": dict} (or a
    list of them) is a Call with a problem the model can read; this never raises. "arguments" may be left
    out for a tool without any."""
    calls, start = [], text.find(OPEN)
    while start != -1:
        end, following = text.find(CLOSE, start), text.find(OPEN, start + len(OPEN))
        if end == -1 or -1 < following < end:
            calls.append(Call(None, None, f"a {OPEN} without its {CLOSE}; write {CALL_FORMAT}"))
        else:
            calls += read_calls(text[start + len(OPEN) : end])
            following = text.find(OPEN, end)
        start = following
    return calls


def read_calls(body):
    """The Calls in the text between <tool_call> and </tool_call>: one JSON object, or a list of them
    (SmolLM2's format, from its function-calling training; [] is no call)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: [[[[...]]]] nested past json's limit
        return [Call(None, None, f"the tool call is not valid JSON ({e}): {safe_repr(body.strip(), 200)}")]
    calls = []
    for call in value if isinstance(value, list) else [value]:
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict):
            calls.append(Call(call["name"], call.get("arguments", {})))
        else:
            calls.append(Call(None, None, f"the tool call {safe_repr(call, 200)} is not of the form {CALL_FORMAT}"))
    return calls


VERL_LIFECYCLE = {"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"}


def row_kwargs(tools_kwargs, name):
    """The keyword arguments a row passes to tool `name` itself: tools_kwargs[name] (verl's
    extra_info.tools_kwargs), e.g. {"ground_truth": "72"}. verl's own nested form for its tool classes,
    {"create_kwargs": {...}, "execute_kwargs": {...}}, gives both of those, merged."""
    kwargs = (tools_kwargs or {}).get(name) or {}
    if kwargs and set(kwargs) <= VERL_LIFECYCLE:
        return {**(kwargs.get("create_kwargs") or {}), **(kwargs.get("execute_kwargs") or {})}
    return dict(kwargs)


def kwargs_problems(extra_info, schemas):
    """What is wrong with a row's extra_info.tools_kwargs for the loaded tools (their `schemas`; [] when
    --tools is not set), as data_prep's row checks give it: (field, message) pairs, empty if it is usable.
    It must be {tool: {argument: value}}, or verl's nested form, as row_kwargs reads them, naming loaded
    tools and their arguments: else an unknown tool's argument would stay in the schema the model sees
    and never be passed, and an argument the tool does not take would fail every call as bad_arguments."""
    if not isinstance(extra_info, dict):
        wrong = extra_info is not None and schemas  # no tools: nothing reads it (load_prompts would)
        return [("extra_info", f"expected a dict, got {extra_info!r:.80}")] if wrong else []
    field, tools_kwargs = "extra_info.tools_kwargs", extra_info.get("tools_kwargs")
    if tools_kwargs and not isinstance(tools_kwargs, dict):
        return [(field, f"expected a dict of tool name -> {{argument: value}}, got {tools_kwargs!r:.80}")]
    # None or {} passes nothing (parquet gives None for a tool that only other rows of the file name)
    named = {name: kwargs for name, kwargs in (tools_kwargs or {}).items() if kwargs}
    if named and not schemas:
        told = f"passes arguments to the tools {sorted(named)}, but --tools is not set, so no tool would get them"
        return [(field, f"{told}; pass --tools with those tools, or leave tools_kwargs out of the data")]
    params = {
        s["function"]["name"]: list((s["function"].get("parameters") or {}).get("properties", {})) for s in schemas
    }
    problems = []
    for name, kwargs in named.items():
        if name not in params:
            problems.append((f"{field}.{name}", f"no tool {name!r} is loaded; --tools gives {sorted(params)}"))
            continue
        parts = {f"{field}.{name}": kwargs}
        if isinstance(kwargs, dict) and set(kwargs) <= VERL_LIFECYCLE:  # verl's nested form, as row_kwargs reads it
            parts = {f"{field}.{name}.{k}": v for k, v in kwargs.items() if v}
            for k in [k for k in parts if not k.endswith(("create_kwargs", "execute_kwargs"))]:
                del parts[k]  # calc_reward_kwargs, release_kwargs
                told = "verl's tool classes take it for their calc_reward or release; a tool here is a function"
                problems.append((k, f"{told}, given only create_kwargs and execute_kwargs: nothing would use it"))
        for at, part in parts.items():
            if not isinstance(part, dict):
                problems.append((at, f"expected a dict of argument -> value, got {part!r:.80}"))
                continue
            problems += [
                (f"{at}.{arg}", f"{name} takes no argument {arg!r}; its arguments: {params[name]}")
                for arg in part
                if arg not in params[name]
            ]
    return problems


def row_schemas(schemas, tools_kwargs):
    """`schemas` without the parameters the row passes itself (row_kwargs): the model need not see, nor
    guess, what the tool is given anyway (the ground truth, say)."""
    out = []
    for schema in schemas:
        hidden = set(row_kwargs(tools_kwargs, schema["function"]["name"]))
        params = dict(schema["function"].get("parameters") or {})
        params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k not in hidden}
        params["required"] = [k for k in params.get("required", []) if k not in hidden]
        out.append({**schema, "function": {**schema["function"], "parameters": params}})
    return out


def run_calls(calls, worker, tools_kwargs=None, timeout=10.0, max_chars=4000):
    """Run `calls` (parse_calls') in the tool worker: (messages, statuses), one tool message
    {"role": "tool", "content": text} and one status of STATUSES per call, in order. Never raises for
    what a call does: a malformed call, an unknown tool, arguments that do not fit the function's
    signature (checked before calling), a tool that raises, calls sys.exit, crashes its worker or runs
    past `timeout` seconds, each gives an "error: ..." message the model reads (e.g. "error: unknown
    tool 'foo'; available: calculator"); the worker is replaced when needed and serves the next call.
    A result longer than `max_chars` characters is cut, with a note; an error message, to max_chars.
    tools_kwargs: the row's
    (row_kwargs), passed to the tools besides the model's arguments, which cannot override them."""
    valid = [c for c in calls if c.problem is None]
    requests = [(c.name, c.arguments, row_kwargs(tools_kwargs, c.name), max_chars) for c in valid]
    replies = iter(zip(worker.call(requests, timeout=timeout), worker.dropped))
    messages, statuses = [], []
    for call in calls:
        if call.problem is not None:
            status, text = "malformed", f"error: {call.problem}"
        else:
            (value, problem), dropped = next(replies)
            if problem is None:
                status, text = value
                status = "truncated" if dropped and status == "ok" else status  # it printed past OUTPUT_CAP
            elif problem.startswith(TIMED_OUT):
                status, text = "timeout", f"error: {call.name} did not return within {timeout:g} s and was stopped"
            else:  # it crashed or ended its worker process
                status, text = "raised", f"error: {call.name} {problem}"
        messages.append({"role": "tool", "content": text if status in ("ok", "truncated") else text[:max_chars]})
        statuses.append(status)
    return messages, statuses


# ----------------------------------------------------------------------------------------------
# Prompts and token deltas through the chat template


def tool_prompt(schemas):
    """The fallback's system message, for a chat template that ignores `tools`: Qwen2.5's own
    instructions (each schema as a JSON line in <tools></tools>, and the <tool_call> format), so that
    every model is asked for calls in the one format parse_calls reads."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>\n\nEach result comes back to you within <tool_response></tool_response> XML tags."
    )


def template_has_tools(tokenizer, schemas):
    """Whether the chat template renders `tools` itself: a conversation renders differently with them."""
    probe = [{"role": "user", "content": "?"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False)
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False)


def with_tool_prompt(messages, schemas):
    """The fallback's conversation: tool_prompt as the system message (after the conversation's own, if
    it has one), and each run of tool messages as one user message of <tool_response> blocks, as
    Qwen2.5's template renders them (some templates refuse a "tool" role)."""
    if messages and messages[0]["role"] == "system":
        messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{tool_prompt(schemas)}"}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": tool_prompt(schemas)}, *messages]
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            out.append(m)
            continue
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if messages[i - 1]["role"] == "tool":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
        else:
            out.append({"role": "user", "content": block})
    return out


def chat_text(tokenizer, messages, schemas, generation, native):
    """The chat template's text for `messages` with the tools of `schemas`: rendered by the template
    itself when `native` (template_has_tools), else by the fallback (with_tool_prompt)."""
    if schemas and not native:
        messages, schemas = with_tool_prompt(messages, schemas), None
    return tokenizer.apply_chat_template(
        messages, tools=schemas or None, add_generation_prompt=generation, tokenize=False
    )


def render_prompt(tokenizer, messages, schemas):
    """The prompt's token ids: `messages` and the tools, through the chat template, with the assistant's
    turn opened (add_generation_prompt)."""
    native = bool(schemas) and template_has_tools(tokenizer, schemas)
    return tokenizer.encode(chat_text(tokenizer, messages, schemas, True, native), add_special_tokens=False)


SENTINEL = "\x00the assistant's turn\x00"


def delta_ids(tokenizer, messages, new_messages, schemas, ended=True):
    """The token ids to append after the model's turn: what the chat template adds when `new_messages`
    (run_calls' tool messages) follow `messages` and the next assistant turn opens. messages[-1] is the
    model's turn, {"role": "assistant", "content": its tokens decoded, without a final end-of-turn token}.
    ended: the model's tokens end with an end-of-turn token (it stopped at an EOS). False when it stopped
    right after </tool_call> (tool_call_stops): the delta then starts with the template's end-of-turn
    token (Qwen2.5's <|im_end|>), which the model did not write.

    The delta is the text a rendering with new_messages adds to one without, tokenized alone: the model's
    own tokens are never re-tokenized (that can give other tokens than the ones it sampled, whose
    log-probs the trainer would then compute). A template that renders the conversation so far
    differently once more messages follow (one that drops past reasoning, say) raises ValueError."""
    native = bool(schemas) and template_has_tools(tokenizer, schemas)
    before = chat_text(tokenizer, messages, schemas, False, native)
    after = chat_text(tokenizer, messages + new_messages, schemas, True, native)
    probe = chat_text(tokenizer, messages[:-1] + [{"role": "assistant", "content": SENTINEL}], schemas, False, native)
    end = probe[probe.find(SENTINEL) + len(SENTINEL) :]  # what ends an assistant's turn: "<|im_end|>\n"
    last = messages[-1]
    if last["role"] != "assistant" or SENTINEL not in probe or not before.endswith(last["content"] + end):
        raise ValueError(
            "delta_ids: messages[-1] must be the model's turn, and the chat template must render its content "
            f"as it is, followed by the end of a turn; the conversation ends with {safe_repr(before[-200:], 240)}"
        )
    if not after.startswith(before):
        raise ValueError(
            "delta_ids: the chat template renders the conversation so far differently once more messages follow, "
            "so its tokens cannot be extended without re-tokenizing them"
        )
    if ended:  # the model wrote the end-of-turn token itself: the delta starts after it
        token = end_of_turn_token(tokenizer, end)
        end = end[end.index(token) + len(token) :]
    return tokenizer.encode(end + after[len(before) :], add_special_tokens=False)


def end_of_turn_token(tokenizer, end):
    """The token that the template's end of an assistant turn (`end`, "<|im_end|>\\n") starts with."""
    first = tokenizer.encode(end, add_special_tokens=False)[:1]
    token = tokenizer.convert_ids_to_tokens(first[0]) if first else None
    if not token or token not in end:
        raise ValueError(f"the chat template ends an assistant's turn with {end!r}, not with an end-of-turn token")
    return token


def tool_call_stops(tokenizer):
    """What the engines stop at, besides the EOS ids, to end the model's turn right after its first tool
    call (one call per turn; without them a turn may hold several calls and ends at EOS): (token ids,
    strings). ([id], []) when "</tool_call>" is one token of the vocabulary (Qwen2.5's), so that engines
    stop exactly there; else ([], ["</tool_call>"]), a stop string (vLLM: SamplingParams(stop=...)), whose
    last token may run past it. Such a turn ends without its end-of-turn token: delta_ids(ended=False)."""
    ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == CLOSE:
        return ids, []
    return [], [CLOSE]
