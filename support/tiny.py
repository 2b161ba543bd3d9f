"""support/tiny.py: a tiny Qwen2-architecture model and a character tokenizer, built offline.

The tests and the CPU rungs cannot download from a hub, so they build both from scratch: the tokenizer as a
`tokenizers` BPE with no merges over the 256 byte symbols (one token per character for ASCII), the model from a
`transformers.Qwen2Config`. Both are saved with `save_pretrained`, so anything that loads a hub model
(AutoModelForCausalLM, AutoTokenizer, vLLM) loads them from the folder.

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, num_layers=2)
    save_tiny(model, tok, "runs/tiny-base")      # -> from_pretrained("runs/tiny-base") works
"""

import torch

# Qwen's special tokens, so the Qwen2.5-Math chat template can be tokenized as well.
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]


def build_char_tokenizer(special_tokens=SPECIAL_TOKENS, chat_template=None):
    """A byte-level Qwen2Tokenizer with no merges: one token per byte (+ Qwen's special tokens, or `special_tokens`,
    the first of them EOS; `chat_template`: a Jinja chat template, as a chat model's tokenizer carries one).

    Built as the very class AutoTokenizer picks for a Qwen2 config, so the saved folder loads back token for token.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    symbols = sorted(ByteLevel.alphabet())  # byte-level symbols: " " is "\u0120", "\n" is "\u010a"
    tokenizer = Qwen2Tokenizer(
        vocab={tok: i for i, tok in enumerate(list(special_tokens) + symbols)},
        merges=[],
        eos_token=special_tokens[0],
        pad_token=special_tokens[0],
        unk_token=None,
        additional_special_tokens=list(special_tokens[1:]),
        model_max_length=4096,
        padding_side="left",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(
    tokenizer,
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=None,
    max_position_embeddings=1024,
    seed=0,
    tie_word_embeddings=True,
):
    """A randomly initialized Qwen2ForCausalLM sized for a CPU (about 0.33M params by default).

    head_dim = hidden_size / num_heads (32 by default) is one that vLLM's CPU attention accepts.
    tie_word_embeddings=False gives the LM-head layout of Qwen2.5-Math-7B (a separate lm_head).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_tiny(model, tokenizer, path):
    """save_pretrained both into `path` (safetensors + tokenizer.json + config.json)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path
