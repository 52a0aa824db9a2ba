"""Stage kind "encoder": the pipeline's tokenizers and text encoders, prompt -> named embeddings
(e.g. prompt_embeds, pooled_prompt_embeds, and the negative prompt's negative_* when SD3 guides).
An edit family's encoder reads the prompt with the image to edit (INIT_IMAGE_INPUT)."""

from __future__ import annotations

from pathlib import Path

import PIL.Image
import torch

from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, ItemError, RunnerBase, WeightFile, WorkItem
from stagemesh.stage_service.models.diffusers_adapter.families import LARGEST_SIDE, family_of
from stagemesh.stage_service.models.diffusers_adapter.folder import check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import checkpoint_dtype, load_pipeline, weight_files


class EncoderRunner(RunnerBase):
    kind = "encoder"

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.folder = check_stage_folder(model_dir, self.kind)
        self.family = family_of(self.folder)
        self.supports_negative_prompt = self.family.supports_negative_prompt
        self.supports_init_image = self.family.edit_image
        self.device = device
        self.names = self.folder.text_components()
        built = self.family.built_components(self.folder.path) if self.family.built_components else {}
        # Given after loading: from_pretrained would check them against model_index.json's classes.
        self.pipe = load_pipeline(self.folder, [n for n in self.names if n not in built], checkpoint_dtype(self.folder))
        for name, component in built.items():
            setattr(self.pipe, name, component)
        self.encoders = {n: getattr(self.pipe, n) for n in self.names if n.startswith("text_encoder")}
        for module in self.encoders.values():
            module.to(device).eval().requires_grad_(False)

    def weight_files(self) -> list[WeightFile]:
        return [f for name, module in self.encoders.items() for f in weight_files(self.folder, name, module)]

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """One prompt at a time, exactly as the pipeline encodes it (padding makes the shapes
        equal, but a batched encoder could round differently from the unsplit pipeline)."""
        for i, item in enumerate(batch):  # before any work: the others run again without it
            if item.params.negative_prompt and not self.supports_negative_prompt:
                raise ItemError(
                    i,
                    f"{item.request_id}: params.negative_prompt is not supported by "
                    f"{self.family.pipeline_class}: {self.family.negative_prompt_refusal}",
                )
        images = [self._edit_image(i, item) for i, item in enumerate(batch)] if self.family.edit_image else None
        outputs = []
        for i, item in enumerate(batch):
            extra = {} if images is None else {"image": images[i]}
            named = self.family.encode(self.pipe, item.params, self.device, **extra)
            outputs.append({k: v[0].detach() for k, v in named.items()})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def _edit_image(self, index: int, item) -> PIL.Image.Image:
        image = item.inputs.get(INIT_IMAGE_INPUT)
        if image is None or image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
            got = "none" if image is None else f"{image.dtype} {list(image.shape)}"
            raise ItemError(
                index,
                f"{item.request_id}: {self.family.pipeline_class} edits the image in inputs[{INIT_IMAGE_INPUT!r}]; "
                f"allowed: uint8 [height, width, 3] (RGB); got {got}",
            )
        return PIL.Image.fromarray(image.cpu().numpy())

    def warm_up_items(self, params) -> list[WorkItem]:
        inputs = {}
        if self.family.edit_image:  # a mid-grey image of the default size to read
            inputs[INIT_IMAGE_INPUT] = torch.full((params.height, params.width, 3), 128, dtype=torch.uint8)
        return [WorkItem("warm-up", params, inputs)]

    def limits(self) -> dict:
        if self.family.video:  # it is told the request's num_frames, which it checks as the others
            from stagemesh.stage_service.models.diffusers_adapter.video import video_limits

            # The start image goes to the diffusion stage only: this one is never sent it.
            return {**video_limits(self.folder, self.family), "requires_init_image": False}
        return {"max_size": LARGEST_SIDE, "requires_init_image": self.family.edit_image}
