"""Video families' denoising and decode stages (families.py's `video` declarations, Wan): kind
"diffusion" runs the pipeline itself (WanPipeline, WanImageToVideoPipeline) with the encoder
stage's embeddings passed in, so its frames are the unsplit pipeline's by construction; kind
"denoise" stops it at the latents and a "decode" stage runs the family's VAE tail on them, as the
pipeline's own last step does.

A video is the float32 [frames, height, width, 3] array in [0, 1] the pipeline returns with
output_type="np", named "video" among the stage's outputs; it is taken as output_type="pt" gives
it (the same values, still on the device) and made float32 there, so a video the gateway encodes
becomes uint8 pixels before it leaves the device (transport.tensors.encoded_form). Each transformer (Wan 2.2's two
experts: `transformer` above the boundary timestep, `transformer_2` below) is resident or under
DLO, one engine each.
"""

from __future__ import annotations

from pathlib import Path

import PIL.Image
import torch

from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, ItemError, RunnerBase, WeightFile
from stagemesh.stage_service.models.diffusers_adapter.families import LARGEST_SIDE, Family, family_of, pixel_multiple
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder, check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import (
    checkpoint_dtype,
    load_pipeline,
    load_transformer,
    refuse_unsupported,
    weight_files,
)
from stagemesh.stage_service.settings import DloOptions

VIDEO_OUTPUT = "video"


def video_limits(folder: CheckpointFolder, family: Family) -> dict:
    """The pixel multiple and the frame rule: Wan's VAE compresses time 4 to 1 after the first
    frame, so num_frames is 4k + 1."""
    vae = folder.component_config("vae")
    return {
        "pixel_multiple": pixel_multiple(folder),
        "max_size": LARGEST_SIDE,
        "frame_step": int(vae.get("scale_factor_temporal", 4)),
        "default_num_frames": family.default_num_frames,
        "default_fps": family.default_fps,
        "requires_init_image": family.start_image,
    }


def frames_of(video: torch.Tensor) -> torch.Tensor:
    """One video of output_type="pt" ([frames, 3, H, W], the VAE's dtype) as output_type="np"
    has it, [frames, H, W, 3] float32 (diffusers' pt_to_numpy: permute, then float), on the
    device."""
    return video.permute(0, 2, 3, 1).float()


def _start_image(item, index: int) -> PIL.Image.Image:
    image = item.inputs.get(INIT_IMAGE_INPUT)
    want = [item.params.height, item.params.width, 3]
    if image is None or image.dtype != torch.uint8 or list(image.shape) != want:
        got = "none" if image is None else f"{image.dtype} {list(image.shape)}"
        raise ItemError(
            index, f"{item.request_id}: {INIT_IMAGE_INPUT!r} must be uint8 {want} (the first frame); got {got}"
        )
    # As a PIL image, the form diffusers' users pass it in.
    return PIL.Image.fromarray(image.cpu().numpy())


class VideoDiffusionRunner(RunnerBase):
    """kind "diffusion" returns frames; kind "denoise" the pipeline's latents for a decode stage."""

    supports_negative_prompt = True
    batch_invariant = True  # items run one at a time

    def __init__(self, model_dir: Path, device: str = "cpu", dlo: DloOptions | None = None, kind: str = "diffusion"):
        opts = dlo or DloOptions()
        refuse_unsupported(opts)
        self.kind = kind
        self.device = device
        self.folder = check_stage_folder(model_dir, kind)
        self.family = family_of(self.folder)
        self.supports_init_image = self.family.start_image
        dtype = checkpoint_dtype(self.folder)
        experts = [n for n in self.family.experts if n in self.folder.components]
        loaded = {name: load_transformer(self.folder, self.family, device, dtype, opts, name) for name in experts}
        self.experts = {name: model for name, (model, _) in loaded.items()}
        self.engines = {name: engine for name, (_, engine) in loaded.items() if engine is not None}
        self.offload = next(iter(self.engines.values()), None)
        self.pipe = load_pipeline(self.folder, ["scheduler", "vae"], dtype, **self.experts)
        self.pipe.vae.to(device).eval().requires_grad_(False)

    def weight_files(self) -> list[WeightFile]:
        files: list[WeightFile] = []
        for name, model in self.experts.items():
            engine = self.engines.get(name)
            skip = tuple(f"{block.path}." for block in engine.streamed) if engine is not None else ()
            files += weight_files(self.folder, name, model, skip)
        return files + weight_files(self.folder, "vae", self.pipe.vae)

    def device_holders(self) -> list:
        return list(self.engines.values())

    def offload_bytes(self) -> int:
        return sum(int(engine.h2d_bytes) for engine in self.engines.values())

    def _call_args(self, item, index: int) -> dict:
        family, params = self.family, item.params
        needed = family.embeddings + (family.negative_embeddings if params.guidance_scale > family.cfg_above else ())
        missing = [n for n in needed if n not in item.inputs]
        if missing:
            raise ItemError(
                index,
                f"{item.request_id}: inputs lack {missing} (got {sorted(item.inputs)}); the stage before must be "
                "an 'encoder' stage of the same checkpoint",
            )
        args = family.call_arguments(params) | {n: item.inputs[n][None].to(self.device) for n in needed}
        args["generator"] = torch.Generator("cpu").manual_seed(params.seed)
        args["output_type"] = "pt" if self.kind == "diffusion" else "latent"
        if family.start_image:
            args["image"] = _start_image(item, index)
        return args

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """One item at a time, each one pipeline call. `progress(step, total)` counts the batch's
        steps and may raise to abort between two of them."""
        for index, item in enumerate(batch):
            if not item.params.num_frames:
                raise ItemError(index, f"{item.request_id}: params.num_frames is unset; a video model draws frames")
        total = sum(item.params.num_inference_steps for item in batch)
        done = 0
        outputs = []
        for index, item in enumerate(batch):
            args = self._call_args(item, index)

            def on_step(_pipe, _i, _t, _tensors, offset=done):
                if progress is not None:
                    progress(offset + _i + 1, total)
                return {}

            result = self.pipe(**args, callback_on_step_end=on_step).frames
            done += item.params.num_inference_steps
            if self.kind == "diffusion":
                outputs.append({VIDEO_OUTPUT: frames_of(result[0])})
            else:
                outputs.append({"latents": result[0].detach()})
        return outputs

    def limits(self) -> dict:
        return video_limits(self.folder, self.family)


class VideoDecodeRunner(RunnerBase):
    """kind "decode" of a video family: the VAE alone, latents -> frames, as the pipeline ends."""

    kind = "decode"
    batch_invariant = True

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.folder = check_stage_folder(model_dir, self.kind)
        self.family = family_of(self.folder)
        self.device = device
        self.pipe = load_pipeline(self.folder, ["vae"], checkpoint_dtype(self.folder))
        self.vae = self.pipe.vae.to(device).eval().requires_grad_(False)

    def weight_files(self) -> list[WeightFile]:
        return weight_files(self.folder, "vae", self.vae)

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        outputs = []
        for i, item in enumerate(batch):
            latents = item.inputs.get("latents")
            if latents is None:
                raise ItemError(
                    i,
                    f"{item.request_id}: inputs lack 'latents' (got {sorted(item.inputs)}); the stage before must "
                    "be a 'denoise' stage of the same checkpoint",
                )
            outputs.append({VIDEO_OUTPUT: self._decode(latents[None].to(self.device), item.params)})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def _decode(self, latents: torch.Tensor, params) -> torch.Tensor:
        video = self.family.decode(self.pipe, latents, params)
        return frames_of(self.pipe.video_processor.postprocess_video(video, output_type="pt")[0])

    def limits(self) -> dict:
        return video_limits(self.folder, self.family)
