"""policy.py: batches of variable-length sequences and their log-probs, in-process on CPU with the
tiny model (the FSDP2 sharding and weight gathering run in the end-to-end tests)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import policy  # noqa: E402

CPU = torch.device("cpu")


def test_micro_batches_skip_padding_and_give_the_same_log_probs(tmp_path):
    """Each micro-batch is cut to the columns its rows use (and, with micro_batch_tokens, packed by
    length); the log-probs must be those of one forward pass over the whole padded batch."""
    from transformers import AutoModelForCausalLM

    import data_prep
    from models import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", data_prep.TASK_WORDS)).eval()
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
                len(mb) == 1 or len(mb) * policy.window(batch, mb)["input_ids"].shape[1] <= 40 for mb in parts
            )
        got = policy.compute_logprobs(model, batch, micro, max_tokens, temperature=1.0, device=CPU)
        torch.testing.assert_close(got * batch["response_mask"], whole * batch["response_mask"], rtol=0, atol=1e-5)
    view = policy.window(batch, [0, 3])  # prompts of 2 and 5 tokens, responses of 1 and 2
    assert view["input_ids"].shape == (2, 7) and view["responses"].shape == (2, 2)
    # the LM head runs only on the response positions: the same logits as a full forward, sliced
    full = model(
        input_ids=view["input_ids"], attention_mask=view["attention_mask"], position_ids=view["position_ids"]
    ).logits
    torch.testing.assert_close(
        policy.response_logits(model, view, CPU), full[:, view["prompt_width"] - 1 : -1], rtol=0, atol=1e-6
    )


def test_fused_head_gives_the_logits_paths_log_probs_entropy_and_gradients(tmp_path):
    """response_logprobs runs the LM head and the softmax together (the model calls our function in
    place of its head's forward). Against the plain path through the logits: the same values and the
    same gradient for every parameter (the head is tied to the embedding here), to 1e-5; and the
    head's own forward is back afterwards."""
    from transformers import AutoModelForCausalLM

    import data_prep
    from loss import entropy_from_logits, logprobs_from_logits
    from models import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", data_prep.TASK_WORDS))
    assert policy.fusable_head(model) is model.lm_head and model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (4, 9, 6)]
    responses = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (5, 2, 7)]
    view = policy.window(policy.make_batch(prompts, responses, pad_id=0), [0, 1, 2])
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
        torch.testing.assert_close(fused[name], plain[name], atol=1e-5, rtol=0, msg=name)
    assert "forward" not in vars(model.lm_head)  # the head is itself again
