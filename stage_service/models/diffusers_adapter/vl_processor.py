"""Qwen-Image-Edit's `processor` (transformers' Qwen2VLProcessor) built from its parts, without
a video processor.

Qwen2VLProcessor is an image processor, a tokenizer and a video processor. Its video processor
(Qwen2VLVideoProcessor) needs torchvision, and without torchvision the processor cannot even be
made with `video_processor=None`: ProcessorMixin.__init__ checks every part against its base
class, and the video part's (VideoProcessorMixin) cannot be looked up then. The edit pipeline
only ever gives it a prompt and one image. So the stage builds it from the folder's
`processor/` files: `Qwen2VLImageProcessorPil` (the PIL/numpy image processor, used whether or
not torchvision is installed, so every machine encodes an image alike) and the tokenizer, in a
subclass whose only parts are those two. The pipeline is handed this object as its `processor`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def image_text_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of `image_processor` and `tokenizer` only (no video processor)."""
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer)


def load_processor(path: str | Path):
    """The processor a folder's `processor/` describes (preprocessor_config.json and the
    tokenizer files), offline."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return image_text_processor(image_processor, tokenizer)


_CLASS: list[Any] = []


def _processor_class():
    """Defined on first use: transformers is imported by the stages that load a folder only."""
    if _CLASS:
        return _CLASS[0]
    from transformers import Qwen2VLProcessor

    class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
        # ProcessorMixin takes its parts from __init__'s parameters: these two.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # Qwen2VLProcessor's own set-up (its image token); it hands ProcessorMixin the parts
            # in get_attributes() order, where there is no video processor to pair the None with.
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    _CLASS.append(Qwen2VLImageTextProcessor)
    return Qwen2VLImageTextProcessor
