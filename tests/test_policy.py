"""policy.py: batches of variable-length sequences and their log-probs, in-process on CPU with the
tiny model (the FSDP2 sharding and weight gathering run in the end-to-end tests)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import memory  # noqa: E402
import policy  # noqa: E402

CPU = torch.device("cpu")


def test_micro_batches_skip_padding_and_give_the_same_log_probs(tmp_path):
    """Each micro-batch is cut to the columns its rows use (and, with micro_batch_tokens, packed by
    length); the log-probs must be those of one forward pass over the whole padded batch."""
    from transformers import AutoModelForCausalLM

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS)).eval()
    g = torch.Generator().manual_seed(0)
    lens = [(2, 1), (9, 7), (3, 12), (5, 2), (9, 12), (4, 6), (2, 3)]  # (prompt, response) lengths
    prompts = [torch.randint(3, 20, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(3, 20, (r,), generator=g).tolist() for _, r in lens]
    batch = policy.make_batch(prompts, responses, pad_id=0)
    whole = policy.compute_logprobs(model, batch, micro=len(lens), max_tokens=0, temperature=1.0, device=CPU)
    assert whole.shape == (7, 12)
    for micro, max_tokens in ((2, 0), (1, 0), (99, 40)):
        parts = policy.micro_batches(batch, list(range(7)), micro, max_tokens)
        assert sorted(sum(parts, [])) == list(range(7))
        if max_tokens:  # packed by length: each micro-batch's padded size stays under the budget
            assert len(parts) > 1 and all(
                len(mb) == 1 or len(mb) * policy.micro_batch(batch, mb)["input_ids"].shape[1] <= 40 for mb in parts
            )
        got = policy.compute_logprobs(model, batch, micro=micro, max_tokens=max_tokens, temperature=1.0, device=CPU)
        torch.testing.assert_close(got * batch["response_mask"], whole * batch["response_mask"], rtol=0, atol=1e-5)
    view = policy.micro_batch(batch, [0, 3])  # prompts of 2 and 5 tokens, responses of 1 and 2
    assert view["input_ids"].shape == (2, 7) and view["responses"].shape == (2, 2)
    # the LM head runs only on the response positions: the same logits as a full forward, sliced
    full = model(
        input_ids=view["input_ids"], attention_mask=view["attention_mask"], position_ids=view["position_ids"]
    ).logits
    torch.testing.assert_close(
        policy.response_logits(model, view, CPU), full[:, view["prompt_width"] - 1 : -1], rtol=0, atol=1e-6
    )


def close_in_fp32(got, want, name):
    """Gradients summed from many terms in fp32 (the embedding's reach 43 here): equal to 1e-5 of the
    largest entry, or 1e-5 where all are below 1."""
    tolerance = 1e-5 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tolerance, (name, (got - want).abs().max().item(), tolerance)


@pytest.fixture
def fuse_small_heads(monkeypatch):
    """The fused head on the tiny model's 20-row head too (by default a vocabulary that small takes the plain path)."""
    monkeypatch.setattr(policy, "FUSED_HEAD_MIN_VOCAB", 0)


def test_a_small_vocabulary_takes_the_plain_path_and_a_real_one_the_fused_head():
    """fusable_head: None under FUSED_HEAD_MIN_VOCAB rows (the demo's 20: the logits are small and the plain path is
    faster there, benchmarks/head_crossover.py), the head itself from there on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for vocab, fused in ((20, False), (policy.FUSED_HEAD_MIN_VOCAB - 1, False), (policy.FUSED_HEAD_MIN_VOCAB, True)):
        config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        model = LlamaForCausalLM(config)
        assert (policy.fusable_head(model) is model.lm_head) == fused, vocab


@pytest.mark.usefixtures("fuse_small_heads")
@pytest.mark.parametrize("tied", [True, False])
def test_fused_head_gives_the_logits_paths_log_probs_entropy_and_gradients(tmp_path, tied):
    """response_logprobs runs the LM head and the softmax together (the model calls our function in
    place of its head's forward). Against the plain path through the logits: the same values and the
    same gradient for every parameter, with the head tied to the embedding and with a head of its
    own, to 1e-5 (gradients: 1e-5 of their largest entry, if above 1); and the head's own forward is
    back afterwards."""
    from transformers import AutoModelForCausalLM

    from logprobs import entropy_from_logits, logprobs_from_logits
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    assert policy.fusable_head(model) is model.lm_head and model.lm_head.weight is model.model.embed_tokens.weight
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(
            model.lm_head.weight.detach() + 0.1 * torch.randn_like(model.lm_head.weight)
        )
        model.config.tie_word_embeddings = False
        assert policy.fusable_head(model) is model.lm_head
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (4, 9, 6)]
    responses = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (5, 2, 7)]
    view = policy.micro_batch(policy.make_batch(prompts, responses, pad_id=0), [0, 1, 2])
    mask = view["response_mask"]
    weights = torch.randn(mask.shape, generator=g)

    def grads(logp, entropy):
        model.zero_grad()
        (((logp * weights + 0.1 * entropy) * mask).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    logp, entropy = policy.response_logprobs(model, view, CPU, temperature=0.8, entropy_grad=True)
    fused = grads(logp, entropy)
    logits = policy.response_logits(model, view, CPU)
    logp_ref = logprobs_from_logits(logits, view["responses"], 0.8)
    entropy_ref = entropy_from_logits(logits / 0.8)  # of the sampling distribution, as verl's actor logs it
    plain = grads(logp_ref, entropy_ref)
    torch.testing.assert_close(logp * mask, logp_ref * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy * mask, entropy_ref * mask, atol=1e-5, rtol=0)
    for name in plain:
        close_in_fp32(fused[name], plain[name], name)
    assert "forward" not in vars(model.lm_head)  # the head is itself again
    # the old and reference log-probs compute no entropy: the fused head, then the logits path (a
    # head with a bias is not fused)
    with torch.no_grad():
        for _ in ("fused", "logits"):
            logp_only, none = policy.response_logprobs(model, view, CPU, 0.8, entropy=False)
            assert none is None
            torch.testing.assert_close(logp_only * mask, logp_ref.detach() * mask, atol=1e-5, rtol=0)
            model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
        assert policy.fusable_head(model) is None


@pytest.mark.usefixtures("fuse_small_heads")
def test_shared_prompts_give_the_full_sequences_log_probs_entropy_and_gradients(tmp_path):
    """With shared prompts (make_batch(group=n)) each group's prompt runs once, the n responses on
    top of its KV cache. Against one forward per full sequence: the same log-probs, entropies and
    gradients for every parameter (through the cache, too) to 1e-5, with prompts of different
    lengths (left padding), responses of different lengths (right padding), a micro-batch of whole
    groups cut by size and by tokens, one-token responses, the fused head and the logits path."""
    from transformers import AutoModelForCausalLM

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    g = torch.Generator().manual_seed(2)
    n, prompt_lens = 3, (4, 9, 2, 6)
    prompts = [p for p in (torch.randint(3, 20, (k,), generator=g).tolist() for k in prompt_lens) for _ in range(n)]
    resp_lens = [5, 1, 8, 2, 2, 3, 7, 1, 4, 1, 6, 6]
    responses = [torch.randint(3, 20, (r,), generator=g).tolist() for r in resp_lens]
    plain, shared = policy.make_batch(prompts, responses, 0), policy.make_batch(prompts, responses, 0, group=n)
    weights = torch.randn(plain["response_mask"].shape, generator=g)

    def run(batch, rows, fused=True):
        view, mask = policy.micro_batch(batch, rows), batch["response_mask"][rows][:, : max(resp_lens[i] for i in rows)]
        head = model.lm_head.forward
        if not fused:  # a head we cannot fuse takes the logits path
            model.lm_head.forward = lambda h: torch.nn.functional.linear(h, model.lm_head.weight)
        try:
            model.zero_grad()
            logp, entropy = policy.response_logprobs(model, view, CPU, temperature=0.7, entropy_grad=True)
        finally:
            model.lm_head.forward = head
        (((logp * weights[rows, : logp.shape[1]] + 0.1 * entropy) * mask).sum()).backward()
        return logp * mask, entropy * mask, {k: p.grad.clone() for k, p in model.named_parameters()}

    for rows in ([0, 1, 2], [3, 4, 5, 6, 7, 8], list(range(12)), [9, 10, 11]):
        for fused in (True, False):
            want, got = run(plain, rows, fused), run(shared, rows, fused)
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
            for name in want[2]:
                torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=0, msg=name)
    one = policy.micro_batch(policy.make_batch(prompts[:n], [[5]] * n, 0, group=n), [0, 1, 2])  # r = 1: one forward
    torch.testing.assert_close(
        policy.response_logprobs(model, one, CPU, 1.0)[0],
        policy.response_logprobs(
            model, policy.micro_batch(policy.make_batch(prompts[:n], [[5]] * n, 0), [0, 1, 2]), CPU, 1.0
        )[0],
    )
    # micro-batches hold whole groups: by size (at least one group), and by tokens (a prompt per group)
    rows = list(range(12))
    assert policy.micro_batches(shared, rows, 4, 0) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert policy.micro_batches(shared, rows, 6, 0) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert policy.micro_batches(shared, rows, 2, 0) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    packed = policy.micro_batches(shared, rows, 99, 40)
    assert sorted(sum(packed, [])) == rows and all(len(mb) % n == 0 and mb[0] % n == 0 for mb in packed)
    for mb in packed:
        view = policy.micro_batch(shared, mb)
        cost = len(mb) // n * view["prompt_width"] + len(mb) * view["responses"].shape[1]
        assert len(mb) == n or cost <= 40
    got = policy.compute_logprobs(model, shared, micro=99, max_tokens=40, temperature=1.0, device=CPU)
    want = policy.compute_logprobs(model, plain, micro=99, max_tokens=40, temperature=1.0, device=CPU)
    torch.testing.assert_close(got * plain["response_mask"], want * plain["response_mask"], atol=1e-5, rtol=0)
    import pytest

    with pytest.raises(ValueError, match="not one group of 3"):
        policy.make_batch(prompts[1:], responses[1:], 0, group=n)
    with pytest.raises(ValueError, match="whole groups of 3"):
        policy.micro_batches(shared, [1, 2, 3], 4, 0)


def fused_head_on_two_ranks(rank, port, model_dir, tied, results):
    """One rank of test_fused_head_under_fsdp2: the model sharded over 2 gloo ranks, each rank's own
    half of the batch through the fused head, the loss summed over both (FSDP2 averages gradients over
    ranks, so each rank's loss is scaled by 2); returns the full gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from distributed import full_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if not tied:
        untie(model)
    policy.shard(model, init_device_mesh("cpu", (2,)))
    policy.FUSED_HEAD_MIN_VOCAB = 0  # the tiny model's 20-row head too (this process's own policy module)
    assert policy.fusable_head(model) is not None
    view, weights = grad_case(rows=[[0, 1], [2, 3]][rank])
    logp, entropy = policy.response_logprobs(model, view, CPU, temperature=0.8, entropy_grad=True)
    (2 * ((logp * weights + 0.1 * entropy) * view["response_mask"]).sum()).backward()
    results[rank] = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    dist.destroy_process_group()


def untie(model):
    g = torch.Generator().manual_seed(2)
    noise = 0.1 * torch.randn(model.lm_head.weight.shape, generator=g)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + noise)
    model.config.tie_word_embeddings = False


def grad_case(rows):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (4, 9, 6, 3)]
    responses = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (5, 2, 7, 4)]
    batch = policy.make_batch(prompts, responses, pad_id=0)
    weights = torch.randn(batch["response_mask"].shape, generator=g)
    view = policy.micro_batch(batch, rows)
    return view, weights[rows, : view["response_mask"].shape[1]]


@pytest.mark.parametrize("tied", [True, False])
def test_fused_head_under_fsdp2_gives_the_unsharded_logits_paths_gradients(tmp_path, tied):
    """The fused head with the model sharded by FSDP2 over 2 ranks (the head's weight is gathered when
    the model calls our function), tied to the embedding and untied: the gradients of every
    parameter equal those of the unsharded model through the logits on the whole batch, to 1e-5 of
    their largest entry."""
    import socket

    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from logprobs import entropy_from_logits, logprobs_from_logits
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model_dir = build_tiny_model(tmp_path / "m", TASK_WORDS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(fused_head_on_two_ranks, args=(port, str(model_dir), tied, results), nprocs=2, join=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if not tied:
        untie(model)
    view, weights = grad_case(rows=[0, 1, 2, 3])
    logits = policy.response_logits(model, view, CPU)
    logp, entropy = logprobs_from_logits(logits, view["responses"], 0.8), entropy_from_logits(logits / 0.8)
    ((logp * weights + 0.1 * entropy) * view["response_mask"]).sum().backward()
    assert ("lm_head.weight" in results[0]) == (not tied)
    for name, param in model.named_parameters():
        for rank in (0, 1):
            close_in_fp32(results[rank][name], param.grad, name)


def test_activation_memory_per_token_predicts_a_micro_batch(tmp_path):
    """activation_gib_per_token, measured on one sequence, times a micro-batch's tokens: the bytes
    autograd holds for that micro-batch's backward (4 sequences of 20 prompt + 30 response tokens,
    measured directly), to 10%."""
    from transformers import AutoModelForCausalLM

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    per_token = memory.activation_gib_per_token(model, CPU, length=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (20,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 20, (30,), generator=g).tolist() for _ in range(4)]
    view = policy.micro_batch(policy.make_batch(prompts, responses, pad_id=0), [0, 1, 2, 3])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy.response_logprobs(model, view, CPU, 1.0)
    held = sum(storages.values()) / 2**30
    assert abs(per_token * 4 * 50 - held) <= 0.1 * held, (per_token * 200, held)


def lora_checkpointed(path, seed=0):
    """The tiny model as --lora-rank 4 --grad-checkpointing make it (policy.load_policy, without FSDP2), its
    adapters' B nonzero, so that they change the numbers, and in train mode (where checkpointing acts)."""
    import lora

    torch.manual_seed(seed)  # the adapters' A, drawn as PEFT adds them
    model = policy.load_model(path, torch.float32, CPU)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = lora.add_adapters(model, 4, 32.0, "all-linear", 0.0).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def forward_backward(model, shape, seed):
    """Logits with the adapters, their grads, and the reference's (adapters off, no grad) logits."""
    import lora

    ids = torch.randint(3, 12, shape, generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    with torch.no_grad(), lora.reference_mode(model):
        reference = model(input_ids=ids).logits
    return [logits.detach(), reference, *grads]


@pytest.mark.slow
def test_compiled_blocks_give_the_numbers_and_compile_once_for_any_length(tmp_path):
    """--compile-blocks with LoRA (PEFT's Linears inside the compiled MLPs) and --grad-checkpointing (the
    compiled parts run again in the backward), and the reference with the adapters off: the same logits and
    gradients as uncompiled, and no new graph as the rows and lengths change (dynamic=True: one graph per
    part and grad mode, not one per length). About 60 s cold on a busy 2-core CPU, 20 s with inductor's
    cache of an earlier run."""
    from torch._dynamo.utils import counters

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    path = build_tiny_model(tmp_path / "m", TASK_WORDS)
    plain, compiled = lora_checkpointed(path), policy.compile_blocks(lora_checkpointed(path))
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for i, shape in enumerate([(4, 20), (4, 23), (6, 31), (3, 17)]):
        for got, want in zip(forward_backward(compiled, shape, i), forward_backward(plain, shape, i)):
            # inductor fuses and reorders fp32 sums: measured at most 1.3e-6 of the largest entry here, against
            # close_in_fp32's 1e-5; a dropped term or another adapter's weights are off by 1e-2 or more
            close_in_fp32(got, want, f"shape {shape}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1:] == [graphs[0]] * 3, f"recompiled for new shapes: graphs after each shape {graphs}"


def test_a_block_whose_compile_fails_runs_uncompiled_and_says_so_once(tmp_path, monkeypatch, capsys):
    """No C++ compiler on a CPU, no Triton on a GPU: the first call's failure is said once for all the
    layers, and the parts run uncompiled with the same numbers, exactly."""
    from transformers import AutoModelForCausalLM

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    path = build_tiny_model(tmp_path / "m", TASK_WORDS)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("InductorError: CppCompileError: C++ compile error")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    plain = AutoModelForCausalLM.from_pretrained(path)
    compiled = policy.compile_blocks(AutoModelForCausalLM.from_pretrained(path))
    ids = torch.randint(3, 12, (3, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        want = plain(input_ids=ids).logits
        got = compiled(input_ids=ids).logits
        assert torch.equal(got, want)
        got.sum().backward()
    err = capsys.readouterr().err
    assert err.count("torch.compile of --compile-blocks' MLPs and norms failed") == 1 and "CppCompileError" in err
    assert len(calls) == 1, "each layer tried to compile again after the first failure"


def test_compile_blocks_names_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="has no decoder layer with mlp, input_layernorm"):
        policy.compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
