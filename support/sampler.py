"""support/sampler.py: train_small.py's fast path on a CPU, which is not D3S: each prompt is encoded once and its keys
and values shared by its G rollouts, in sampling and in the forward passes.

    sample             G responses per prompt (or greedy ones): HF generate's loop on one KV cache per prompt
    logprobs_entropy   log pi of every response token and d3s.token_entropy of the same logits, each distinct prompt
                       forwarded once: a plain forward's log-probs and gradients, bit for bit (tests/test_train_small.py)
    take_rows          some rollouts of a batch, trimmed to their longest response
    shared_kv_attention   the attention every model train_small loads runs: each key/value head read in place where
                       no gradient is needed

They make the tiny rung's update about a third of TRL's (docs/benchmarks.md); train_full.py does the same work with
vLLM and its loss head (support/engines.py, support/loss_head.py).
"""

import torch
from transformers import DynamicCache

import d3s
from support.templates import stop_token_ids


def _forward(model, cache, input_ids, attention_mask, position_ids, **kwargs):
    """The model's logits on input_ids, which read and extend the keys and values in `cache`."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    ).logits


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, greedy=False):
    """`group_size` responses per prompt (row p*G + g), o_t ~ softmax(logits / T) or greedy. Returns the rollout
    batch: prompt_ids [B, Lp], prompt_mask (left-padded), response_ids [B, T], response_mask (1 up to and including
    the first EOS) and texts."""
    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompt_mask = enc.attention_mask  # [P, Lp], left-padded
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as generate: left padding does not shift positions
    eos = torch.tensor(stop_token_ids(tokenizer, model.generation_config))  # the one rule of every rung
    model.eval()
    cache = DynamicCache()
    logits = _forward(model, cache, enc.input_ids, prompt_mask, positions, logits_to_keep=1)[:, -1]  # [P, V]: prefill
    cache.batch_repeat_interleave(group_size)  # the prompt's keys and values, shared by its G rollouts
    logits = logits.repeat_interleave(group_size, 0)  # [B, V]: each row's last logits (an ended row's: stale)
    attention_mask = prompt_mask.repeat_interleave(group_size, 0)  # [live, Lp + t]
    position = positions[:, -1:].repeat_interleave(group_size, 0)  # [live, 1]
    B = logits.shape[0]
    response_ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id)
    ended, live = torch.zeros(B, dtype=torch.bool), torch.arange(B)  # live: the rows still in the cache
    for t in range(max_new_tokens):
        if greedy:
            token = logits.float().argmax(-1)  # [B]
        else:  # over all B rows, ended ones too: the same random draws whichever rows are still live
            token = torch.multinomial((logits.float() / temperature).softmax(-1), 1).squeeze(1)  # o_t ~ pi
        response_ids[:, t] = torch.where(ended, tokenizer.pad_token_id, token)
        ended |= torch.isin(token, eos)
        if bool(ended.all()) or t == max_new_tokens - 1:
            break
        go_on = (~ended[live]).nonzero().squeeze(1)  # an ended row leaves the cache: no more forwards for it
        if len(go_on) < len(live):
            cache.batch_select_indices(go_on)
            live, attention_mask, position = live[go_on], attention_mask[go_on], position[go_on]
        attention_mask = torch.cat([attention_mask, torch.ones(len(live), 1, dtype=attention_mask.dtype)], 1)
        position = position + 1
        logits[live] = _forward(model, cache, token[live, None], attention_mask, position)[:, -1]
    response_ids = response_ids[:, : t + 1]  # [B, T]
    is_eos = torch.isin(response_ids, eos)
    response_mask = (~((is_eos.cumsum(-1) - is_eos.long()) > 0)).long()  # 0 strictly after the first EOS
    texts = [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(response_ids, response_mask.sum(-1).tolist())
    ]
    return {
        "prompt_ids": enc.input_ids.repeat_interleave(group_size, 0),
        "prompt_mask": prompt_mask.repeat_interleave(group_size, 0),
        "response_ids": response_ids,
        "response_mask": response_mask,
        "texts": texts,
    }


def logprobs_entropy(model, batch, temperature=1.0, with_entropy=True):
    """log pi(o_t | prompt, o_<t) [B, T] (logits / temperature: the policy that sampled) and the entropy H_t [B, T] of
    the same logits (d3s.token_entropy, no grad); every response reads its prompt's keys and values."""
    model.train()
    Lp = batch["prompt_ids"].shape[1]
    rows = torch.cat([batch["prompt_ids"], batch["prompt_mask"]], 1)  # [B, 2 Lp]
    prompts, row_prompt = torch.unique(rows, dim=0, return_inverse=True)  # [U, 2 Lp] distinct; row b's: row_prompt[b]
    first = int(prompts[:, Lp:].any(0).int().argmax())  # drop the columns that are padding in every prompt
    prompt_ids, prompt_mask = prompts[:, first:Lp], prompts[:, Lp + first :]
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp']
    cache = DynamicCache()
    first_logits = _forward(model, cache, prompt_ids, prompt_mask, prompt_pos, logits_to_keep=1)  # [U, 1, V]: o_1
    for layer in cache.layers:  # each row's prompt keys and values; the backward adds the rows up in a fixed order
        layer.keys, layer.values = layer.keys.index_select(0, row_prompt), layer.values.index_select(0, row_prompt)
    attention_mask = torch.cat([prompt_mask[row_prompt], batch["response_mask"]], 1)  # [B, Lp' + T]
    position_ids = prompt_pos[row_prompt, -1:] + batch["response_mask"].cumsum(-1)  # as cumsum(mask) - 1 above
    # [B, T, V]: t predicts o_{t+1}
    logits = _forward(model, cache, batch["response_ids"], attention_mask, position_ids)
    logits = torch.cat([first_logits[row_prompt], logits[:, :-1]], 1).float() / temperature  # [B, T, V]: o_1 .. o_T
    logp = logits.log_softmax(-1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)  # [B, T]
    return logp, (d3s.token_entropy(logits) if with_entropy else None)


def take_rows(batch, rows):
    """The rollouts `rows` of a rollout batch, trimmed to their longest response (none: [0, 0])."""
    T = int(batch["response_mask"][rows].sum(-1).max()) if len(rows) else 0
    return {
        "prompt_ids": batch["prompt_ids"][rows],
        "prompt_mask": batch["prompt_mask"][rows],
        "response_ids": batch["response_ids"][rows, :T],
        "response_mask": batch["response_mask"][rows, :T],
    }


SHARED_KV = "sdpa_shared_kv"  # the attention every model loaded here runs (shared_kv_attention)


def sdpa_shared_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, except with a padding mask and no gradient on a CPU: query [B, H, q, d], key and
    value [B, H_kv, kv, d]. Given a mask, "sdpa" copies every key/value head to its H / H_kv query heads before the
    kernel; here the kernel reads each head in place (enable_gqa, as "sdpa" does with no mask). Same floats
    (tests/test_train_small.py); 0.75-0.85x the tiny model's generation time on CPU (docs/small_compare.md, section
    8). With a gradient the copy stays: the in-place kernel's backward adds the heads' gradients in another order."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
    if plain or torch.is_grad_enabled() or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(  # with a mask "sdpa" passes is_causal=False too
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def shared_kv_attention(model):
    """The model (in place) with sdpa_shared_kv as its attention and "sdpa"'s masks; a model whose attention does not
    go through transformers' AttentionInterface keeps its own (transformers logs a warning)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_KV, sdpa_shared_kv)
    AttentionMaskInterface.register(SHARED_KV, sdpa_mask)
    model.set_attn_implementation(SHARED_KV)
    return model
