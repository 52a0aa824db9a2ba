"""FLUX.2 [dev] (Flux2Pipeline): FLUX.2's transformer with its guidance embedding, over a
Mistral3 (Mistral Small 3.1) model whose hidden states at layers 10, 20 and 30 are stacked, so
the tiny LM keeps 30 layers, narrow. Its tokenizer folder is written in the layout
PixtralProcessor loads (model_index.json names that class); the stages read it with
prompt_processor.TextProcessor, as torchvision is not installed (see there).

The tokenizer is byte-level BPE over the 256 byte symbols with no merges (one token a byte) plus
Mistral's control tokens, with a Mistral-style chat template over FLUX.2's system and user
messages."""

from __future__ import annotations

import json
from pathlib import Path

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2 import TINY_TRANSFORMER as KLEIN_TINY_TRANSFORMER
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2 import TINY_VAE

TEXT_DIM = 16
TEXT_LAYERS = 30  # the pipeline reads hidden states 10, 20 and 30
MAX_POSITIONS = 1024
# Mistral's control tokens, in the order of their ids in Mistral's tokenizer where it has them.
CONTROL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>")
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
SYSTEM_TOKENS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
# What FLUX.2-dev's tokenizer/processor_config.json and preprocessor_config.json say: the
# Pixtral processor of Mistral Small 3.1 (patch 14, 2 x 2 spatial merge).
PROCESSOR_CONFIG = {
    "processor_class": "PixtralProcessor",
    "patch_size": 14,
    "spatial_merge_size": 2,
    "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
}
PREPROCESSOR_CONFIG = {
    "image_processor_type": "PixtralImageProcessor",
    "processor_class": "PixtralProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": 14, "width": 14},
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 1540},
}
# klein's tiny transformer (the same text width), with FLUX.2 [dev]'s guidance embedding.
TINY_TRANSFORMER = {**KLEIN_TINY_TRANSFORMER, "joint_attention_dim": 3 * TEXT_DIM, "guidance_embeds": True}


def mistral_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(CONTROL_TOKENS + IMAGE_TOKENS + SYSTEM_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        additional_special_tokens=["[INST]", "[/INST]", *IMAGE_TOKENS, *SYSTEM_TOKENS],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def text_processor(tok=None):
    from stagemesh.stage_service.models.diffusers_adapter.prompt_processor import TextProcessor

    tok = tok if tok is not None else mistral_tokenizer()
    return TextProcessor(tok, chat_template=CHAT_TEMPLATE)


def mistral3_config(tok, text: dict, vision: dict):
    from transformers import Mistral3Config

    ids = {
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    return Mistral3Config(
        text_config={"model_type": "mistral", **text, **ids},
        vision_config={"model_type": "pixtral", **vision},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        tie_word_embeddings=False,
    )


def tiny_mistral3(tok):
    from transformers import Mistral3ForConditionalGeneration

    text = {
        "hidden_size": TEXT_DIM,
        "intermediate_size": 2 * TEXT_DIM,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": TEXT_DIM // 2,
        "max_position_embeddings": MAX_POSITIONS,
        "sliding_window": None,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "patch_size": 14,
        "image_size": 56,
    }
    return Mistral3ForConditionalGeneration(mistral3_config(tok, text, vision))


def tiny_components() -> dict:
    d = import_diffusers()
    processor = text_processor()
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(),
        "vae": d.AutoencoderKLFlux2(**TINY_VAE),
        "text_encoder": tiny_mistral3(processor.tokenizer),
        "tokenizer": processor,
        "transformer": d.Flux2Transformer2DModel(**TINY_TRANSFORMER),
    }


def as_published(folder: Path) -> None:
    """Rewrite the saved processor as FLUX.2-dev lays it out: model_index.json's tokenizer the
    PixtralProcessor, the processor's configs naming it (the tokenizer files stay)."""
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    where = folder / "tokenizer"
    (where / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")
    (where / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    config_file = where / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["processor_class"] = "PixtralProcessor"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
