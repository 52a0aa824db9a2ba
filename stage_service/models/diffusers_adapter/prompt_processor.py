"""FLUX.2 [dev]'s prompt processor without torchvision.

Flux2Pipeline's `tokenizer` is a PixtralProcessor (model_index.json lists it so), and its
`encode_prompt` calls only the processor's `apply_chat_template` on text-only conversations.
transformers declares PixtralProcessor as needing torchvision (its image processor does), and
without torchvision the class is a placeholder that cannot be built. For text, though, every step
is ProcessorMixin's own: the chat template rendered with the tokenizer's special tokens, then the
tokenizer called with the merged text keywords (no BOS added where the template writes it).
PixtralProcessor overrides only the image steps. So `TextProcessor`, a ProcessorMixin holding only
the tokenizer, loaded from the same folder by ProcessorMixin's own `from_pretrained` (the same
tokenizer files and chat template; the image keys of processor_config.json are not used), yields
the same input ids and attention mask. It refuses images (an image in a conversation would need
the Pixtral image processor), which the served path never passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import ProcessorMixin


class TextProcessor(ProcessorMixin):
    """A processor with a tokenizer and a chat template only (text-only conversations)."""

    def __init__(self, tokenizer: Any = None, chat_template: str | None = None, **unused: Any) -> None:
        # `unused`: the image settings processor_config.json holds for the PixtralProcessor
        # (patch_size, spatial_merge_size, image tokens), which text never reaches.
        super().__init__(tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if images is not None or videos is not None or audio is not None:
            raise ValueError(
                "this prompt processor takes text only (the Pixtral image processor needs torchvision, not installed)"
            )
        return super().__call__(text=text, **kwargs)


def load_text_processor(path: str | Path) -> TextProcessor:
    """The processor of a tokenizer folder written for PixtralProcessor (tokenizer files,
    processor_config.json, the chat template), offline."""
    return TextProcessor.from_pretrained(str(path), local_files_only=True)
