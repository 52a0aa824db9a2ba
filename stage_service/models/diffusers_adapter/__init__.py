"""Serving diffusers-format checkpoints: a folder with model_index.json and one sub-folder per
component (safetensors weights).

Importing this package costs nothing: `folder` reads only JSON and safetensors headers. The
runners (`runners`) import diffusers and transformers, the optional extra
`pip install stagemesh[diffusers]`, and only a stage configured with such a folder loads them.
"""

from stagemesh.stage_service.models.diffusers_adapter.folder import (
    FOLDER_ONLY_KINDS,
    MODEL_INDEX,
    STAGE_KINDS,
    CheckpointFolder,
    FolderError,
    check_stage_folder,
    is_diffusers_folder,
    open_folder,
)


def _is_video(model_dir) -> bool:
    """Whether the folder's family draws videos (reads model_index.json only)."""
    from stagemesh.stage_service.models.diffusers_adapter.families import family_of

    return family_of(open_folder(model_dir)).video


def import_for(model_dir, kind: str) -> None:
    """Import what a `kind` stage over the folder uses (diffusers, transformers, the classes of
    its components and its pipeline), so a worker's load phase holds only building and
    reading; an absent optional extra raises naming the install command."""
    from stagemesh.stage_service.models.diffusers_adapter.loading import import_classes

    import_classes(open_folder(model_dir), kind)


__all__ = [
    "import_for",
    "FOLDER_ONLY_KINDS",
    "MODEL_INDEX",
    "STAGE_KINDS",
    "CheckpointFolder",
    "FolderError",
    "build_runner",
    "check_stage_folder",
    "is_diffusers_folder",
    "open_folder",
]


def build_runner(kind: str, model_dir, device: str = "cpu", dlo=None, group=None, tp=None, parallel=None):
    """The runner of a `kind` stage over a diffusers folder (imports diffusers on first use).
    `parallel`: the rank's sequence / CFG-parallel coordinate (denoising kinds only)."""
    if group is not None or (tp is not None and tp.size > 1):
        raise ValueError(
            "DP process groups and tensor parallelism are not available for "
            "diffusers-format folders; use dp_size = 1 (or dlo_use_allgather = "
            "false) and tensor_parallel_size = 1"
        )
    if parallel is not None and parallel.world > 1 and kind not in ("diffusion", "denoise"):
        raise ValueError(f"sp_size and cfg_parallel split a denoising stage, not kind {kind!r}")
    if kind != "encoder" and _is_video(model_dir):
        if parallel is not None and parallel.world > 1:
            raise ValueError("sp_size and cfg_parallel are not available for video models; set both to 1")
        from stagemesh.stage_service.models.diffusers_adapter import video

        if kind == "decode":
            return video.VideoDecodeRunner(model_dir, device)
        if kind in ("diffusion", "denoise"):
            return video.VideoDiffusionRunner(model_dir, device, dlo, kind)
    if kind == "encoder":
        from stagemesh.stage_service.models.diffusers_adapter.encoder import EncoderRunner

        return EncoderRunner(model_dir, device)
    if kind in ("diffusion", "denoise"):
        from stagemesh.stage_service.models.diffusers_adapter.denoise import DenoiseRunner

        return DenoiseRunner(model_dir, device, dlo, kind, parallel)
    if kind == "decode":
        from stagemesh.stage_service.models.diffusers_adapter.denoise import DecodeRunner

        return DecodeRunner(model_dir, device)
    raise FolderError(
        f"kind {kind!r} cannot be served from a diffusers folder ({model_dir}); expected one of {list(STAGE_KINDS)}"
    )
