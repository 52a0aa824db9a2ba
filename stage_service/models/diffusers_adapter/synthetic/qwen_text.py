"""The Qwen2 byte-level BPE tokenizer and the Qwen text encoders (Qwen3, Qwen2.5-VL) that
Z-Image, FLUX.2 [klein] and Qwen-Image condition on, with random weights. The tokenizer's
vocabulary is the 256 byte symbols with no merges (every prompt tokenizes, one token a byte) plus
the chat markers; it saves in the layout `Qwen2Tokenizer` loads (tokenizer.json + config)."""

from __future__ import annotations

# The Qwen chat layout the pipelines' prompt templates use.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# What Qwen2.5-VL marks an image's place in a prompt with (Qwen-Image-Edit).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
MAX_POSITIONS = 1024


def qwen_tokenizer(extra: tuple[str, ...] = ()):
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=MAX_POSITIONS)  # pads with <|endoftext|>
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS + extra)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _text_config(tok, hidden: int, layers: int) -> dict:
    return {
        "vocab_size": len(tok),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
    }


def qwen3(tok, hidden: int, layers: int, causal_lm: bool = False):
    """Qwen3Model (Z-Image) or Qwen3ForCausalLM (FLUX.2 [klein]), head dim hidden / 2."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(**_text_config(tok, hidden, layers), head_dim=hidden // 2)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)


def qwen2_5_vl(tok, hidden: int, layers: int):
    """Qwen2_5_VLForConditionalGeneration with a one-block vision tower (Qwen-Image's LLM)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head = hidden // 2
    # Multimodal rotary sections (time, height, width) split the head's half dimension.
    third = head // 2 // 3
    sections = [head // 2 - 2 * third, third, third]
    text = {
        **_text_config(tok, hidden, layers),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections},
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "fullatt_block_indexes": [0],
    }
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS if name in tok.get_vocab()}
    extra = {}
    if ids:
        extra = {
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "image_token_id": ids["<|image_pad|>"],
        }
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **extra))
