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
