"""multi_turn.py: the multi-turn loop, with a scripted engine (each turn's text fixed by the test) and
the real Qwen2.5 and SmolLM2 tokenizers and chat templates; the real engines' stops; the masks in
the loss. The end-to-end runs (1 and 2 ranks, kill -9 and resume) are in test_train_tools.py."""

import os
import textwrap

import pytest
import torch
from conftest import QWEN_DIR, REPO, need

import multi_turn
import tools
from engine import Rollout, sample_seeds

CALC = os.path.join(REPO, "examples", "tools", "calculator.py")
IM_END = "<|im_end|>"


def call(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine:
    """An engine whose every turn writes the script's text: script[question][k] is the model's k-th
    turn on the prompt holding `question` (k: the assistant turns already in the prompt). It stops
    as a real engine does: at an EOS or stop token (kept), at the token completing a stop string, or
    at max_new_tokens (truncated); each token's log-prob is -0.5. Records every call's arguments."""

    def __init__(self, tokenizer, script, eos_ids):
        self.tokenizer, self.script, self.eos_ids, self.calls = tokenizer, script, set(eos_ids), []

    def generate(self, prompts, *, n, seeds, max_new_tokens, stop_token_ids=(), stop=(), logprobs=True, **kw):
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
        self.calls.append(dict(n=n, seeds=list(seeds), budgets=list(budgets), stop_ids=stop_token_ids, stop=stop))
        out = Rollout()
        for prompt, budget in zip(prompts, budgets):
            text = self.tokenizer.decode(prompt)
            question = next(q for q in self.script if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer.encode(self.script[question][turn], add_special_tokens=False)
            for j, tok in enumerate(ids):
                done = tok in self.eos_ids or tok in stop_token_ids
                done = done or any(s in self.tokenizer.decode(ids[: j + 1]) for s in stop)
                if done or j + 1 == budget:
                    ids, truncated = ids[: j + 1], not done
                    break
            else:
                truncated = len(ids) >= budget
            for _ in range(n):
                out.response_ids.append(list(ids))
                out.logprobs.append([-0.5] * len(ids) if logprobs else [])
                out.truncated.append(truncated)
        if not logprobs:
            out.logprobs = []
        return out


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    need(QWEN_DIR)
    return AutoTokenizer.from_pretrained(QWEN_DIR)


def setup_for(tokenizer, spec=CALC, max_turns=4, timeout=5.0, max_chars=200):
    from engine import stop_token_ids

    eos = stop_token_ids(tokenizer.name_or_path)
    return multi_turn.start_tools(spec, tokenizer, eos, max_turns=max_turns, timeout=timeout, max_chars=max_chars)


def rows_for(tokenizer, setup, questions):
    rows = [{"prompt": [{"role": "user", "content": q}], "extra_info": {}} for q in questions]
    for row in rows:
        row["prompt_ids"] = tools.render_prompt(tokenizer, row["prompt"], setup.schemas)
    return rows


def test_a_conversation_is_the_chat_templates_tokens_and_only_the_models_are_trained(qwen):
    """Qwen2.5 (native tools, </tool_call> one token): the model calls the calculator, reads 20126,
    answers. prompt + response is exactly the template's rendering of the whole conversation; the
    mask, the log-probs and the conversation mark the model's turns, and the reward scores its last."""
    setup = setup_for(qwen)
    first = "Let me compute.\n" + call("calculator", expression="347 * 58")
    script = {"347 * 58": [first + IM_END, "347 * 58 = 20126." + IM_END]}  # the stop ends turn 1 first
    engine = ScriptedEngine(qwen, script, setup.eos_ids)
    rows = rows_for(qwen, setup, ["What is 347 * 58?"])
    try:
        out = multi_turn.generate_turns(engine, rows, setup, n=2, seeds=[7], max_new_tokens=200, temperature=1.0)
    finally:
        setup.close()
    assert engine.calls[0]["stop_ids"] == [151658] and engine.calls[0]["n"] == 2  # </tool_call>
    turns = out.turns[0]
    assert [m["role"] for m in turns.conversation] == ["assistant", "tool", "assistant"]
    assert turns.conversation[1]["content"] == "20126" and turns.statuses == ["ok"] and turns.num_turns == 2
    assert turns.answer() == "347 * 58 = 20126." and "[tool] 20126" in turns.shown()
    whole = qwen.apply_chat_template(rows[0]["prompt"] + turns.conversation, tools=setup.schemas, tokenize=False)
    assert rows[0]["prompt_ids"] + out.response_ids[0] == qwen.encode(whole.removesuffix("\n"))
    model = [t for t, m in zip(out.response_ids[0], out.model_mask[0]) if m]
    assert qwen.decode(model) == first + "347 * 58 = 20126." + IM_END  # <|im_end|> after the call is the template's
    assert [lp for lp, m in zip(out.logprobs[0], out.model_mask[0]) if m] == [-0.5] * len(model)
    assert all(lp == 0.0 for lp, m in zip(out.logprobs[0], out.model_mask[0]) if not m)
    assert out.response_ids[1] == out.response_ids[0] and out.truncated == [False, False]


def test_turns_are_seeded_by_the_sample_and_the_turn_and_share_one_budget(qwen):
    setup = setup_for(qwen)
    script = {"Q1": [call("calculator", expression="1+1"), "2" + IM_END], "Q2": ["no tool" + IM_END]}
    engine = ScriptedEngine(qwen, script, setup.eos_ids)
    rows = rows_for(qwen, setup, ["Q1", "Q2"])
    try:
        out = multi_turn.generate_turns(engine, rows, setup, n=2, seeds=[10, 20], max_new_tokens=100)
    finally:
        setup.close()
    first, second = engine.calls
    assert first["seeds"] == [10, 20] and first["n"] == 2 and first["budgets"] == [100, 100]
    samples = sample_seeds([10, 20], 2, 2)  # Q1's samples 0 and 1 go on; Q2's end
    assert second["n"] == 1 and second["seeds"] == [multi_turn.turn_seed(s, 2) for s in samples[:2]]
    assert second["budgets"] == [100 - len(out.response_ids[0]) + 2] * 2  # "2<|im_end|>" is 2 tokens
    assert [t.num_turns for t in out.turns] == [2, 2, 1, 1]


def test_a_response_that_runs_out_of_room_ends_truncated_without_the_results(qwen):
    setup = setup_for(qwen)
    script = {"Q": [call("calculator", expression="2 ** 10"), "1024" + IM_END]}
    engine = ScriptedEngine(qwen, script, setup.eos_ids)
    rows = rows_for(qwen, setup, ["Q"])
    model_tokens = len(qwen.encode(call("calculator", expression="2 ** 10")))
    try:  # room for the call, not for the results after it
        out = multi_turn.generate_turns(engine, rows, setup, n=1, seeds=[0], max_new_tokens=model_tokens + 3)
        short = multi_turn.generate_turns(engine, rows, setup, n=1, seeds=[0], max_new_tokens=model_tokens - 2)
    finally:
        setup.close()
    assert out.truncated == [True] and out.model_mask[0] == [1] * model_tokens
    assert out.turns[0].statuses == ["ok"] and out.turns[0].conversation[-1]["role"] == "tool"
    assert (
        short.truncated == [True] and short.turns[0].statuses == [] and len(short.response_ids[0]) == model_tokens - 2
    )


def test_the_last_turns_calls_are_not_run(qwen):
    setup = setup_for(qwen, max_turns=1)
    engine = ScriptedEngine(qwen, {"Q": [call("calculator", expression="3*3")]}, setup.eos_ids)
    try:
        out = multi_turn.generate_turns(engine, rows_for(qwen, setup, ["Q"]), setup, n=1, seeds=[0], max_new_tokens=50)
    finally:
        setup.close()
    assert len(engine.calls) == 1 and out.turns[0].statuses == [] and out.truncated == [False]
    assert out.model_mask[0] == [1] * len(out.response_ids[0])


def test_every_kind_of_tool_failure_is_a_message_and_the_conversation_goes_on(qwen, tmp_path):
    """Malformed JSON, an unknown tool, wrong arguments, a tool that raises, one that hangs past the
    timeout, one whose output is cut: each sample reads an error and answers in its next turn."""
    spec = tmp_path / "flaky.py"
    spec.write_text(
        textwrap.dedent('''
        import time


        def boom(x: int) -> str:
            """Raise.

            Args:
                x: Anything.
            """
            raise RuntimeError("kaput")


        def hang(seconds: float) -> str:
            """Sleep.

            Args:
                seconds: How long.
            """
            time.sleep(seconds)
            return "woke"


        def shout(n: int) -> str:
            """A long answer.

            Args:
                n: Its length.
            """
            return "A" * n
        ''')
    )
    cases = {
        "Q-malformed": ("<tool_call>\n{not json\n</tool_call>", "malformed"),
        "Q-unknown": (call("nope", x=1), "unknown_tool"),
        "Q-arguments": (call("boom", y=1), "bad_arguments"),
        "Q-raises": (call("boom", x=1), "raised"),
        "Q-hangs": (call("hang", seconds=60), "timeout"),
        "Q-long": (call("shout", n=5000), "truncated"),
    }
    setup = setup_for(qwen, spec=str(spec), timeout=1.0, max_chars=100)
    engine = ScriptedEngine(qwen, {q: [text, "done" + IM_END] for q, (text, _) in cases.items()}, setup.eos_ids)
    try:
        out = multi_turn.generate_turns(
            engine, rows_for(qwen, setup, list(cases)), setup, n=1, seeds=list(range(6)), max_new_tokens=400
        )
    finally:
        setup.close()
    assert [t.statuses for t in out.turns] == [[status] for _, status in cases.values()]
    assert all(t.num_turns == 2 and t.answer() == "done" for t in out.turns)
    assert all(t.conversation[1]["content"].startswith("error:") for t in out.turns[:5])
    assert "kaput" in out.turns[3].conversation[1]["content"] and len(out.turns[5].conversation[1]["content"]) < 200
    metrics = multi_turn.turn_metrics(multi_turn.turn_counts(out.turns))
    assert metrics["tool/errors"] == 6 and metrics["tool/timeouts"] == 1 and metrics["tool/malformed"] == 1
    assert metrics["num_turns/mean"] == 2 and metrics["tool/calls_per_sample"] == 1 and metrics["tool/use_rate"] == 1


def test_tools_kwargs_reach_the_tool_and_leave_the_prompt(qwen, tmp_path):
    spec = tmp_path / "check.py"
    spec.write_text(
        textwrap.dedent('''
        def check(answer: str, ground_truth: str) -> str:
            """Check an answer.

            Args:
                answer: The answer.
                ground_truth: The truth.
            """
            return "right" if answer == ground_truth else "wrong"
        ''')
    )
    setup = setup_for(qwen, spec=str(spec))
    row = {
        "prompt": [{"role": "user", "content": "Q"}],
        "extra_info": {"tools_kwargs": {"check": {"ground_truth": "7"}}},
    }
    import data_prep  # the trainer renders each row's prompt with its own schemas

    path = tmp_path / "rows.parquet"
    from tasks.common import write_parquet

    write_parquet(
        [{**row, "data_source": "x", "ability": "a", "reward_model": {"style": "rule", "ground_truth": "7"}}], str(path)
    )
    rows, _ = data_prep.load_prompts(str(path), qwen, schemas=setup.schemas)
    engine = ScriptedEngine(qwen, {"Q": [call("check", answer="7"), "ok" + IM_END]}, setup.eos_ids)
    try:
        out = multi_turn.generate_turns(engine, rows, setup, n=1, seeds=[0], max_new_tokens=200)
    finally:
        setup.close()
    assert "ground_truth" not in qwen.decode(rows[0]["prompt_ids"]) and '"answer"' in qwen.decode(rows[0]["prompt_ids"])
    assert out.turns[0].conversation[1]["content"] == "right"


def test_the_fallback_template_stops_at_the_call_string(smollm2_model):
    """SmolLM2 (its template ignores tools; </tool_call> is several tokens): the turn ends at the
    token that completes "</tool_call>", the results come back as a user turn of <tool_response>
    blocks, and prompt + response is the fallback's rendering of the whole conversation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    setup = setup_for(tok)
    assert setup.stops == ([], ["</tool_call>"])
    first = call("calculator", expression="12*12")
    engine = ScriptedEngine(tok, {"12*12": [first + " and more", "144" + IM_END]}, setup.eos_ids)
    rows = rows_for(tok, setup, ["What is 12*12?"])
    try:
        out = multi_turn.generate_turns(engine, rows, setup, n=1, seeds=[0], max_new_tokens=300)
    finally:
        setup.close()
    turns = out.turns[0]
    assert turns.conversation[0]["content"] == first and turns.statuses == ["ok"] and turns.answer() == "144"
    whole = tools.chat_text(tok, rows[0]["prompt"] + turns.conversation, setup.schemas, False, False)
    assert rows[0]["prompt_ids"] + out.response_ids[0] == tok.encode(whole.removesuffix("\n"))


def test_tool_tokens_get_no_gradient(tmp_path):
    """make_batch's model_mask: whatever the batch holds on the tools' tokens (advantages, old and
    reference log-probs), the loss and every parameter's gradient are the same, and the gradient
    reaching those tokens' log-probs and entropies is exactly 0."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    import policy
    from loss import loss_denominator, micro_batch_loss
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (4,), generator=g).tolist() for _ in range(3)]
    responses = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (9, 6, 8)]
    model_mask = [[1, 1, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 1, 1, 1]]
    args = SimpleNamespace(
        tis_cap=0, loss_scale_factor=0, max_response_length=16, clip_low=0.2, clip_high=0.2, clip_c=3.0,
        loss_mode="vanilla", loss_agg="token-mean", tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0,
        kl_cov_ratio=2e-4, ppo_kl_coef=0.1, kl_kind="low_var_kl", kl_coef=0.1, entropy_coef=0.01, teacher="",
    )  # fmt: skip

    def gradients(noise):
        batch = policy.make_batch(prompts, responses, pad_id=0, model_mask=model_mask)
        tool = batch["response_mask"] == 0
        with torch.no_grad():  # old and reference log-probs near the policy's, so that few are clipped
            base = policy.compute_logprobs(model, batch, micro=3, max_tokens=0, temperature=1.0, device="cpu")
        for k, scale in (("advantages", 1.0), ("old_logp", 0.01), ("ref_logp", 0.05)):
            near = torch.randn(tool.shape, generator=torch.Generator().manual_seed(1)) * scale
            batch[k] = torch.where(tool, noise * torch.randn(tool.shape), near + (0 if k == "advantages" else base))
        model.zero_grad()
        view = policy.micro_batch(batch, [0, 1, 2])
        logp, entropy = policy.response_logprobs(model, view, torch.device("cpu"), 1.0, entropy_grad=True)
        logp.retain_grad()
        entropy.retain_grad()
        whole = loss_denominator(view["response_mask"], args)  # one micro-batch: its loss unweighted
        loss, _, _ = micro_batch_loss(logp, entropy, view, args=args, whole=whole, world=1)
        loss.backward()
        tool = torch.zeros_like(logp, dtype=torch.bool)
        tool[0, 2:5], tool[2, 1:3] = True, True  # the zeros of model_mask
        assert torch.equal(view["response_mask"][tool], torch.zeros(5))
        assert (logp.grad[tool] == 0).all() and (entropy.grad[tool] == 0).all()
        assert (logp.grad[view["response_mask"] == 1] != 0).all()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss_a, grads_a = gradients(0.0)
    loss_b, grads_b = gradients(100.0)
    assert loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
