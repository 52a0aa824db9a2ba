"""What a worker process drives: one runner per stage kind, batch in, device tensors out."""

from __future__ import annotations

from pathlib import Path

import torch

from stagemesh.stage_service import platform
from stagemesh.stage_service.models.batch_invariance import groups_by_key, run_in_groups
from stagemesh.stage_service.models.contract import (
    INIT_IMAGE_INPUT,
    ItemError,
    Progress,
    Runner,
    RunnerBase,
    TensorSpec,
    WeightFile,
    WorkItem,
    check_batch,
)
from stagemesh.stage_service.models.dit import StartImages, cond_bucket, sample
from stagemesh.stage_service.models.dit_offload import load_offloaded_dit
from stagemesh.stage_service.models.parallel import ImageParallel
from stagemesh.stage_service.models.step_graphs import StepGraphs
from stagemesh.stage_service.models.tp import TpGroup
from stagemesh.stage_service.models.weights import (
    DECODER_PREFIX,
    DIT_FILE,
    DIT_PREFIX,
    LM_FILE,
    load_dit,
    load_lm,
    read_config,
    trained_size,
)
from stagemesh.stage_service.settings import DloOptions

# The AR stage's encoding of a negative prompt: the diffusion stage guides away from it in
# place of the DiT's learned unconditional input.
NEGATIVE_HIDDEN_STATES = "negative_hidden_states"


def _output(t: torch.Tensor) -> torch.Tensor:
    # Outputs stay on the device: the worker's output path copies them to the host (on a side
    # stream in async mode), so the GPU can start the next batch at once.
    return t.detach()


class ArRunner(RunnerBase):
    """Stage 0: prompt -> LM hidden states (prompt tokens + greedily decoded tokens); a negative
    prompt is encoded the same way."""

    kind = "ar"
    supports_negative_prompt = True

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.config = read_config(self.model_dir)
        self.lm = load_lm(self.model_dir, device)

    def weight_files(self) -> list[WeightFile]:
        """Where each weight comes from: what sleep level 2 reloads on wake."""
        return [WeightFile(self.model_dir / LM_FILE, {"": self.lm})]

    def run(self, batch: list[WorkItem], progress: Progress | None = None) -> list[dict[str, torch.Tensor]]:
        """One output per item, in order. `progress(k, len(batch))` follows each item and may
        raise to abort the rest of the batch."""
        outputs = []
        # Greedy decoding makes the encoding a function of the text: a text the batch holds more
        # than once (the images of one Generate share their prompt) is encoded once.
        seen: dict[str, torch.Tensor] = {}

        def encode(text: str) -> torch.Tensor:
            if text not in seen:
                seen[text] = _output(self.lm.encode_prompt(text))
            return seen[text]

        for i, item in enumerate(batch):
            encoded = {"hidden_states": encode(item.params.prompt)}
            if item.params.negative_prompt:
                encoded[NEGATIVE_HIDDEN_STATES] = encode(item.params.negative_prompt)
            outputs.append(encoded)
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def input_specs(self) -> dict[str, TensorSpec]:
        return {}  # the prompt is all it reads

    def limits(self) -> dict:
        lm = self.config.lm
        return {
            "max_prompt_bytes": lm.max_prompt_tokens - 1,  # BOS takes one slot
            "max_seq_len": lm.max_seq_len,
            "decode_tokens": lm.decode_tokens,
            "hidden_dim": lm.d_model,
        }


class DiffusionRunner(RunnerBase):
    """Stage 1: LM hidden states -> images [H, W, 3] float32 in [0, 1]; guided away from a
    negative prompt's hidden states when given, and from a starting image (image-to-image)."""

    kind = "diffusion"
    supports_negative_prompt = True
    supports_init_image = True

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dlo: DloOptions | None = None,
        group=None,
        tp: TpGroup | None = None,
        cuda_graphs: bool = True,
        invariant_rows: int = 0,
        parallel: ImageParallel | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.config = read_config(self.model_dir)
        # batch_invariant: every pass runs this many requests (models.batch_invariance); 0: as given.
        self.invariant_rows = invariant_rows
        self.batch_invariant = invariant_rows > 0
        self.runtime_cache = None  # the runtime-cache result when dlo_enable_runtime_cache is set
        opts = dlo or DloOptions()
        self.tp = _tp_coordinate(opts, tp)
        self.parallel = parallel or ImageParallel()
        if self.tp is not None and self.parallel.world > 1:
            raise ValueError("sp_size and cfg_parallel do not combine with tensor_parallel_size > 1")
        if opts.enable_dlo:
            self.dit, self.decoder, self.offload, self.runtime_cache = load_offloaded_dit(
                self.model_dir, device, opts, group=group, tp=self.tp
            )
        else:
            self.dit, self.decoder = load_dit(self.model_dir, device, tp=self.tp)
        # Every sequence-parallel rank holds every weight; only its slice of the tokens differs.
        self.dit.sequence_parallel = self.parallel.sp if self.parallel.sp.split else None
        # Graphs fix the weights' addresses: not with DLO (it streams them), nor with TP or
        # image parallelism (collectives).
        captured = cuda_graphs and platform.is_cuda(device) and self.offload is None
        self.graphs = StepGraphs(self.dit) if captured and self.tp is None and self.parallel.world == 1 else None

    def weight_files(self) -> list[WeightFile]:
        # Under DLO the streamed blocks belong to the offload engine (host copies or the
        # checkpoint mapping, plus its device slots): sleep manages only what stays resident.
        streamed = self.offload.streamed if self.offload is not None else ()
        skip = tuple(f"{DIT_PREFIX}{block.path}." for block in streamed)
        parts = {DIT_PREFIX: self.dit, DECODER_PREFIX: self.decoder}
        return [WeightFile(self.model_dir / DIT_FILE, parts, skip)]

    def device_holders(self) -> list:
        """The DLO engine's device slots sleep and wake with the resident weights; captured
        step graphs (which point at the weights) are dropped by sleep."""
        return [h for h in (self.offload, self.graphs) if h is not None]

    def sleep_refusal(self, level: int) -> str | None:
        if level == 2 and self.tp is not None:
            # Wake from level 2 reloads whole checkpoint tensors; a TP rank holds shards.
            return "sleep level 2 is not available with tensor_parallel_size > 1; use level 1"
        return None

    def input_specs(self) -> dict[str, TensorSpec]:
        # The conditioning is the language model's hidden states: at most one row per position.
        states = TensorSpec((None, self.config.dit.cond_dim), max_size=self.config.lm.max_seq_len)
        return {
            "hidden_states": states,
            NEGATIVE_HIDDEN_STATES: TensorSpec(states.sizes, states.max_size, required=False),
            # uint8, sized like the request (stage_service.inputs checks both).
            INIT_IMAGE_INPUT: TensorSpec((None, None, 3), floating=False, required=False),
        }

    def _cond(self, index: int, item: WorkItem, name: str = "hidden_states") -> torch.Tensor:
        cond = item.inputs.get(name)
        d = self.config.dit.cond_dim
        if cond is None:
            raise ItemError(index, f"inputs lack {name!r}")
        if cond.dim() != 2 or cond.shape[0] < 1 or cond.shape[1] != d:
            raise ItemError(index, f"{name} must be [L>=1, {d}], got {tuple(cond.shape)}")
        return cond

    def _negatives(self, batch: list[WorkItem]) -> list[torch.Tensor | None] | None:
        if not any(NEGATIVE_HIDDEN_STATES in item.inputs for item in batch):
            return None
        return [
            self._cond(i, item, NEGATIVE_HIDDEN_STATES) if NEGATIVE_HIDDEN_STATES in item.inputs else None
            for i, item in enumerate(batch)
        ]

    def _start(self, batch: list[WorkItem]) -> StartImages | None:
        """Image-to-image: the batch's starting images as latents (a batch shares its strength,
        so either every item has one or none has)."""
        head = batch[0].params
        if head.strength is None:
            return None
        images = []
        for i, item in enumerate(batch):
            image = item.inputs.get(INIT_IMAGE_INPUT)
            wanted = (head.height, head.width, 3)
            if image is None or image.dtype != torch.uint8 or tuple(image.shape) != wanted:
                got = "none" if image is None else f"{image.dtype} {tuple(image.shape)}"
                raise ItemError(i, f"{INIT_IMAGE_INPUT} must be uint8 {wanted}, got {got}")
            images.append(image)
        # On the host, like the noise they are mixed with: the result does not depend on the device.
        with torch.inference_mode():
            latents = self.decoder.encode(torch.stack(images).cpu(), self.config.dit.latent_channels)
        return StartImages(latents, head.first_step)

    def run(self, batch: list[WorkItem], progress: Progress | None = None) -> list[dict[str, torch.Tensor]]:
        """Sample the whole batch as one; every item must share shape, steps and guidance.

        `progress(step, num_inference_steps)` follows each denoising step and may raise to
        abort the batch. With `invariant_rows`, requests whose conditioning pads alike run
        together at exactly that many requests, so each one's kernels see the shapes they see
        when it runs alone.
        """
        if not batch:
            return []
        check_batch(batch)
        if self.parallel.cfg.rank > 0 and batch[0].params.guidance_scale == 1.0:
            return []  # unguided: no unconditional pass to run; rank 0's pass runs the batch alone
        if not self.invariant_rows:
            return self._sample(batch, progress)
        keys = [self._padding(i, item) for i, item in enumerate(batch)]
        return run_in_groups(self._sample_filled, batch, groups_by_key(keys, self.invariant_rows), progress)

    def _padding(self, index: int, item: WorkItem) -> tuple[int, int]:
        """The lengths an item's conditioning and its negative prompt's pad to (0: none): a pass
        pads every row to the longest, so only items alike here share one under batch_invariant."""
        negative = item.inputs.get(NEGATIVE_HIDDEN_STATES)
        length = 0 if negative is None else cond_bucket(self._cond(index, item, NEGATIVE_HIDDEN_STATES).shape[0])
        return cond_bucket(self._cond(index, item).shape[0]), length

    def _sample_filled(self, batch: list[WorkItem], progress: Progress | None) -> list[dict[str, torch.Tensor]]:
        """`batch` filled up to invariant_rows requests with copies of its first; their outputs dropped."""
        filled = batch + [batch[0]] * (self.invariant_rows - len(batch))
        return self._sample(filled, progress, keep=len(batch))

    def _sample(
        self, batch: list[WorkItem], progress: Progress | None, keep: int | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Images of the first `keep` items of `batch` (default: all)."""
        head = batch[0]
        images = sample(
            self.dit,
            self.decoder,
            [self._cond(i, item) for i, item in enumerate(batch)],
            width=head.params.width,
            height=head.params.height,
            num_inference_steps=head.params.num_inference_steps,
            guidance_scale=head.params.guidance_scale,
            seeds=[i.params.seed for i in batch],
            progress=progress,
            graphs=self.graphs,
            cfg=self.parallel.cfg,
            negatives=self._negatives(batch),
            start=self._start(batch),
        )
        if keep is not None and keep < len(batch):
            # The images kept share one storage without the fillers' (the output path ships a
            # request's image with the storage it views).
            images = images[:keep].clone()
        return [{"image": _output(img)} for img in images]

    def limits(self) -> dict:
        dit = self.config.dit
        return {
            "pixel_multiple": dit.pixel_multiple,
            "cond_dim": dit.cond_dim,
            "latent_channels": dit.latent_channels,
            "vae_scale": dit.vae_scale,
            **({"native_size": size} if (size := trained_size(self.model_dir)) else {}),
        }


def _tp_coordinate(opts: DloOptions, tp: TpGroup | None) -> TpGroup | None:
    """The rank's TP coordinate, checked against tensor_parallel_size; None at TP1."""
    size = opts.tensor_parallel_size
    if size == 1 and (tp is None or tp.size == 1):
        return None
    if tp is None or tp.size != size:
        have = "none" if tp is None else f"{tp.size} ranks"
        raise ValueError(
            f"tensor_parallel_size = {size} needs the process group of the "
            f"stage's TP ranks (got {have}): pass tp=, or run it in a stage"
        )
    return tp


_RUNNERS: dict[str, type[ArRunner | DiffusionRunner]] = {
    ArRunner.kind: ArRunner,
    DiffusionRunner.kind: DiffusionRunner,
}


def build_runner(
    kind: str,
    model_dir: Path,
    device: str = "cpu",
    dlo: DloOptions | None = None,
    group=None,
    tp: TpGroup | None = None,
    cuda_graphs: bool = True,
    invariant_rows: int = 0,
    parallel: ImageParallel | None = None,
) -> Runner:
    """Load the runner for a stage kind from an existing model folder (see ensure_model_dir).
    `group`: the stage's DP process group (DLO AllGather with dp_size > 1); `tp`: the rank's
    TP coordinate (tensor_parallel_size > 1, diffusion only); `cuda_graphs`: the embedded
    DiT's steps from captured graphs where that applies (DiffusionRunner); `invariant_rows`:
    batch_invariant's fixed number of requests per pass (DiffusionRunner; 0: off); `parallel`:
    the rank's place in the stage's sequence/CFG-parallel group (sp_size > 1 or cfg_parallel)."""
    from stagemesh.stage_service.models.diffusers_adapter import FOLDER_ONLY_KINDS, is_diffusers_folder

    # A diffusers-format folder (model_index.json) goes to the adapter, which alone imports
    # diffusers; so do the kinds only such a folder serves.
    if is_diffusers_folder(model_dir) or kind in FOLDER_ONLY_KINDS:
        from stagemesh.stage_service.models.diffusers_adapter import build_runner as build_diffusers_runner

        return build_diffusers_runner(kind, model_dir, device, dlo, group, tp, parallel)
    try:
        cls = _RUNNERS[kind]
    except KeyError:
        raise ValueError(f"unknown runner kind {kind!r}; expected one of {sorted(_RUNNERS)}") from None
    if cls is DiffusionRunner:
        return cls(
            model_dir,
            device,
            dlo,
            group,
            tp,
            cuda_graphs=cuda_graphs,
            invariant_rows=invariant_rows,
            parallel=parallel,
        )
    if tp is not None and tp.size > 1:
        raise ValueError(f"tensor parallelism covers the diffusion stage only, not {kind!r}")
    if parallel is not None and parallel.world > 1:
        raise ValueError(f"sp_size and cfg_parallel cover the diffusion stage only, not {kind!r}")
    return cls(model_dir, device)
