"""support/loss_head.py: train_full.py's forward passes on the kept rollouts, never the [n, T, vocab] logits.

pack                 left-padded prompts, right-padded responses: every response starts at the same column
response_logp        pass 1 (no grad): log-probs and d3s.token_entropy, the LM head in blocks of HEAD_CHUNK
response_logp_at     pass 2 (with grad): log-probs at the tokens in the loss only (D3S's 1/K saving)
micro_batch_rows, forward_no_grad, idle_loss   micro-batches, as many on every rank (FSDP's collectives)
"""

import functools
import math

import torch
import torch.distributed as dist

import d3s
from support.fsdp import all_reduce, reshard


def pack(seqs, rows, pad_id, device):
    """[pad.. prompt | response ..pad]: every response starts at the same column, so logits_to_keep keeps only the
    response positions. Returns (model inputs, response targets [n, T], response mask [n, T])."""
    width_p = max(len(seqs[r]["prompt_ids"]) for r in rows)
    width_r = max(len(seqs[r]["response_ids"]) for r in rows)
    ids = torch.full((len(rows), width_p + width_r), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        prompt, response = seqs[r]["prompt_ids"], seqs[r]["response_ids"]
        ids[i, width_p - len(prompt) : width_p + len(response)] = torch.tensor(prompt + response)
        attn[i, width_p - len(prompt) : width_p + len(response)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # real tokens at 0, 1, 2, ... as without padding
    inputs = {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "position_ids": position_ids.to(device),
        "logits_to_keep": width_r + 1,
        "use_cache": False,
    }
    return inputs, ids[:, width_p:].to(device), attn[:, width_p:].bool().to(device)


HEAD_CHUNK = 1024  # response positions per LM-head block: [1024, vocab] fp32 logits, 0.6 GB at Qwen's 152k vocabulary


def response_hidden(model, inputs):
    """The final (normed) hidden states of the positions that predict the response tokens, [n, T, H].

    The policy runs through the FSDP root (which gathers its parameters) with logits_to_keep=1, and a forward hook
    on the decoder keeps its output."""
    T = inputs["logits_to_keep"] - 1
    captured = []
    hook = model.model.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(**{**inputs, "logits_to_keep": 1})
    finally:
        hook.remove()
    return captured[0][:, -(T + 1) : -1]  # position width_p - 1 + t predicts response token t


def _head_logp(head, hidden, targets, temperature):
    """log pi(target) for [m, H] hidden states: fp32 logits of one block over the sampling temperature (the
    distribution the rollouts came from); returns ([m] log-probs, [m, V] logits)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1), logits


def response_logp(model, inputs, targets, temperature, with_entropy):
    """Pass 1 (no grad): log pi(o_t | ...) [n, T] of every response token, and the entropy H_t, the LM head in
    [HEAD_CHUNK, vocab] fp32 blocks."""
    hidden = response_hidden(model, inputs)  # [n, T, H]
    n, T, H = hidden.shape
    flat, flat_targets = hidden.reshape(n * T, H), targets.reshape(n * T)
    logp = torch.zeros(n * T, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    for start in range(0, n * T, HEAD_CHUNK):
        block = slice(start, start + HEAD_CHUNK)
        logp[block], logits = _head_logp(model.lm_head, flat[block], flat_targets[block], temperature)
        if with_entropy:
            entropy[block] = d3s.token_entropy(logits)
        del logits
    return logp.view(n, T), (entropy.view(n, T) if with_entropy else None)


def response_logp_at(model, inputs, targets, positions, temperature, with_entropy=False):
    """Pass 2 (with grad): log pi of the response tokens at `positions` only, [n, T] (0 elsewhere).

    positions: the tokens in the loss, a bool [n, T] mask or its (rows, cols) index: the top K (5-20%) of a
    token-selecting method (d2s, d3s, d3s-i), so the LM head costs 1/K the memory and FLOPs (D3S's own saving, which
    a full-logits loss throws away); all valid tokens for the others. Blocks of HEAD_CHUNK positions, recomputed in
    backward (torch.utils.checkpoint). Loss and gradients equal the full-logits head's: tokens outside `positions`
    have weight 0 in d3s.policy_loss.

    with_entropy: also d3s.token_entropy at `positions` ([n, T], no grad, 0 elsewhere), once in the forward: the
    entropy metric of the methods without token selection, which need no pass 1 for it."""
    from torch.utils.checkpoint import checkpoint

    hidden = response_hidden(model, inputs)  # [n, T, H]
    index = positions.nonzero(as_tuple=True) if isinstance(positions, torch.Tensor) else positions
    picked, picked_targets = hidden[index], targets[index]  # [m, H], [m]
    logp = torch.zeros(hidden.shape[:2], dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    if picked.shape[0] == 0:  # nothing selected here: a zero that keeps the graph (FSDP's backward hooks) and uses
        # every parameter, an untied lm_head too (one position, weight 0), so every rank reduce-scatters the same
        zero = 0.0 * (hidden.sum() + model.lm_head(hidden[:1, :1]).float().sum())
        return (logp + zero, entropy) if with_entropy else logp + zero
    starts = range(0, picked.shape[0], HEAD_CHUNK)
    block_entropy = [None] * len(starts)

    def block_logp(i, h, y):
        lp, logits = _head_logp(model.lm_head, h, y, temperature)
        if with_entropy and block_entropy[i] is None:  # the forward, not backward's recomputation
            block_entropy[i] = d3s.token_entropy(logits.detach())
        return lp

    blocks = [
        checkpoint(functools.partial(block_logp, i), picked[b], picked_targets[b], use_reentrant=False)
        for i, b in enumerate(slice(s, s + HEAD_CHUNK) for s in starts)
    ]
    logp = logp.index_put(index, torch.cat(blocks))
    return (logp, entropy.index_put(index, torch.cat(block_entropy))) if with_entropy else logp


def micro_batches(lengths, size, n_micro):
    """n_micro lists of row indices (longest first, to pad little); trailing lists may be empty."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    return chunks + [[] for _ in range(n_micro - len(chunks))]


def micro_batch_rows(seqs, rows, size, world, at_least=0):
    """`rows` of seqs in micro-batches of `size` rows (longest first), as many on every rank (at least `at_least`):
    a rank with fewer rows gets empty ones, on which it forwards DUMMY, so that FSDP's collectives match."""
    n_micro = max(int(all_reduce(math.ceil(len(rows) / size), world, dist.ReduceOp.MAX)), at_least)
    chunks = micro_batches([_tokens(seqs, [r]) for r in rows], size, n_micro)
    return [[rows[i] for i in chunk] for chunk in chunks]


def _tokens(seqs, rows):
    """Prompt and response tokens of `rows` of seqs."""
    return sum(len(seqs[r]["prompt_ids"]) + len(seqs[r]["response_ids"]) for r in rows)


DUMMY = {"prompt_ids": [0], "response_ids": [0]}  # a rank with no rows left still runs FSDP's collectives


def idle_loss(model, pad_id, device, temperature):
    """A zero loss through the whole model (on DUMMY, no token selected): the backward of a rank with fewer
    micro-batches than the others, which keeps FSDP's collectives matched."""
    inputs, targets, _ = pack([DUMMY], [0], pad_id, device)
    none = torch.zeros_like(targets, dtype=torch.bool)
    return response_logp_at(model, inputs, targets, none, temperature).sum() * 0.0


def forward_no_grad(model, seqs, rows, T, args, world, *, pad_id, with_entropy=False):
    """log pi [B, T] (and d3s.token_entropy) of `rows` of seqs, no grad, in micro-batches, as many on every rank
    (micro_batch_rows); none when no rank has a row. Returns (log-probs, entropy or None, tokens over all ranks)."""
    device = world.device
    logp_out = torch.zeros(len(seqs), T, device=device)
    entropy_out = torch.zeros(len(seqs), T, device=device) if with_entropy else None
    with torch.no_grad():
        for chunk in micro_batch_rows(seqs, rows, args.micro_batch_size, world):
            inputs, targets, _ = pack(seqs, chunk, pad_id, device) if chunk else pack([DUMMY], [0], pad_id, device)
            logp, entropy = response_logp(model, inputs, targets, args.temperature, with_entropy=with_entropy)
            if chunk:
                logp_out[chunk, : targets.shape[1]] = logp
                if with_entropy:
                    entropy_out[chunk, : targets.shape[1]] = entropy
    reshard(model)  # the root's weights, gathered for the loss head: no backward follows to free them
    return logp_out, entropy_out, all_reduce(_tokens(seqs, rows), world)
