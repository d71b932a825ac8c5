"""Tools for multi-turn rollouts (tools.py): loading a tools file and its schemas, the prompt through the
chat template (the template's own tool rendering, or the system-prompt fallback), parsing the model's
calls, running them in the tool worker (nothing a tool does raises here or ends the worker's service),
and the token delta the multi-turn loop appends after the model's turn. The calculator example too.

Nothing here loads model weights; the real Qwen2.5 tokenizer comes from ../shared (skipped without it)."""

import json
import time

import pytest
from conftest import QWEN_DIR, REPO, need

import tools
from models import build_tokenizer

CALCULATOR = f"{REPO}/examples/tools/calculator.py"

# A tools file whose `misbehave` does what a tool must not be able to do to the run.
TOOLS = '''
import ctypes, os, sys, time
from os.path import join  # imported, not defined here: not a tool

calls = 0  # module-level state lives as long as the worker


def echo(text: str, times: int = 1) -> str:
    """Repeat a text.

    Args:
        text: The text to repeat.
        times: How many times.
    """
    global calls
    calls += 1
    return text * times


def misbehave(how: str) -> str:
    """Do what a tool must not be able to do to the run.

    Args:
        how: One of raise, exit, os._exit, hang, segfault, print.
    """
    if how == "raise":
        raise KeyError("missing")
    if how == "exit":
        sys.exit(3)
    if how == "os._exit":
        os._exit(0)
    if how == "hang":
        time.sleep(1000)
    if how == "segfault":
        ctypes.string_at(0)
    print("a tool that prints")  # into the worker's stderr, not its replies
    return "printed"


def lookup(key: str, table: dict) -> dict:
    """Look a key up in the row's table.

    Args:
        key: The key to look up.
        table: The row's own table, from its tools_kwargs.
    """
    return {"key": key, "value": table.get(key), "calls": calls}


def _helper():
    return 0
'''


def call(name, **arguments):
    return tools.Call(name, arguments)


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS)
    return str(path)


@pytest.fixture(scope="module")
def worker(tools_file):
    worker, schemas = tools.start_tools(tools_file, timeout=5)
    assert [s["function"]["name"] for s in schemas] == ["echo", "misbehave", "lookup"]
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    need(QWEN_DIR)
    return AutoTokenizer.from_pretrained(QWEN_DIR)


@pytest.fixture(scope="module")
def calculator_schemas():
    return [tools.tool_schema(CALCULATOR, "calculator", tools.load_tools(CALCULATOR)["calculator"])]


# ----------------------------------------------------------------------------------------------
# loading


def test_a_file_gives_its_public_functions_or_the_ones_named(tools_file):
    assert list(tools.load_tools(tools_file)) == ["echo", "misbehave", "lookup"]  # not join, not _helper
    assert list(tools.load_tools(tools_file + ":lookup,echo")) == ["lookup", "echo"]
    schema = tools.tool_schema(tools_file, "echo", tools.load_tools(tools_file)["echo"])
    assert schema["function"]["name"] == "echo" and schema["function"]["description"] == "Repeat a text."
    assert schema["function"]["parameters"]["properties"]["times"] == {
        "type": "integer",
        "description": "How many times.",
    }
    assert schema["function"]["parameters"]["required"] == ["text"]


def test_loading_errors_name_the_file_and_the_function(tools_file, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tools file 'nowhere.py' does not exist; expected path/to/file.py"):
        tools.load_tools("nowhere.py")
    with pytest.raises(AttributeError, match=r"has no function 'nope'; its public functions: \['echo', 'lookup'"):
        tools.load_tools(tools_file + ":echo,nope")
    bare = tmp_path / "bare.py"
    bare.write_text(
        "def no_doc(x: int) -> int:\n    return x\n\n\ndef no_hints(x):\n    '''Hi.\n\n    Args:\n        x: X.\n    '''\n"
    )
    fns = tools.load_tools(str(bare))
    with pytest.raises(ValueError, match=r"bare.py', function 'no_doc': .*docstring.*A tool needs a type hint"):
        tools.tool_schema(str(bare), "no_doc", fns["no_doc"])
    with pytest.raises(ValueError, match=r"function 'no_hints': .*type hint"):
        tools.tool_schema(str(bare), "no_hints", fns["no_hints"])
    # the trainer loads them in the worker: the same message, as a RuntimeError
    with pytest.raises(RuntimeError, match=r"--tools .*bare.py: could not load the tools: .*function 'no_doc'"):
        tools.start_tools(str(bare))


# ----------------------------------------------------------------------------------------------
# prompts: the template's own tool rendering, or the fallback


def test_qwen_template_renders_the_tools_itself(qwen, calculator_schemas):
    assert tools.template_has_tools(qwen, calculator_schemas)
    text = qwen.decode(tools.render_prompt(qwen, [{"role": "user", "content": "2+2?"}], calculator_schemas))
    assert '"name": "calculator"' in text and '"expression": {"type": "string"' in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


CHATML = (  # SmolLM2-style: a template that ignores `tools`
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml(qwen):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    tok.chat_template = CHATML
    return tok


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(chatml, calculator_schemas):
    assert not tools.template_has_tools(chatml, calculator_schemas)
    text = chatml.decode(tools.render_prompt(chatml, [{"role": "user", "content": "2+2?"}], calculator_schemas))
    assert text.startswith(f"<|im_start|>system\n{tools.tool_prompt(calculator_schemas)}<|im_end|>\n")
    assert json.dumps(calculator_schemas[0]) in text and tools.CLOSE in text
    # the conversation's own system message comes first; tool results come back as one user turn
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    messages += [{"role": "assistant", "content": "<tool_call>...</tool_call>"}]
    messages += [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}]
    text = chatml.decode(tools.render_prompt(chatml, messages, calculator_schemas))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_tiny_models_template_ignores_tools_too(calculator_schemas):
    tiny = build_tokenizer(["list", "1", "2"])
    assert not tools.template_has_tools(tiny, calculator_schemas)
    assert tools.tool_call_stops(tiny) == ([], ["</tool_call>"])  # not a word of its vocabulary: a stop string


# ----------------------------------------------------------------------------------------------
# parsing the model's calls


def test_parse_one_call_and_several():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    assert tools.parse_calls(text) == [call("calculator", expression="2+2")]
    two = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b"}</tool_call> done'
    assert tools.parse_calls(two) == [call("a", x=1), call("b")]  # "arguments" may be left out
    assert tools.parse_calls("no calls here </tool_call>") == []
    # SmolLM2's trained format: a list of calls in one block; [] is no call at all
    listed = '<tool_call>[\n{"name": "a", "arguments": {"x": 1}},\n{"name": "b", "arguments": {}}\n]</tool_call>'
    assert (
        tools.parse_calls(listed) == [call("a", x=1), call("b")]
        and tools.parse_calls("<tool_call>[]</tool_call>") == []
    )
    mixed = tools.parse_calls('<tool_call>[{"name": "a"}, 7]</tool_call>')
    assert mixed[0] == call("a") and "the tool call 7 is not of the form" in mixed[1].problem


@pytest.mark.parametrize(
    "text,says",
    [
        ('<tool_call>{"name": "a", "arguments": {}}', "a <tool_call> without its </tool_call>; write <tool_call>{"),
        ("<tool_call>{name: a}</tool_call>", "the tool call is not valid JSON (Expecting property name"),
        ("<tool_call></tool_call>", "the tool call is not valid JSON"),
        ('<tool_call>"a"</tool_call>', "the tool call 'a' is not of the form <tool_call>{\"name\""),
        ('<tool_call>[["a"]]</tool_call>', "the tool call ['a'] is not of the form"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "is not of the form"),
        ('<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>', "is not of the form"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "the tool call is not valid JSON"),  # past json's depth
    ],
)
def test_a_malformed_call_is_a_problem_the_model_reads_never_an_exception(text, says):
    (parsed,) = tools.parse_calls(text)
    assert parsed.name is None and says in parsed.problem and len(parsed.problem) < 400


def test_an_unclosed_call_does_not_swallow_the_next():
    text = '<tool_call>{"name": "a"} <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    first, second = tools.parse_calls(text)
    assert "without its </tool_call>" in first.problem and second == call("b")


# ----------------------------------------------------------------------------------------------
# running calls in the worker: whatever a tool does is a message and a status


def test_every_misbehaviour_is_a_message_and_a_status_and_the_worker_serves_on(worker):
    calls = [call("echo", text="ab", times=2)] + [call("misbehave", how=h) for h in ["raise", "exit", "print"]]
    calls += tools.parse_calls("<tool_call>{bad}</tool_call>") + [
        call("nope"),
        call("echo"),
        call("echo", text="a", txt="a"),
    ]
    messages, statuses = tools.run_calls(calls, worker, timeout=5)
    assert statuses == ["ok", "raised", "raised", "ok", "malformed", "unknown_tool", "bad_arguments", "bad_arguments"]
    texts = [m["content"] for m in messages]
    assert all(m["role"] == "tool" for m in messages) and texts[0] == "abab" and texts[3] == "printed"
    assert texts[1].startswith("error: misbehave raised KeyError: 'missing' (my_tools.py:")
    assert texts[2] == "error: misbehave called sys.exit(3)"
    assert texts[4].startswith("error: the tool call is not valid JSON")
    assert texts[5] == "error: unknown tool 'nope'; available: echo, misbehave, lookup"
    assert texts[6] == (
        "error: bad arguments for echo: missing a required argument: 'text'; "
        "expected echo(text: str, times: int = 1) -> str"
    )
    assert "got an unexpected keyword argument 'txt'" in texts[7]


@pytest.mark.parametrize(
    "how,status,says",
    [
        ("hang", "timeout", "error: misbehave did not return within 1 s and was stopped"),
        ("os._exit", "raised", "error: misbehave ended its worker process with exit code 0 (os._exit?)"),
        ("segfault", "raised", "error: misbehave crashed its worker process (SIGSEGV: a crash in C code?)"),
    ],
)
def test_a_tool_that_hangs_or_ends_its_worker_gets_a_new_worker(worker, how, status, says):
    pid = worker.pid
    t = time.perf_counter()
    calls = [call("echo", text="a"), call("misbehave", how=how), call("echo", text="b")]
    messages, statuses = tools.run_calls(calls, worker, timeout=1)
    assert statuses == ["ok", status, "ok"] and [m["content"] for m in messages] == ["a", says, "b"]
    assert worker.pid != pid and time.perf_counter() - t < 30  # the rest of the batch ran in a new worker
    assert tools.run_calls([call("echo", text="c")], worker)[0] == [{"role": "tool", "content": "c"}]


def test_long_output_is_cut_with_a_note(worker):
    messages, statuses = tools.run_calls([call("echo", text="x", times=50)], worker, max_chars=10)
    assert statuses == ["truncated"]
    assert messages[0]["content"] == "xxxxxxxxxx\n[output cut: 50 characters, the first 10 shown]"
    assert tools.run_calls([call("echo", text="x", times=10)], worker, max_chars=10)[1] == ["ok"]


def test_tools_kwargs_come_from_the_row_and_the_model_cannot_override_them(worker):
    row = {"lookup": {"table": {"a": 1, "b": 2}}}
    calls = [call("lookup", key="a"), call("lookup", key="b", table={"b": "forged"})]
    messages, statuses = tools.run_calls(calls, worker, tools_kwargs=row)
    assert statuses == ["ok", "ok"]
    assert [json.loads(m["content"])["value"] for m in messages] == [1, 2]  # a dict comes back as JSON
    verl = {"lookup": {"create_kwargs": {"table": {"a": "verl"}}}}  # verl's nested form for its tool classes
    assert json.loads(tools.run_calls([call("lookup", key="a")], worker, verl)[0][0]["content"])["value"] == "verl"
    # without the row's table the model must pass one; the row's own parameters are hidden from it
    assert tools.run_calls([call("lookup", key="a")], worker)[1] == ["bad_arguments"]
    (echo, _, lookup), (_, _, shown) = worker.info, tools.row_schemas(worker.info, row)
    assert list(lookup["function"]["parameters"]["properties"]) == ["key", "table"]
    assert list(shown["function"]["parameters"]["properties"]) == ["key"] and shown["function"]["parameters"][
        "required"
    ] == ["key"]
    assert tools.row_schemas(worker.info, row)[0] == echo


def test_module_state_lives_as_long_as_the_worker(worker):
    before = json.loads(tools.run_calls([call("lookup", key="k", table={})], worker)[0][0]["content"])["calls"]
    tools.run_calls([call("echo", text="a"), call("echo", text="b")], worker)
    after = json.loads(tools.run_calls([call("lookup", key="k", table={})], worker)[0][0]["content"])["calls"]
    assert after == before + 2


def test_no_calls_need_no_worker(worker):
    assert tools.run_calls([], worker) == ([], [])


# ----------------------------------------------------------------------------------------------
# the token delta after the model's turn


def test_delta_ids_extend_the_prompt_and_the_models_tokens_as_the_full_rendering(qwen, calculator_schemas):
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is 2**10?"}]
    ids = tools.render_prompt(qwen, messages, calculator_schemas)
    for turn in range(2):  # two tool turns: earlier ids are never touched
        content = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "2**1{turn}"}}}}\n</tool_call>'
        messages = messages + [{"role": "assistant", "content": content}]
        results = [{"role": "tool", "content": "1024"}, {"role": "tool", "content": "see above"}]
        for ended in (True, False):  # ended with <|im_end|>, or stopped at </tool_call>
            model_wrote = qwen.encode(content, add_special_tokens=False) + ([im_end] if ended else [])
            delta = tools.delta_ids(qwen, messages, results, calculator_schemas, ended=ended)
            full = tools.render_prompt(qwen, messages + results, calculator_schemas)
            assert ids + model_wrote + delta == full
            assert qwen.decode(delta).startswith(
                "\n<|im_start|>user\n<tool_response>\n1024" if ended else "<|im_end|>\n"
            )
        ids, messages = full, messages + results


def test_delta_ids_never_retokenize_what_the_model_wrote(qwen, calculator_schemas):
    # the model may sample a tokenization of its text that tokenizing the text again would not give
    content = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>'
    sampled = [t for ch in content for t in qwen.encode(ch, add_special_tokens=False)]  # one character at a time
    assert sampled != qwen.encode(content, add_special_tokens=False) and qwen.decode(sampled) == content
    messages = [{"role": "user", "content": "12+34?"}, {"role": "assistant", "content": qwen.decode(sampled)}]
    delta = tools.delta_ids(qwen, messages, [{"role": "tool", "content": "46"}], calculator_schemas, ended=False)
    full = tools.render_prompt(qwen, messages + [{"role": "tool", "content": "46"}], calculator_schemas)
    assert full[-len(delta) :] == delta  # the same tail, whatever tokens came before it


def test_delta_ids_with_the_fallback_and_the_tiny_template(chatml, calculator_schemas):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    delta = tools.delta_ids(chatml, messages, [{"role": "tool", "content": "4"}], calculator_schemas, ended=False)
    assert (
        chatml.decode(delta)
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    tiny = build_tokenizer(["list", "1", "2", "<tool_response>", "</tool_response>"])  # turns end with " <eos> "
    messages = [{"role": "user", "content": "list 1"}, {"role": "assistant", "content": "2"}]
    delta = tools.delta_ids(tiny, messages, [{"role": "tool", "content": "1"}], calculator_schemas)
    assert tiny.convert_ids_to_tokens(delta) == [
        "<|user|>",
        "<tool_response>",
        "1",
        "</tool_response>",
        "<|assistant|>",
    ]


def test_a_template_that_rewrites_earlier_turns_is_an_error(chatml):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    # drops a past assistant turn's content once another message follows, as templates that drop past reasoning do
    tok.chat_template = CHATML.replace(
        "{{ m['content'] }}", "{{ '' if m['role'] == 'assistant' and not loop.last else m['content'] }}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "thinking"}]
    with pytest.raises(ValueError, match="renders the conversation so far differently"):
        tools.delta_ids(tok, messages, [{"role": "tool", "content": "4"}], [])
    with pytest.raises(ValueError, match=r"messages\[-1\] must be the model's turn"):
        tools.delta_ids(chatml, messages[:1], [{"role": "tool", "content": "4"}], [])


def test_tool_call_stops_are_a_token_id_where_the_vocabulary_has_one(qwen, chatml):
    assert tools.tool_call_stops(qwen) == ([151658], [])  # Qwen2.5's </tool_call>
    assert qwen.convert_ids_to_tokens(151658) == "</tool_call>"


# ----------------------------------------------------------------------------------------------
# the calculator example


@pytest.fixture(scope="module")
def calculator():
    return tools.load_tools(CALCULATOR)["calculator"]  # in this process: it parses, never evaluates


@pytest.mark.parametrize(
    "expression,value",
    [("(3 + 4) * 12 / 5", "16.8"), ("2**10", "1024"), ("-3 // 2", "-2"), ("7 % 3", "1"), ("2 ** -2", "0.25")]
    + [("-(1.5 + 0.5) * 3", "-6.0"), ("10**999 // 10**998", "10"), ("1_000 * 3", "3000")],
)
def test_the_calculator_computes_arithmetic(calculator, expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression,says",
    [
        ("9**9**9", "the exponent 387420489 is too large"),
        ("2**3000", "the exponent 3000 is too large"),
        ("999**999", "more than 1000 digits"),
        ("10**999 * 10", "more than 1000 digits"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("x + 1", "'x' is not allowed"),
        ("abs(-1)", "'abs(-1)' is not allowed"),
        ("__import__('os').system('true')", "is not allowed"),
        ("().__class__.__bases__", "is not allowed"),
        ("(1).real", "is not allowed"),
        ("True + 1", "'True' is not allowed"),
        ("1j", "is not allowed"),
        ("1 << 100000", "operator LShift is not allowed"),
        ("[1] * 10**9", "is not allowed"),
        ("lambda: 1", "is not allowed"),
        ("1; 2", "not an arithmetic expression"),
        ("-" * 400 + "1", "nested operations"),
        ("9" * 5000, "at most 500"),
    ],
)
def test_the_calculator_refuses_what_is_not_small_arithmetic_quickly(calculator, expression, says):
    t = time.perf_counter()
    with pytest.raises(ValueError, match=None) as err:
        calculator(expression)
    assert says in str(err.value) and time.perf_counter() - t < 0.5


def test_the_calculator_through_the_worker_and_the_qwen_format(qwen, calculator_schemas):
    worker, schemas = tools.start_tools(CALCULATOR)
    assert schemas == calculator_schemas
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    text += '<tool_call>\n{"name": "calculator", "arguments": {"expression": "9**9**9"}}\n</tool_call>'
    messages, statuses = tools.run_calls(tools.parse_calls(text), worker)
    worker.close()
    assert statuses == ["ok", "raised"] and messages[0]["content"] == "42"
    assert messages[1]["content"].startswith("error: calculator raised ValueError: the exponent 387420489 is too large")


# ----------------------------------------------------------------------------------------------
# what a tool leaves behind: its prints (capped), its processes (killed with its worker), its waits (said)

UNRULY = '''
import os, subprocess, time


def spawn(pid_file: str) -> str:
    """Start a process in a session of its own, which a kill of the worker's process group misses.

    Args:
        pid_file: Where to write its process id.
    """
    child = subprocess.Popen(["setsid", "sleep", "1000"])
    while os.getsid(child.pid) == os.getsid(0):  # until setsid(1) has made its session
        time.sleep(0.01)
    open(pid_file, "w").write(str(child.pid))
    return "started"


def shout(n: int) -> str:
    """Print n bytes, then answer.

    Args:
        n: How many bytes to print.
    """
    os.write(1, b"s" * n)
    return "done"


def slow() -> str:
    """Take a long time."""
    time.sleep(1000)
    return "never"
'''


@pytest.fixture
def unruly(tmp_path):
    path = tmp_path / "unruly.py"
    path.write_text(UNRULY)
    worker, _ = tools.start_tools(str(path), timeout=5)
    yield worker
    worker.close()


def test_closing_the_worker_kills_a_process_a_tool_started_in_a_new_session(unruly, tmp_path):
    import os
    import signal

    from test_reward_safety import pid_alive, wait_gone

    pid_file = tmp_path / "sleep.pid"
    assert tools.run_calls([call("spawn", pid_file=str(pid_file))], unruly)[1] == ["ok"]
    sleep = int(pid_file.read_text())
    try:
        assert pid_alive(sleep) and os.getsid(sleep) != os.getsid(unruly.pid)
        unruly.close()
        assert wait_gone(sleep, seconds=5)
    finally:
        if pid_alive(sleep):
            os.kill(sleep, signal.SIGKILL)


def test_a_tool_that_prints_too_much_is_cut_and_counted_truncated(unruly, capfd):
    from reward_worker import OUTPUT_CAP

    messages, statuses = tools.run_calls([call("shout", n=10**7), call("shout", n=10)], unruly)
    assert statuses == ["truncated", "ok"] and [m["content"] for m in messages] == ["done", "done"]
    err = capfd.readouterr().err
    note = f"[tool worker: one call printed 10,000,000 bytes; the first {OUTPUT_CAP:,} are above, the rest was dropped]"
    assert note in err and len(err) < OUTPUT_CAP + 500
    assert err.endswith(f"{note}\n" + "s" * 10)


def test_each_calls_prints_are_counted_as_its_own_however_slowly_they_are_read(unruly, capfd, monkeypatch):
    # a slow reader (a busy machine): the worker answers the first call and prints the second's 10 bytes while we
    # still pass the first's on. Counting by timing gave the first call 10,000,010; its end mark makes it exact.
    import reward_worker

    say = reward_worker.say
    monkeypatch.setattr(reward_worker, "say", lambda data: (time.sleep(0.01), say(data)))
    test_a_tool_that_prints_too_much_is_cut_and_counted_truncated(unruly, capfd)


def test_a_rank_waiting_on_a_tool_can_say_which_and_for_how_long(unruly):
    import threading

    from reward_worker import waits

    assert waits() == []
    running = threading.Thread(target=tools.run_calls, args=([call("slow")], unruly), kwargs=dict(timeout=3))
    running.start()
    deadline = time.time() + 10
    while not waits() and time.time() < deadline:
        time.sleep(0.01)
    assert waits() == ["waiting 0 s on tool slow (unruly.py), which --tool-timeout allows 3 s"]
    running.join()
    assert waits() == []
