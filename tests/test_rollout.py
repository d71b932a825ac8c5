"""rollout.py: both engines sample the same way and report the log-probs the trainer computes.

Every check runs on a real tiny model, against a transformers forward pass of the same weights:
log softmax(logits / temperature) of each sampled token, via `logprobs.logprobs_from_logits`. One
vLLM engine serves the whole module (it takes ~15 s to start); the HF engine is cheap.
"""

import logging
import os
import random
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Rollout
from hf_engine import HFEngine, filter_logits
from logprobs import logprobs_from_logits
from models import build_tiny_model
from rollout import make_engine
from vllm_engine import RELOAD_LOGGER, VLLMEngine, count_greater_than, cpu_kv_cache_bytes, kv_bytes_per_token

WORDS = [str(d) for d in range(10)] + ["list", "pos"]
EOS = 2  # "<eos>" in models.SPECIAL_TOKENS
PROMPTS = [[1, 4, 7, 8, 9, 5], [1, 4, 10, 11, 5], [1, 5]]  # token ids of different lengths
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("rollout") / "tiny"), WORDS, seed=0)


@pytest.fixture(scope="module")
def ref_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_engine(model_path):
    pytest.importorskip("vllm")
    engine = VLLMEngine(model_path, max_model_len=MAX_LEN, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(model_path):
    return HFEngine(model_path, max_model_len=MAX_LEN, seed=0, max_batch_size=4)  # small: exercises chunking


@pytest.fixture(params=["vllm", "hf"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@torch.no_grad()
def reference_logits(model, prompt, response):
    """The logits that predicted each response token, [T, V], from one forward pass."""
    ids = torch.tensor([prompt + response])  # [1, P+T]
    return model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]


def samples_of(rollout, i, n):
    return rollout.response_ids[i * n : (i + 1) * n]


# ----------------------------------------------------------------------------------------------


def test_structure_eos_and_truncation(engine):
    n, max_new = 8, 6
    out = engine.generate(PROMPTS, n=n, temperature=1.0, max_new_tokens=max_new, seeds=[0, 1, 2])
    assert isinstance(out, Rollout)
    assert len(out.response_ids) == len(out.logprobs) == len(out.truncated) == len(PROMPTS) * n
    for ids, lps, truncated in zip(out.response_ids, out.logprobs, out.truncated):
        assert len(ids) == len(lps) >= 1 and all(lp <= 0 for lp in lps)
        if truncated:  # ran out of tokens without EOS
            assert len(ids) == max_new and EOS not in ids
        else:  # stopped at the first EOS, which is kept
            assert ids[-1] == EOS and EOS not in ids[:-1] and len(ids) <= max_new
    assert any(out.truncated) and not all(out.truncated)  # both cases occur with these seeds
    # without seeds it still samples, from the engine's own seeded state
    assert len(engine.generate(PROMPTS, n=2, max_new_tokens=4).response_ids) == len(PROMPTS) * 2


def test_greedy_matches_argmax(engine, ref_model):
    n = 2
    out = engine.generate(PROMPTS, n=n, temperature=0.0, max_new_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        first, second = samples_of(out, i, n)
        assert first == second  # greedy samples are all the same
        logits = reference_logits(ref_model, prompt, first)  # [T, V]
        assert first == logits.argmax(-1).tolist()
        # greedy log-probs are those of the raw logits (temperature 1)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(first)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.logprobs[i * n]), expected, atol=1e-4, rtol=0)


def assert_logprobs_match(out, model, n, temperature, top_k=-1, top_p=1.0, prompts=PROMPTS):
    """Each sample's log-probs equal log softmax(filtered logits / temperature) of the reference model."""
    for k, (ids, lps) in enumerate(zip(out.response_ids, out.logprobs)):
        logits = reference_logits(model, prompts[k // n], ids)  # [T, V]
        if top_k == -1 and top_p == 1.0:  # the trainer's formula, exactly
            expected = logprobs_from_logits(logits[None], torch.tensor([ids]), temperature)[0]  # [T]
        else:
            logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p), -1)  # [T, V]
            expected = logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(engine, ref_model, temperature):
    n = 3
    out = engine.generate(PROMPTS, n=n, temperature=temperature, max_new_tokens=12, seeds=[4, 5, 6])
    assert_logprobs_match(out, ref_model, n, temperature)


def test_top_k_top_p_logprobs_are_of_the_filtered_distribution(engine, ref_model):
    n, top_k, top_p = 4, 6, 0.8
    out = engine.generate(PROMPTS, n=n, temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=10, seeds=[7, 8, 9])
    assert_logprobs_match(out, ref_model, n, 0.7, top_k, top_p)  # also: every sampled token was kept by the filter


def test_per_prompt_seeds_do_not_depend_on_the_batch(engine):
    # n=3 with the HF engine's chunks of 4 rows: batched, this prompt's rows share chunks with others
    n, prompt = 3, PROMPTS[1]
    alone = engine.generate([prompt], n=n, max_new_tokens=10, seeds=[42])
    batched = engine.generate([PROMPTS[0], prompt, PROMPTS[2]], n=n, max_new_tokens=10, seeds=[3, 42, 11])
    assert samples_of(batched, 1, n) == alone.response_ids  # prompt-major, same samples
    torch.testing.assert_close(
        torch.tensor(sum(batched.logprobs[n : 2 * n], [])), torch.tensor(sum(alone.logprobs, []))
    )
    assert len({tuple(s) for s in alone.response_ids}) > 1  # the n samples differ from each other
    other = engine.generate([prompt], n=n, max_new_tokens=10, seeds=[43])
    assert other.response_ids != alone.response_ids  # and another seed gives other samples


def test_a_rollout_several_times_vllms_step_budget_keeps_per_prompt_seeds(engine, ref_model):
    # Regression: vLLM packs at most 4096 tokens into an engine step. Seeded prompts beyond that
    # crashed the CPU engine ("CPU Generator does not use offset"): chunked prefill split a
    # prompt over two steps, then rewound its generator. GSM8K prompts hit it at ~35 sequences.
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(7, 19) for _ in range(59)] for _ in range(256)]  # 15,360 prompt tokens
    n = 2
    out = engine.generate(prompts, n=n, temperature=1.0, max_new_tokens=4, seeds=list(range(len(prompts))))
    assert len(out.response_ids) == len(out.logprobs) == len(prompts) * n
    for i in (0, 97, 255):  # a prompt's samples are those it draws alone: nothing was drawn and thrown away
        alone = engine.generate([prompts[i]], n=n, temperature=1.0, max_new_tokens=4, seeds=[i])
        assert samples_of(out, i, n) == alone.response_ids
        assert sum(out.logprobs[i * n : (i + 1) * n], []) == pytest.approx(sum(alone.logprobs, []), abs=1e-5)
    some = [0, 97, 255]
    picked = Rollout(
        sum((samples_of(out, i, n) for i in some), []), sum((out.logprobs[i * n : (i + 1) * n] for i in some), [])
    )
    assert_logprobs_match(picked, ref_model, n, 1.0, prompts=[prompts[i] for i in some])


def test_without_logprobs_the_samples_are_the_same(engine):
    asked = engine.generate(PROMPTS, n=3, max_new_tokens=10, seeds=[5, 6, 7])
    skipped = engine.generate(PROMPTS, n=3, max_new_tokens=10, seeds=[5, 6, 7], logprobs=False)
    assert skipped.response_ids == asked.response_ids and skipped.truncated == asked.truncated
    assert skipped.logprobs == [] and len(asked.logprobs) == len(asked.response_ids)


def test_vllms_token_ranks_are_counted_eagerly_on_cpu(vllm_engine):
    """vllm_engine.eager_token_ranks: the sampler counts each sampled token's rank with our eager function, which
    gives what vLLM's compiled one computes (its source, run uncompiled), and sampling with log-probs and scoring a
    prompt compile nothing (inductor cost 2.3 s of every CPU engine's start, 9.5 s on a fresh machine)."""
    import torch._dynamo.utils
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as vllm_logprobs

    assert sampler.batched_count_greater_than is count_greater_than
    x = torch.randn(6, 50)
    x[2, :3] = x[2, 9]  # ties count, as in vLLM's
    vllms = vllm_logprobs.batched_count_greater_than._torchdynamo_orig_callable
    for column in (0, 9, 49):
        value = x[:, column : column + 1]
        assert torch.equal(count_greater_than(x, value), vllms(x, value))
    before = dict(torch._dynamo.utils.counters["frames"])
    out = vllm_engine.generate(PROMPTS, n=2, max_new_tokens=6, seeds=[1, 2, 3])
    vllm_engine.prompt_logprobs(PROMPTS[0])
    assert dict(torch._dynamo.utils.counters["frames"]) == before
    assert len(out.logprobs) == len(out.response_ids) == 6


def test_update_weights_streams_new_parameters(engine, model_path, ref_model):
    perturbed = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    assert perturbed.lm_head.weight is perturbed.model.embed_tokens.weight  # tied, as in Qwen2.5-0.5B
    torch.manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    n, seeds = 2, [1, 2, 3]
    before = engine.generate(PROMPTS, n=n, temperature=0.7, max_new_tokens=10, seeds=seeds)

    # a generator, as the trainer passes one (named_parameters lists the tied embedding once)
    engine.update_weights((name, p.detach()) for name, p in perturbed.named_parameters())
    after = engine.generate(PROMPTS, n=n, temperature=0.7, max_new_tokens=10, seeds=seeds)
    assert after.logprobs != before.logprobs
    assert_logprobs_match(after, perturbed, n, 0.7)

    # and back: the module's other tests share this engine
    engine.update_weights((name, p.detach()) for name, p in ref_model.named_parameters())
    assert_logprobs_match(
        engine.generate(PROMPTS, n=n, temperature=0.7, max_new_tokens=10, seeds=seeds), ref_model, n, 0.7
    )


def run_stream(stream, steps=None):
    """Step `stream` until it is empty (or `steps` times): {key: Rollout of its samples}."""
    done = {}
    while len(stream) and (steps is None or steps > 0):
        done.update(stream.step())
        steps = None if steps is None else steps - 1
    return done


def test_a_stream_samples_what_generate_samples(vllm_engine):
    from vllm_engine import Stream

    stream, n, kw = Stream(vllm_engine), 3, dict(temperature=0.7, top_p=1.0, top_k=-1, logprobs=True)
    for i, prompt in enumerate(PROMPTS):
        stream.submit(i, prompt, n, seed=10 + i, max_new_tokens=12, **kw)
    done = run_stream(stream)
    batch = vllm_engine.generate(PROMPTS, n=n, max_new_tokens=12, seeds=[10, 11, 12], **kw)
    for i in range(len(PROMPTS)):  # the same seeds, the same samples and log-probs
        assert done[i].response_ids == samples_of(batch, i, n) and done[i].logprobs == batch.logprobs[i * n : i * n + n]


def test_a_stream_takes_new_weights_mid_answer(vllm_engine, model_path, ref_model):
    """AReaL's interruptible generation: weights loaded while answers run. Each answer's tokens before the
    load are the old weights', those after it the new weights' over the whole context (vLLM preempted the
    answers and recomputed their KV cache), and each token's log-prob is of the weights that drew it."""
    from vllm_engine import Stream

    new = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stream, n, before = Stream(vllm_engine), 2, 5
    prompts = [[1, 7, 8, 9, 5], [1, 4, 10, 5]]
    for i, prompt in enumerate(prompts):
        stream.submit(i, prompt, n, seed=i, max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=-1, logprobs=True)
    done = run_stream(stream, steps=before)  # one token per answer per step: `before` tokens each
    stream.update_weights((name, p.detach()) for name, p in new.named_parameters())
    assert len(stream) > 0  # answers were running when the weights changed
    probe = stream.prompt_logprobs(PROMPTS[0])  # the weight check's probe, with answers in flight
    expected = logprobs_from_logits(
        reference_logits(new, PROMPTS[0][:1], PROMPTS[0][1:])[None], torch.tensor([PROMPTS[0][1:]]), 1.0
    )[0]
    torch.testing.assert_close(torch.tensor(probe), expected, atol=1e-4, rtol=0)
    done.update(run_stream(stream))
    assert sorted(done) == [0, 1] and all(len(done[i].response_ids) == n for i in done)
    spanned = 0
    for i, out in done.items():
        for ids, lps in zip(out.response_ids, out.logprobs):
            old = logprobs_from_logits(reference_logits(ref_model, prompts[i], ids)[None], torch.tensor([ids]), 1.0)[0]
            now = logprobs_from_logits(reference_logits(new, prompts[i], ids)[None], torch.tensor([ids]), 1.0)[0]
            k = min(before, len(ids))
            torch.testing.assert_close(torch.tensor(lps[:k]), old[:k], atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(lps[k:]), now[k:], atol=1e-4, rtol=0)
            spanned += len(ids) > before
    assert spanned > 0  # some answers did run on across the load
    vllm_engine.update_weights((name, p.detach()) for name, p in ref_model.named_parameters())  # shared engine


def test_quiet_weight_sync_prints_nothing_but_real_warnings_get_through(vllm_engine, ref_model, capfd):
    # vllm_engine was built with verbose=False. vLLM's handler holds the stream it was configured
    # with, which pytest's capture of this test does not see; point it at this test's stderr.
    handler = next(h for h in logging.getLogger("vllm").handlers if h.name == "vllm")
    stream = handler.setStream(sys.stderr)
    try:
        capfd.readouterr()
        vllm_engine.wake_up()  # as the trainer syncs: wake_up, update_weights, sleep (the same weights here)
        vllm_engine.update_weights((name, p.detach()) for name, p in ref_model.named_parameters())
        vllm_engine.sleep()
        synced = capfd.readouterr()
        # a real warning, from anywhere in vLLM, and the same reload warning for a layer that has weights
        logging.getLogger("vllm.some.module").warning("a genuine vLLM warning")
        logging.getLogger(RELOAD_LOGGER).warning("%s: Failed to load weights", "ParallelLMHead")
        warned = capfd.readouterr()
    finally:
        handler.setStream(stream)
    # no "RotaryEmbedding: Failed to load weights", "Reloading ...", "... prefix cache"
    assert synced.out + synced.err == ""
    assert "a genuine vLLM warning" in warned.err
    assert "ParallelLMHead: Failed to load weights" in warned.err


def test_hf_update_weights_names_an_unknown_parameter(hf_engine):
    with pytest.raises(KeyError, match="not.a.param"):
        hf_engine.update_weights([("not.a.param", torch.zeros(1))])


# ----------------------------------------------------------------------------------------------
# make_engine


def test_kv_bytes_per_token_of_real_configs():
    from transformers import AutoConfig, LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    # a key and a value x 30 layers x 3 KV heads x 64 dims x 4 bytes. At 1 GiB vLLM held 23,296 tokens
    # of the real SmolLM2 (BENCHMARKS.md): 2**30 // 46,080 = 23,301, down to its 128-token blocks
    assert kv_bytes_per_token(smollm2, torch.float32) == 46_080
    assert 2**30 // 46_080 // 128 * 128 == 23_296
    qwen = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "qwen2.5-0.5b-instruct")
    if os.path.isdir(qwen):  # 24 layers x 2 KV heads x (896 / 14 = 64) dims, bf16
        assert kv_bytes_per_token(AutoConfig.from_pretrained(qwen), torch.bfloat16) == 2 * 24 * 2 * 64 * 2


def test_cpu_kv_cache_holds_the_rollout_within_a_quarter_of_free_memory():
    per_token, max_len = 46_080, 1024
    one = per_token * max_len
    assert cpu_kv_cache_bytes(per_token, max_len, 64, memory_gib=20) == 64 * one  # 2.8 GiB < 5 GiB
    assert cpu_kv_cache_bytes(per_token, max_len, 1024, memory_gib=20) == 5 * 2**30  # capped
    assert cpu_kv_cache_bytes(per_token, max_len, None, memory_gib=4) == 2**30  # no rollout size: the cap
    assert cpu_kv_cache_bytes(per_token, max_len, 1, memory_gib=20) == 2 * one  # two sequences at least
    assert cpu_kv_cache_bytes(per_token, max_len, 1024, memory_gib=0.01) == 2 * one


def test_make_engine_picks_the_engine(model_path, monkeypatch):
    pytest.importorskip("vllm")
    built = []
    # a stand-in, so that this test does not start a second vLLM engine
    monkeypatch.setattr("vllm_engine.VLLMEngine", lambda path, **kw: built.append((path, kw)) or "vllm engine")
    assert make_engine("auto", model_path, max_model_len=MAX_LEN) == "vllm engine"
    assert built == [(model_path, {"max_model_len": MAX_LEN, "verbose": False})]
    assert isinstance(make_engine("hf", model_path, max_model_len=MAX_LEN, gpu_memory_utilization=0.3), HFEngine)
    monkeypatch.setitem(sys.modules, "vllm", None)  # now `import vllm` fails
    assert isinstance(make_engine("auto", model_path, max_model_len=MAX_LEN), HFEngine)


def test_make_engine_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        make_engine("sglang", str(tmp_path), max_model_len=MAX_LEN)
    missing = str(tmp_path / "no_such_model")
    for kind in ("vllm", "hf"):
        with pytest.raises(FileNotFoundError, match="no_such_model"):
            make_engine(kind, missing, max_model_len=MAX_LEN)


def test_stop_tokens_stop_strings_and_per_prompt_budgets_end_the_same_samples_early(engine, model_path):
    """With a stop token, a stop string over two tokens and one budget per prompt, each response is
    the free-running one (same seed) cut just after the first of them; only the budget truncates."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    n, seeds, budgets = 6, [3, 4, 5], [5, 9, 14]
    free = engine.generate(PROMPTS, n=n, temperature=1.0, max_new_tokens=14, seeds=seeds)
    stop_id, stop = tok.convert_tokens_to_ids("7"), ["4 5", "6 6", "3 3"]
    has_stop = lambda ids: any(s in tok.decode(ids) for s in stop)  # noqa: E731
    out = engine.generate(
        PROMPTS, n=n, temperature=1.0, max_new_tokens=budgets, seeds=seeds, stop_token_ids=[stop_id], stop=stop
    )
    expected, truncated = [], []
    for k, ids in enumerate(free.response_ids):
        budget = budgets[k // n]
        for j in range(len(ids)):
            if ids[j] in (EOS, stop_id) or has_stop(ids[: j + 1]) or j + 1 == budget:
                break
        expected.append(ids[: j + 1])
        ended = ids[j] in (EOS, stop_id) or has_stop(ids[: j + 1])
        truncated.append(not ended)
    assert out.response_ids == expected and out.truncated == truncated
    assert out.logprobs == [lp[: len(ids)] for lp, ids in zip(free.logprobs, expected)]
    cut_by = [ids[-1] == stop_id for ids in expected], [has_stop(ids) for ids in expected]
    assert any(cut_by[0]) and any(cut_by[1]) and any(truncated)  # every kind of ending occurs


def test_every_rank_count_gives_each_prompt_the_same_place_and_seed():
    """What 1, 2 and 4 ranks share on any CPU: each prompt of the global batch, its place and its
    sampling seed. (The samples are the same too only where the engine computes a sequence to the
    same bits whatever shares its batch; neither engine promises that: see README.)"""
    from types import SimpleNamespace

    from rollout import sampling_seeds, step_prompts

    rows, args = list(range(40)), SimpleNamespace(prompt_batch_size=8, seed=3)

    def global_batch(step, batch, world):
        prompts, seeds = [], []
        for rank in range(world):
            indices, first = step_prompts(rows, step, batch, args=args, rank=rank, world=world)
            prompts += indices
            seeds += sampling_seeds(args.seed, step, batch * args.prompt_batch_size + first, len(indices))
        return prompts, seeds

    for step in (1, 2, 6):  # 6: the second epoch, in another order
        for batch in (0, 1):  # 1: --filter-groups' next generation batch
            one = global_batch(step, batch, 1)
            assert len(set(one[0])) == 8 and len(set(one[1])) == 8
            assert global_batch(step, batch, 2) == one and global_batch(step, batch, 4) == one
    assert global_batch(1, 0, 1) != global_batch(2, 0, 1)


class RecordingEngine:
    """Answers each prompt with tokens made of its seed and first token, and records every request."""

    def __init__(self):
        self.requests = []

    def generate(self, prompts, *, n, seeds, **sampling):
        from engine import Rollout

        self.requests.append(([list(p) for p in prompts], list(seeds)))
        ids = [[s * n + j, p[0]] for p, s in zip(prompts, seeds) for j in range(n)]
        return Rollout(ids, [[-0.5, -0.5] for _ in ids], [False] * len(ids))

    def wake_up(self):
        pass

    def sleep(self):
        pass


def test_a_tensor_parallel_group_sends_the_same_requests_and_each_rank_keeps_its_part_of_tp_1s():
    """--tensor-parallel-size T: the T ranks of a group run one vLLM engine SPMD, which is right only when
    they send it the same requests (else 1.3 nats off the policy's log-probs). Each group generates its
    share of the global batch, with the seeds of the prompts' global places; each rank then keeps exactly
    the prompts, seeds and samples it has with T = 1."""
    from types import SimpleNamespace

    from rollout import collect_rollout

    rows = [dict(prompt_ids=[100 + i, 7], data_source="x", reward_model=dict(ground_truth="1")) for i in range(40)]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)))
    args = SimpleNamespace(prompt_batch_size=8, group_size=2, seed=3, filter_groups=False, max_gen_batches=1)
    args.__dict__.update(temperature=1.0, top_p=1.0, top_k=-1, engine_logprobs=True, max_response_length=4)
    args.__dict__.update(reward_errors="raise", overlong_buffer_len=0)
    reward = (lambda data_source, solution_str, ground_truth, extra_info=None: 0.0, None)

    def step(world, tp):
        args.tensor_parallel_size = tp
        engines, kept = [RecordingEngine() for _ in range(world)], []
        for rank, engine in enumerate(engines):
            ro = collect_rollout(engine, rows, 2, args=args, rank=rank, world=world, tokenizer=tokenizer, reward=reward,
                                 eos_ids=set(), timing={}, device="cpu")  # fmt: skip
            kept.append((ro.indices, ro.response_ids, ro.logprobs, ro.texts))
        return [e.requests for e in engines], kept

    for world in (2, 4):
        _, alone = step(world, 1)
        for tp in (2, world):
            requests, kept = step(world, tp)
            assert kept == alone  # each rank: the same prompts, seeds (in the response ids) and samples
            for group in range(world // tp):
                same = requests[group * tp : (group + 1) * tp]
                assert all(r == same[0] for r in same)  # one engine, the same requests on all its ranks
                assert len(same[0][0][0]) == args.prompt_batch_size // (world // tp)  # the group's share
