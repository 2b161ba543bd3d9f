"""support/templates.py: how a problem becomes a prompt, and which tokens end its response (both trainers, every engine).

TEMPLATES, format_prompt   the prompt: Qwen2.5-Math's template written out, the tokenizer's own chat template
                           (apply_chat_template, --system-prompt as its system turn), or plain for the tiny model
pick_template              --template auto's pick: chat for a chat model, qwen-math for Qwen2.5-Math, plain for tiny
check_template             a template whose markup is not the tokenizer's: one line, before any work
turn_end_id, stop_token_ids   the tokens that end a response: EOS, the model's, the chat template's end of turn
"""

from support.cli import UsageError

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."  # --system-prompt's default
TEMPLATES = {
    # Qwen2.5-Math eval harness "qwen25-math-cot" template (also Dr.GRPO / SimpleRL-Zoo / LIMR).
    "qwen-math": "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n",
    # Plain template for tiny character-level models (no chat tokens in their vocabulary).
    "plain": "{problem}\nAnswer: ",
    # The tokenizer's own chat template (tokenizer.chat_template): a system turn, the problem, the generation prompt.
    "chat": None,
}


def format_prompt(problem, template, tokenizer=None, system_prompt=SYSTEM_PROMPT):
    """The prompt of a problem under --template (a key of TEMPLATES); "chat" renders it with `tokenizer`'s own chat
    template (--system-prompt as the system turn, none when empty), as apply_chat_template renders it for generation.

    >>> format_prompt("1+1?", "plain")
    '1+1?\\nAnswer: '
    """
    if template == "chat":
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages = [*system, {"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return TEMPLATES[template].format(problem=problem, system=system_prompt)


def pick_template(template, tokenizer, model):
    """--template auto's pick (any other value as given): plain for the tiny model (model None); for a model whose
    tokenizer has a chat template, chat, unless it is a Qwen2.5-Math model (its name or folder says so), which the
    paper prompts with qwen-math; without a chat template, qwen-math."""
    if template != "auto":
        return template
    if model is None:
        return "plain"
    names = f"{model} {getattr(tokenizer, 'name_or_path', '')}".lower()
    return "chat" if getattr(tokenizer, "chat_template", None) and "qwen2.5-math" not in names else "qwen-math"


def check_template(template, tokenizer, flag="--template"):
    """UsageError (one line, before any work) for a template whose markup is not the tokenizer's: qwen-math on a
    tokenizer that does not know <|im_start|> as one special token (the model would read Qwen's markup as text), chat
    on a tokenizer without a chat template."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_chat:
        raise UsageError(
            f"{flag} chat: this tokenizer has no chat template (tokenizer.chat_template); pass --template qwen-math "
            "(a Qwen tokenizer) or plain"
        )
    if template == "qwen-math" and len(tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"]) > 1:
        raise UsageError(
            f"{flag} qwen-math: this tokenizer does not know <|im_start|> as a special token (the model would read "
            f"Qwen's markup as text); pass --template {'chat (its own template)' if has_chat else 'plain'}"
        )


def turn_end_id(tokenizer):
    """The special token that closes an assistant turn in the tokenizer's chat template (Llama-3's <|eot_id|>, Qwen's
    <|im_end|>), found by rendering one turn; None without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "MARK"}]
    after = tokenizer.apply_chat_template(turn, tokenize=False).rsplit("MARK", 1)[-1].lstrip()
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return ids[0] if ids and getattr(added.get(ids[0]), "special", False) else None


def stop_token_ids(tokenizer, generation_config=None):
    """The token ids that end a response, one rule for every rung and engine: the tokenizer's EOS, the model's
    generation_config.eos_token_id (an int or a list), Qwen's <|im_end|> when the vocabulary has it (the chat
    template ends the assistant turn with it), and the end-of-turn token of the tokenizer's chat template (turn_end_id).

    >>> from support import tiny; tok = tiny.build_char_tokenizer(); stop_token_ids(tok) == [tok.eos_token_id, 2]
    True
    """
    ids = {tokenizer.eos_token_id, turn_end_id(tokenizer)}
    config_eos = getattr(generation_config, "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)
