"""Stage kind "encoder": the pipeline's tokenizers and text encoders, prompt -> named embeddings
(e.g. prompt_embeds, pooled_prompt_embeds, and the negative ones when the request guides)."""

from __future__ import annotations

from pathlib import Path

import torch

from stagemesh.stage_service.models.contract import RunnerBase, WeightFile
from stagemesh.stage_service.models.diffusers_adapter.families import family_of
from stagemesh.stage_service.models.diffusers_adapter.folder import check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import checkpoint_dtype, load_pipeline, weight_files


class EncoderRunner(RunnerBase):
    kind = "encoder"

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.folder = check_stage_folder(model_dir, self.kind)
        self.family = family_of(self.folder)
        self.device = device
        self.names = self.folder.text_components()
        self.pipe = load_pipeline(self.folder, self.names, checkpoint_dtype(self.folder))
        self.encoders = {n: getattr(self.pipe, n) for n in self.names if n.startswith("text_encoder")}
        for module in self.encoders.values():
            module.to(device).eval().requires_grad_(False)

    def weight_files(self) -> list[WeightFile]:
        return [f for name, module in self.encoders.items() for f in weight_files(self.folder, name, module)]

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """One prompt at a time, exactly as the pipeline encodes it (padding makes the shapes
        equal, but a batched encoder could round differently from the unsplit pipeline)."""
        outputs = []
        for i, item in enumerate(batch):
            named = self.family.encode(self.pipe, item.params.prompt, item.params.guidance_scale, self.device)
            outputs.append({k: v[0].detach() for k, v in named.items()})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def limits(self) -> dict:
        return {}
