"""The policy on the trainer's side: batches of variable-length sequences, the per-token log-probs of the
sampled responses, loading and FSDP2 sharding, and getting the full weights out (to the engine, to disk).

A batch lays each sequence out as [pad.. prompt | response ..pad]: prompts left-padded, responses right-padded,
so that response token t of every row sits in the same column. A micro-batch is cut to the columns its rows
use, and the LM head runs on the response positions only. response_logprobs reads as its formula; below it,
two faster forms of the same numbers, each one call: shared prompts (a GRPO group's prompt runs once, its n
responses on its KV cache) and, for a real vocabulary, the fused head (never the [b, r, V] logits).
"""

import torch

import export
import lora
import safe_write
from distributed import full_tensor
from logprobs import compiled_or_not, entropy_from_logits, head_logprobs_entropy, logprobs_from_logits
from model_dir import load_checked

# ----------------------------------------------------------------------------------------------
# Batches: prompts left-padded, responses right-padded, so response tokens line up in columns


def make_batch(prompts, responses, pad_id, group=1, model_mask=None):
    """Token id lists -> tensors. input_ids = [pad.. prompt | response ..pad]: [N, P + R].
    The logits that predict response token t sit at column P - 1 + t. With group = n > 1, every n
    consecutive rows share one prompt (a GRPO group, prompt-major): the policy then runs that prompt
    once for the group, not once per response (shared_prompt_forward). model_mask (multi-turn: one 0/1
    list per response) leaves response_mask 1 on the model's own tokens only."""
    P, R = max(map(len, prompts)), max(max(map(len, responses)), 1)
    n = len(prompts)
    if group > 1:
        for g in range(0, n, group):
            if len(prompts[g : g + group]) != group or any(p != prompts[g] for p in prompts[g : g + group]):
                raise ValueError(f"make_batch: rows {g}..{g + group - 1} are not one group of {group} with one prompt")
    input_ids = torch.full((n, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p) : P] = torch.tensor(p)
        input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, P - len(p) : P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, P:].float()
    for i, m in enumerate(model_mask or []):  # the tools' and the chat template's tokens are not the policy's
        response_mask[i, : len(m)] *= torch.tensor(m, dtype=torch.float)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, P:],
        response_mask=response_mask,
        prompt_width=P,
        prompt_lens=[len(p) for p in prompts],
        response_lens=[max(len(r), 1) for r in responses],
        group=group,
    )


def micro_batches(batch, rows, size, max_tokens=0):
    """Split the sequences `rows` (indices into the batch) into micro-batches' rows: `size` at a time, or,
    with max_tokens > 0, sorted by length and packed while the padded tokens computed stay <=
    max_tokens. With shared prompts (batch["group"] = n > 1) a group's rows stay together: a
    micro-batch holds whole groups (at least one, even when n > size), and costs a prompt per group
    plus a response per row."""
    n = batch.get("group", 1)
    if n > 1 and (
        len(rows) % n or any(rows[i] % n or rows[i + n - 1] != rows[i] + n - 1 for i in range(0, len(rows), n))
    ):
        raise ValueError(f"micro_batches: rows must be whole groups of {n} with shared prompts")
    units = [rows[i : i + n] for i in range(0, len(rows), n)]  # one group each, or one row
    if max_tokens <= 0:
        k = max(1, size // n)
        return [sum(units[i : i + k], []) for i in range(0, len(units), k)]
    p, r = batch["prompt_lens"], batch["response_lens"]
    out, cur, p_max, r_max = [], [], 0, 0
    for unit in sorted(units, key=lambda u: p[u[0]] + max(r[i] for i in u)):
        p_new, r_new = max(p_max, p[unit[0]]), max([r_max] + [r[i] for i in unit])
        if cur and (len(cur) // n + 1) * p_new + (len(cur) + n) * r_new > max_tokens:
            out.append(cur)
            cur, p_new, r_new = [], p[unit[0]], max(r[i] for i in unit)
        cur += unit
        p_max, r_max = p_new, r_new
    return out + [cur]


def micro_batch(batch, rows):
    """The micro-batch of a batch's `rows`: their tensors, cut to the columns they use (the padding every one
    of them has left of the prompts and right of the responses is never computed on). Response tensors
    [b, r]; prompt_width: the prompts' columns p; group: the batch's (micro_batches keeps groups whole)."""
    p, r, P = (
        max(batch["prompt_lens"][i] for i in rows),
        max(batch["response_lens"][i] for i in rows),
        batch["prompt_width"],
    )
    cols = slice(P - p, P + r)
    mb = {k: batch[k][rows, cols] for k in ("input_ids", "attention_mask", "position_ids")}
    mb.update(responses=batch["responses"][rows, :r], response_mask=batch["response_mask"][rows, :r], prompt_width=p)
    for k in PER_TOKEN:  # what the trainer added to the batch: the loss's inputs, [N, R] each
        if batch.get(k) is not None:
            mb[k] = batch[k][rows, :r]
    mb["group"] = batch.get("group", 1)
    return mb


PER_TOKEN = ("advantages", "old_logp", "ref_logp", "engine_logp", "teacher_logp")  # [N, R] tensors a batch may carry
PER_TOKEN += ("teacher_topk_logp", "teacher_topk_ids")  # [N, R, K]: forward_kl_topk's teacher (distill.py)

# ----------------------------------------------------------------------------------------------
# Per-token log-probs of the sampled responses


def response_logprobs(model, mb, device, temperature, entropy_grad=False, entropy=True, extra_ids=None):
    """Per-token log-probs of a micro-batch's response tokens and the entropies there, ([b, r], [b, r]) fp32. With
    z the model's logits at the positions that predict the response tokens and T the temperature, they are

        logp = log_softmax(z / T).gather(-1, responses)    entropy = -(softmax(z / T) * log_softmax(z / T)).sum(-1)

    the sampling distribution's, as verl's actor computes them (logprobs.py). entropy=False skips the entropy
    (None), as the old and reference log-probs need; it carries a gradient only with entropy_grad (the loss's
    entropy bonus), otherwise it is logged only. extra_ids [b, r, K] (forward_kl_topk's teacher ids): the
    log-probs are [b, r, 1 + K], the ids' after the sampled token's."""
    if fusable_head(model) is not None:  # a real vocabulary: the same numbers without the [b, r, V] logits
        return fused_response_logprobs(model, mb, device, temperature, entropy_grad, entropy, extra_ids)
    labels = mb["responses"].to(device)  # [b, r]
    logits = response_logits(model, mb, device)  # [b, r, V]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = entropy_from_logits(logits, temperature=temperature) if entropy else None
    ids = labels if extra_ids is None else torch.cat([labels[..., None], extra_ids.to(device)], -1)
    return logprobs_from_logits(logits, ids, temperature), ent


def response_logits(model, mb, device):
    """The logits that predict each response token of a micro-batch: [b, r, V]."""
    return combine_head_outputs([out.logits for out in forward_responses(model, mb, device)], mb)


def forward_responses(model, mb, device):
    """Runs the model on a micro-batch so that its LM head sees every position whose output predicts a response
    token: one forward, the head on the last r + 1 positions only (with a real vocabulary, logits on the prompt
    would be a large share of the FLOPs and the memory). Returns the model's outputs in a list (the head's are
    their .logits); combine_head_outputs puts them in order. With shared prompts, shared_prompt_forward."""
    if mb.get("group", 1) > 1:  # each prompt once for its group, the n responses on its KV cache
        return shared_prompt_forward(model, mb, device)
    ids, mask, pos = (mb[k].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
    r = mb["responses"].shape[1]
    return [model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=r + 1)]


def combine_head_outputs(pieces, mb):
    """The LM head's outputs from forward_responses -> [b, r, ...]: position t predicts response token t."""
    n = mb.get("group", 1)
    if n == 1:
        return pieces[0][:, :-1]  # [b, r + 1] -> [b, r]
    first = pieces[0].repeat_interleave(n, 0)  # each prompt's last position, once per response
    return torch.cat([first] + pieces[1:], 1)


@torch.no_grad()
def compute_logprobs(model, batch, *, micro, max_tokens, temperature, device):
    """Per-token log-probs of the responses under `model`, micro-batch by micro-batch: [N, R]."""
    out = torch.zeros_like(batch["response_mask"])
    for rows in micro_batches(batch, list(range(out.shape[0])), micro, max_tokens):
        logp, _ = response_logprobs(model, micro_batch(batch, rows), device, temperature, entropy=False)
        out[rows, : logp.shape[1]] = logp.float().cpu()
    reshard(model)
    return out


def reference_logprobs(policy, reference, batch, **how):
    """compute_logprobs (with its keywords, `how`) under the KL reference: the frozen copy, or with
    LoRA (reference None) the policy's base. distill.py's teacher is scored the same way."""
    if reference is not None:
        return compute_logprobs(reference, batch, **how)
    with lora.reference_mode(policy):
        return compute_logprobs(policy, batch, **how)


# ----------------------------------------------------------------------------------------------
# The same numbers, faster: shared prompts and the fused head (a reader can skip this part)


def shared_prompt_forward(model, mb, device):
    """forward_responses for a micro-batch of whole GRPO groups (mb["group"] = n > 1, every n rows one prompt):
    two forwards, each group's prompt once, keeping its KV cache (the head on its last position only), then the
    group's n responses on top of that cache, repeated n times. The gradient reaches the prompt's activations
    through the cache, so the log-probs and their gradients are those of n full sequences, minus n - 1 prompt
    passes (tests/test_policy.py::test_shared_prompts_give_the_full_sequences_log_probs_entropy_and_gradients)."""
    ids, mask, pos = (mb[k].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
    n, p, r = mb["group"], mb["prompt_width"], mb["responses"].shape[1]
    kw = dict(use_cache=True)
    first = model(
        input_ids=ids[::n, :p], attention_mask=mask[::n, :p], position_ids=pos[::n, :p], logits_to_keep=1, **kw
    )
    cache = first.past_key_values
    if cache is None or cache.get_seq_length() != p:  # e.g. gradient checkpointing drops the cache
        raise RuntimeError(f"{type(model).__name__} returned no KV cache of the prompts: run without shared prompts")
    if r == 1:  # the prompts' last positions predict the only response token
        return [first]
    cache.batch_repeat_interleave(n)  # [G, ...] -> [G * n, ...], one copy per response
    cols = slice(p, p + r - 1)  # response tokens 0 .. r - 2 predict tokens 1 .. r - 1
    second = model(
        input_ids=ids[:, cols],
        attention_mask=mask[:, : p + r - 1],
        position_ids=pos[:, cols],
        past_key_values=cache,
        **kw,
    )
    if cache.get_seq_length() != p + r - 1:
        raise RuntimeError(f"{type(model).__name__} did not attend to the cached prompts: run without shared prompts")
    return [first, second]


FUSED_HEAD_MIN_VOCAB = 1024  # below it the logits are small, the plain path faster: benchmarks/head_crossover.py


def fusable_head(model):
    """The LM head, if the fused head runs in its place: a plain linear layer whose logits the model uses as they
    are (no bias, no soft-capping, not wrapped by LoRA) with at least FUSED_HEAD_MIN_VOCAB rows; else None."""
    head = model.get_output_embeddings()
    plain = type(head) is torch.nn.Linear and head.bias is None and head.out_features >= FUSED_HEAD_MIN_VOCAB
    return head if plain and not getattr(model.config, "final_logit_softcapping", None) else None


def fused_response_logprobs(model, mb, device, temperature, entropy_grad=False, entropy=True, extra_ids=None):
    """response_logprobs' numbers for a model with a fusable_head, without the [b, r, V] logits: the model calls
    logprobs.head_logprobs_entropy in place of its LM head's forward (run_head), which computes
    log_softmax(h W^T / T) at the labels and the entropy a block of tokens x vocabulary entries at a time. Equal
    in value and gradient (tests/test_policy.py::test_fused_head_gives_the_logits_paths_log_probs_entropy_and_gradients)."""
    labels, extra = mb["responses"].to(device), None if extra_ids is None else extra_ids.to(device)
    fused = lambda h, w: head_logprobs_entropy(h, w, labels, temperature, entropy=entropy, extra_ids=extra)  # noqa: E731
    logp, ent = run_head(model, mb, device, fused)
    return logp, ent if entropy_grad or ent is None else ent.detach()


def run_head(model, mb, device, head_fn):
    """Runs the model on a micro-batch (forward_responses), its plain LM head (fusable_head) replaced by head_fn(
    hidden [b, r, H], weight [V, H]): called once, where FSDP2 has gathered the weight, with every response
    position's hidden states (shared prompts: the first forward's and the second's). Returns what head_fn returned."""
    head, hidden, out = fusable_head(model), [], []
    calls = 1 if mb.get("group", 1) == 1 or mb["responses"].shape[1] == 1 else 2  # forward_responses' calls

    def fused(h):  # the hidden states the head sees; the last call has them all
        hidden.append(h)
        if len(hidden) == calls:
            out.append(head_fn(combine_head_outputs(hidden, mb), head.weight))  # [b, r, H]
        return h[..., :1]  # what the model returns as its "logits"; unused

    head.forward = fused
    try:
        forward_responses(model, mb, device)
    finally:
        del head.forward  # the class's forward again
    return out[0]


# ----------------------------------------------------------------------------------------------
# Model setup


def native_bf16(device):
    """Whether `device` multiplies bf16 matrices in hardware: CUDA, or a CPU with avx512_bf16 or AMX
    (elsewhere torch emulates bf16 matmuls on CPU, tens of times slower than fp32)."""
    if device.type == "cuda":
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def compute_dtype(choice, device):
    """--dtype -> (torch dtype, why): bf16 or fp32 as asked; auto picks bf16 where the device does bf16
    matmuls natively (native_bf16), fp32 elsewhere."""
    if choice == "bf16":
        why = "--dtype bf16" + (
            "" if native_bf16(device) else "; this CPU has no native bf16, so it is emulated and slow"
        )
        return torch.bfloat16, why
    if choice == "fp32":
        return torch.float32, "--dtype fp32" + (
            "; this device does bf16 natively: --dtype auto" if native_bf16(device) else ""
        )
    if device.type == "cuda":
        return torch.bfloat16, "--dtype auto on CUDA"
    if native_bf16(device):
        return torch.bfloat16, "--dtype auto on a CPU with native bf16 matmuls"
    return torch.float32, "--dtype auto on a CPU without native bf16 matmuls (no avx512_bf16 or AMX)"


def load_model(path, dtype, device):
    """The causal LM in `path` on `device`. Never runs Python code from the model directory
    (trust_remote_code=False): model_dir.check_model_path refuses a directory that needs it."""
    from transformers import AutoModelForCausalLM

    model = load_checked(AutoModelForCausalLM, path, dtype=dtype)  # refused if the weights lack a parameter
    return model.to(device)


def shard(model, mesh, dtype=torch.float32, offload=False):
    """FSDP2: shard each transformer block, then the rest (embeddings, final norm, head). The
    parameters stay as loaded (fp32 master weights); with dtype bf16 FSDP2 casts them to bf16 as it
    gathers them for the forward and backward, and reduces gradients in fp32 (mixed precision, the
    same on CPU and GPU). offload=True (--offload params, CUDA only): the shards and their gradients
    live in pinned CPU memory, and FSDP2 copies each block to the GPU as it gathers it. With one rank
    on the CPU the gathered weights stay from forward to backward (reshard)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == torch.bfloat16
        else MixedPrecisionPolicy()
    )
    how = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    one_cpu_rank = mesh.size() == 1 and mesh.device_type == "cpu"  # keep the gathered weights (reshard)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, reshard_after_forward=not one_cpu_rank, **how)
    fully_shard(model, **how)  # the root (embeddings, head) is never resharded after forward: FSDP2's default
    return model


def reshard(model):
    """Free FSDP2's gathered copies of the weights. FSDP2 keeps the root's (embeddings, head) from a
    forward to the backward, which reshards them, and shard() keeps every block's so with one rank on the
    CPU (where gathering again for the shared prompts' second forward and the backward cost 4-6% of an
    fp32 update; on one H100 it cost nothing measurable, and keeping them 0.67 GiB at the peak for
    Qwen2.5-0.5B: BENCHMARKS.md). A forward without a backward (compute_logprobs) calls this itself:
    else an optimizer step would leave the next forward the gathered copy of the old weights, and the
    engine would wake without that memory."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_parameters(model, dtype):
    """Yields (hf_name, full tensor) one parameter at a time: each rank all-gathers its shards, so
    the extra memory is one parameter, not a second model. With LoRA: the merged weights."""
    if hasattr(model, "peft_config"):  # a PEFT model: LoRA (lora.is_lora)
        yield from lora.merged_parameters(model, dtype)
        return
    for name, param in model.named_parameters():
        yield name, full_tensor(param).detach().to(dtype)


def save_hf(model, tokenizer, out_dir, rank, step=None, dtype=torch.float32):
    """Gather the full state dict to rank 0's CPU and write it in Hugging Face format, its weights in
    `dtype` (the run's compute dtype; config.json says which) (with LoRA,
    the base with the adapters merged in: no PEFT needed to load it), with `step` in grpo_step.json
    (export.final_model_problem reads it). A collective, and so are its failures: weights that
    hold inf or NaN raise safe_write.NonFiniteError on every rank before anything is gathered (each
    rank checks its own shards), and a write that fails on rank 0 (export.write_hf: the path;
    "no space left on device" when the disk is full) raises safe_write.WriteError on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    todo = "Resume from a checkpoint before the divergence with a smaller --lr."
    safe_write.check_finite(model.named_parameters(), out_dir, todo)
    if lora.is_lora(model):
        state = {name: t.cpu() for name, t in full_parameters(model, torch.float32) if rank == 0}
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error = None
    if rank == 0:
        try:
            export.write_hf(state, model.config, model.generation_config, tokenizer, out_dir, step, dtype)
        except Exception as e:  # told to every rank, which would otherwise wait for rank 0 forever
            error = e
    failure = safe_write.first_failure(error)  # and a barrier
    if failure is not None:
        raise failure


def compile_blocks(model):
    """--compile-blocks: each decoder layer's MLP and two RMSNorms, and the final norm, compiled in place by
    torch.compile (their elementwise work fused: the SiLU product and the norms' intermediates are not kept
    for the backward). The parts are found by attribute, as Llama, Qwen2 and SmolLM2 name them; fully_shard's
    hooks stay on the layers, uncompiled. Rows and lengths change every step: dynamic=True makes one graph
    per part and grad mode for all of them (a batch of one row, which torch.compile specializes, makes one
    more), where automatic dynamic shapes compiled each part again at each new dimension that changed.
    Where compiling fails at the first call (no Triton, no C++ compiler), uncompiled (compiled_or_not)."""
    names = ("mlp", "input_layernorm", "post_attention_layernorm")
    layers = [m for m in model.modules() if all(hasattr(m, a) for a in names)]
    if not layers:
        raise ValueError(
            f"--compile-blocks: {type(model).__name__} has no decoder layer with {', '.join(names)} (Llama, Qwen2 "
            "and SmolLM2 have them): run without --compile-blocks"
        )
    parts = [getattr(layer, a) for layer in layers for a in names]
    parts += [m.norm for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]
    failed = []  # one failure is every part's: said once, not tried again per layer
    for part in parts:
        part.forward = compiled_or_not(part.forward, "--compile-blocks' MLPs and norms", failed, dynamic=True)
    return model


def load_policy(path, mesh, device, dtype, grad_checkpointing=False, reference=False, lora_args=None, offload=False,
                compiled=False):  # fmt: skip
    """The policy to train and, if asked, a frozen reference copy (else None), both FSDP2-sharded
    with fp32 master weights, computing in `dtype`, their shards in CPU memory with offload (shard).
    With lora_args (rank, alpha, target modules, dropout) the policy is a PeftModel whose base is
    frozen, and there is no reference copy: the reference is the policy with its adapters off
    (reference_logprobs). compiled: the policy's blocks in part (compile_blocks); the frozen copy,
    which only runs forwards, stays uncompiled."""
    policy = load_model(path, torch.float32, device)
    if grad_checkpointing:  # recompute activations in the backward pass: less memory, more compute
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_args:
        policy = shard(lora.add_adapters(policy, *lora_args), mesh, dtype, offload)
        return compile_blocks(policy) if compiled else policy, None
    policy = shard(policy, mesh, dtype, offload)  # before the reference loads: with offload, the GPU holds one copy
    policy = compile_blocks(policy) if compiled else policy
    return policy, load_frozen(path, mesh, device, dtype, offload) if reference else None


def load_frozen(path, mesh, device, dtype, offload=False):
    """A frozen model that only scores (the KL reference; distill.py's teacher): eval mode, no gradients,
    FSDP2-sharded like the policy, its shards in CPU memory with offload. Its weights are held in `dtype`, not
    as the policy's fp32 masters: in bf16 FSDP2 would cast fp32 weights to the same bf16 ones before each
    forward, so an fp32 copy would hold twice the memory for the same numbers (verl's reference is bf16 too)."""
    frozen = load_model(path, dtype, device).eval().requires_grad_(False)
    return shard(frozen, mesh, dtype, offload)
