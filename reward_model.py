"""A learned reward model: a Hugging Face AutoModelForSequenceClassification with one logit, which
scores a (prompt, response) conversation rendered with the reward model's own tokenizer and chat
template (its vocabulary need not be the policy's). verl's reward_model, TRL's reward model in
reward_funcs.

    --reward-model DIR --reward-model-weight 0.5      # reward = rule reward + 0.5 x the model's score
    --reward-model DIR --reward-model-weight 1 --reward-model-only     # the model's score alone

It is sharded with FSDP2 like the policy, frozen, and runs on every rank in micro-batches over that
rank's samples. Its raw logit is the score: no squashing, so mind its scale against the rule reward.
"""

import os

import torch

from chat_template import bound_chat_template
from model_dir import load_checked
from policy import shard


def check_reward_model(path):
    """Exit with a message naming --reward-model and the file at fault when `path` cannot be a reward
    model: what model_dir.check_model_path refuses for the policy (no config.json, missing or truncated
    weights, no tokenizer, Python code of its own to run), or a config with more than one output.
    Reads only JSON files and safetensors headers: call it before anything loads."""
    from model_dir import check_model_path, read_json

    try:
        check_model_path(path)
        config = read_json(os.path.join(path, "config.json"))  # {} for a hub id
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reward-model: {e}") from None
    if not config:  # load_reward_model checks a hub id's once loaded
        return
    # transformers gives a config without num_labels or id2label two outputs: a causal LM's config, say
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if labels != 1:
        raise SystemExit(
            f"--reward-model {path}: a reward model has one output (num_labels 1), this one has {labels} "
            f"({os.path.join(path, 'config.json')}: architectures {config.get('architectures')}, "
            f"id2label {config.get('id2label')}). Pass a sequence classifier with one label"
        )


def load_reward_model(path, mesh, device, dtype=torch.float32):
    """(FSDP2-sharded frozen model computing in `dtype`, its tokenizer) from a directory saved by
    save_pretrained, after check_reward_model. Never runs code from the directory (trust_remote_code=False).
    Its chat template is code from the directory too: each render stops past a time limit (bound_chat_template)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_reward_model(path)
    try:
        model = load_checked(AutoModelForSequenceClassification, path, dtype=torch.float32)  # a score head, too
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reward-model {path}: cannot load a sequence classification model from it ({e})") from None
    if model.config.num_labels != 1:
        raise SystemExit(
            f"--reward-model {path}: a reward model has one output (num_labels 1), this one has {model.config.num_labels}"
        )
    # We left-pad, so every conversation ends at the last position. transformers reads the score at
    # the rightmost token that is not the pad id; a pad id no token has makes that the last position
    # even when a conversation ends with the pad token itself (pad = eos is common).
    model.config.pad_token_id = -1
    model.requires_grad_(False).eval()
    return shard(model.to(device), mesh, dtype), bound_chat_template(tokenizer)


def render(tokenizer, rows, texts):
    """Token ids of each conversation as the reward model reads it: its chat template with the
    response as the assistant's turn, or, for a tokenizer without one, the texts one per line. A text
    prompt (TRL's standard format, prompt_data.py) is read as prompt + response, with no template and no
    special tokens added, as TRL's GRPOTrainer gives it to a reward model. All at once: the template and
    the tokenizer are several times faster on a batch than one by one."""
    ids = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if isinstance(row["prompt"], str)]
    chats = [i for i, row in enumerate(rows) if not isinstance(row["prompt"], str)]
    if plain:
        strings = [rows[i]["prompt"] + texts[i] for i in plain]
        for i, seq in zip(plain, tokenizer(strings, add_special_tokens=False)["input_ids"]):
            ids[i] = seq
    if chats:
        conversations = [[*rows[i]["prompt"], {"role": "assistant", "content": texts[i]}] for i in chats]
        if tokenizer.chat_template:
            strings = tokenizer.apply_chat_template(conversations, tokenize=False)
        else:
            strings = ["\n".join(m["content"] for m in c) for c in conversations]
        for i, seq in zip(chats, tokenizer(strings, add_special_tokens=not tokenizer.chat_template)["input_ids"]):
            ids[i] = seq
    return ids


@torch.no_grad()
def score(model, tokenizer, rows, texts, micro_batch_size, device):
    """One float per (row, response text): rows are verl-schema rows (their "prompt" messages),
    texts the decoded responses. Every rank calls it with the same number of samples (FSDP2 runs
    the same micro-batches on all ranks). Conversations longer than the model's context keep their end."""
    limit = getattr(model.config, "max_position_embeddings", None) or 10**9
    ids = [seq[-limit:] for seq in render(tokenizer, rows, texts)]
    out = []
    for i in range(0, len(ids), micro_batch_size):
        chunk = ids[i : i + micro_batch_size]
        width = max(map(len, chunk))
        input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, seq in enumerate(chunk):  # left-padded: [pad.. conversation]
            input_ids[j, width - len(seq) :] = torch.tensor(seq)
            mask[j, width - len(seq) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=False,
        ).logits  # [b, 1]
        out.extend(logits[:, 0].float().cpu().tolist())
    return out
