"""A diffusers-format checkpoint folder: what model_index.json lists, and whether each component
a stage needs is present. Reads JSON and safetensors headers only (no diffusers import, no
network), so `stagemesh up` can refuse an incomplete folder before any process starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODEL_INDEX = "model_index.json"
# Stage kinds served from such a folder, and the components each one loads.
STAGE_KINDS = ("encoder", "diffusion", "denoise", "decode")
FOLDER_ONLY_KINDS = ("encoder", "denoise", "decode")  # the embedded model has no such stage
# The pipeline classes served (families.py declares each; listed here too, so that the check at
# start reads no more than JSON).
PIPELINE_CLASSES = (
    "Flux2KleinPipeline",
    "Flux2Pipeline",
    "FluxPipeline",
    "QwenImageEditPipeline",
    "QwenImagePipeline",
    "StableDiffusion3Pipeline",
    "WanImageToVideoPipeline",
    "WanPipeline",
    "ZImagePipeline",
)
_WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
_CONFIG_FILES = {"scheduler": "scheduler_config.json"}


class FolderError(ValueError):
    """The folder cannot serve the stage; the message names the folder and the component."""


def is_diffusers_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MODEL_INDEX).is_file()


@dataclass(frozen=True)
class CheckpointFolder:
    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]  # name -> (library, class name), listed ones only

    def text_components(self) -> list[str]:
        """The pipeline's text encoders, tokenizers and processor (Qwen-Image-Edit's), in
        model_index.json order."""
        return [n for n in self.components if n.startswith(("text_encoder", "tokenizer", "processor"))]

    def needed_by(self, kind: str) -> list[str]:
        if kind == "encoder":
            return self.text_components()
        if kind in ("diffusion", "denoise"):  # the VAE's encoder takes image-to-image's start
            # Wan 2.2's low-noise expert, where the checkpoint lists one.
            return [
                "transformer",
                *(["transformer_2"] if "transformer_2" in self.components else []),
                "scheduler",
                "vae",
            ]
        if kind == "decode":
            return ["vae"]
        raise FolderError(
            f"kind {kind!r} cannot be served from a diffusers folder; expected one of {list(STAGE_KINDS)}"
        )

    def check(self, kind: str) -> None:
        """Raise FolderError naming an unsupported pipeline class, or the first component
        `kind` needs that is absent or empty."""
        if self.pipeline_class not in PIPELINE_CLASSES:
            raise FolderError(
                f"checkpoint {self.path}: pipeline class {self.pipeline_class!r} is not supported "
                f"(model_index.json's _class_name); supported: {list(PIPELINE_CLASSES)}"
            )
        needed = self.needed_by(kind)
        if kind == "encoder" and not needed:
            raise FolderError(
                f"checkpoint {self.path}: model_index.json lists no text encoder "
                "or tokenizer, which an 'encoder' stage needs"
            )
        for name in needed:
            self._check_component(name, kind)

    def _check_component(self, name: str, kind: str) -> None:
        if name not in self.components:
            raise FolderError(
                f"checkpoint {self.path}: model_index.json does not list component "
                f"{name!r}, which a {kind!r} stage needs"
            )
        where = self.path / name
        if not where.is_dir():
            raise FolderError(
                f"checkpoint {self.path} is missing component {name!r} "
                f"(model_index.json lists it; expected folder {where})"
            )
        if name.startswith(("tokenizer", "processor")):  # files that are no model
            if not any(where.iterdir()):
                raise FolderError(f"checkpoint {self.path}: component {name!r} folder {where} is empty")
        elif name in _CONFIG_FILES:
            self._require(where / _CONFIG_FILES[name], name)
        else:
            self._require(where / "config.json", name)
            self.weight_files(name)

    def _require(self, file: Path, name: str) -> None:
        if not file.is_file():
            raise FolderError(f"checkpoint {self.path}: component {name!r} lacks {file.name} (expected {file})")

    def weight_files(self, name: str) -> list[Path]:
        """The safetensors files of a model component: the sharded index's files, or the one
        file. Pickled .bin weights are not read."""
        where = self.path / name
        for stem in _WEIGHT_NAMES:
            index = where / f"{stem}.safetensors.index.json"
            if index.is_file():
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                missing = [s for s in shards if not (where / s).is_file()]
                if missing:
                    raise FolderError(
                        f"checkpoint {self.path}: component {name!r} lacks shard {missing[0]} listed in {index}"
                    )
                return [where / s for s in shards]
            single = where / f"{stem}.safetensors"
            if single.is_file():
                return [single]
        raise FolderError(
            f"checkpoint {self.path}: component {name!r} has no safetensors "
            f"weights in {where} (expected {_WEIGHT_NAMES[0]}.safetensors or "
            f"{_WEIGHT_NAMES[1]}.safetensors; .bin weights are not loaded)"
        )

    def component_config(self, name: str) -> dict:
        file = self.path / name / "config.json"
        if not file.is_file():
            raise FolderError(f"checkpoint {self.path}: component {name!r} lacks config.json (expected {file})")
        return json.loads(file.read_text())


def open_folder(path: str | Path) -> CheckpointFolder:
    """Read model_index.json; raise FolderError when it is missing or malformed."""
    path = Path(path).expanduser()
    index = path / MODEL_INDEX
    if not index.is_file():
        raise FolderError(f"{path} is not a diffusers-format checkpoint: it has no {MODEL_INDEX}")
    try:
        data = json.loads(index.read_text())
    except json.JSONDecodeError as exc:
        raise FolderError(f"{index}: not valid JSON ({exc})") from None
    pipeline_class = data.get("_class_name")
    if not isinstance(pipeline_class, str):
        raise FolderError(f"{index}: no '_class_name' naming the pipeline class")
    components = {}
    for name, value in data.items():
        if name.startswith("_"):
            continue
        # Optional components the checkpoint leaves out are written as [null, null].
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            components[name] = (value[0], value[1])
    return CheckpointFolder(path, pipeline_class, components)


def check_stage_folder(path: str | Path, kind: str) -> CheckpointFolder:
    """Open the folder and check that it holds what a `kind` stage loads."""
    folder = open_folder(path)
    folder.check(kind)
    return folder
