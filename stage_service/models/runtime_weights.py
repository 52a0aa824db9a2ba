"""The runtime-weight cache wired into DLO for the embedded DiT (docs/DLO.md, "Runtime-weight cache in DLO").

Weights that went through the ordinary loader (TP > 1, or a checkpoint the direct mmap plan
refused) are private to each engine. Here every engine hashes its final tensors (DiT and decoder,
parameters and persistent buffers), derives the layout key and asks the cache for the entry: the
first engine publishes it, the others (and later starts) map it. On success each Parameter keeps
its identity and only its storage moves to the read-only mapping; DLO then streams blocks from
it. Any other outcome keeps the private tensors and logs the reason code.

Skip-load: a second, small entry (the alias) records, under a key derived before loading
(checkpoint fingerprint + config + TP coordinate + loader version), which layout key that
checkpoint produced. A start that finds both builds the model on meta and maps the entry
directly, without reading the checkpoint.

8-bit streaming (dlo_stream_dtype): the entry holds the weights as DLO streams them: each Linear
weight of a streamed block in float8_e4m3fn or int8 under its own name plus its scales under
"<name>.fp8_scale" or "<name>.int8_scale", everything else as loaded. Both keys name the stream
dtype and the resident block count (resident blocks stay unquantised), so an 8-bit entry never
serves a request for the model's own dtype or the other 8-bit format, nor the reverse; the checks
below refuse an entry whose dtypes do not match.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.tp import TpGroup
from stagemesh.stage_service.models.weights import (
    CONFIG_FILE,
    DECODER_PREFIX,
    DIT_FILE,
    DIT_PREFIX,
    build_dit,
    read_config,
)
from stagemesh.stage_service.offload import quant
from stagemesh.stage_service.runtime_cache.lookup import MappedEntry, RuntimeCache, content_hash, layout_key
from stagemesh.stage_service.settings import DloOptions

log = logs.get_logger("stagemesh.offload.runtime_weights")

# Bump when loading or post-processing changes what the final tensors are.
LOADER_VERSION = "stagemesh-dit-loader-1"
ALIAS_VERSION = LOADER_VERSION + "+checkpoint-alias"
ALIAS_TENSOR = "layout_key"


class LayoutMismatch(Exception):
    """A mapped entry does not hold exactly the model's tensors (names, shapes, dtypes)."""


@dataclass
class CacheResult:
    """What the cache did for one load: `entry` stays open while the model uses it."""

    entry: MappedEntry | None
    reason: str  # hit / published / lock_timeout / ... / layout_mismatch / skip_load_hit
    key: str = ""
    load_s: float = 0.0
    # 8-bit streaming: (weight, scales) of each quantised weight in the entry, by DiT name
    quantized: dict[str, quant.Quantized] | None = None


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)


def _parts(dit: nn.Module, decoder: nn.Module) -> dict[str, nn.Module]:
    return {DIT_PREFIX: dit, DECODER_PREFIX: decoder}


def _coordinate(tp: TpGroup | None) -> tuple[int, int]:
    return (1, 0) if tp is None else (tp.size, tp.rank)


def model_identity(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / CONFIG_FILE).read_bytes()).hexdigest()


def checkpoint_fingerprint(file: Path) -> str:
    """Cheap before-load identity of a safetensors file: its header (names, shapes, dtypes,
    offsets) plus size and modification time. Rewriting the file changes the time; an edit
    that keeps size and time is not seen here, but the content-derived layout key still is."""
    st = os.stat(file)
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = f.read(min(length, 100 << 20))
    digest = hashlib.sha256(header)
    digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def final_tensors(parts: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor: parameters and persistent buffers, as the model holds them."""
    return {
        prefix + name: t.detach()
        for prefix, module in parts.items()
        for name, t in module.state_dict(keep_vars=True).items()
    }


def expected_specs(parts: dict[str, nn.Module], quantized: Specs, stream: torch.dtype = quant.FLOAT8) -> Specs:
    """What an entry for `parts` holds: every final tensor as the model has it, except the
    `quantized` weights (full names), each stored in `stream` (FLOAT8 or INT8) plus its scales."""
    specs = {name: (tuple(t.shape), t.dtype) for name, t in final_tensors(parts).items()}
    for name, (shape, _) in quantized.items():
        specs[name] = (shape, stream)
        specs[quant.scale_name(name, stream)] = ((shape[0],), quant.SCALE_DTYPE)
    return specs


def _check(
    parts: dict[str, nn.Module], tensors: dict[str, torch.Tensor], quantized: Specs, stream: torch.dtype
) -> None:
    want = expected_specs(parts, quantized, stream)
    if want.keys() != tensors.keys():
        diff = sorted(want.keys() ^ tensors.keys())
        raise LayoutMismatch(f"names differ, e.g. {diff[:3]}")
    for name, (shape, dtype) in want.items():
        m = tensors[name]
        if tuple(m.shape) != shape or m.dtype != dtype:
            raise LayoutMismatch(f"{name}: entry {tuple(m.shape)} {m.dtype}, model {shape} {dtype}")
    for prefix, module in parts.items():
        persistent = set(module.state_dict(keep_vars=True))
        if any(n not in persistent for n, _ in module.named_buffers()):
            raise LayoutMismatch(f"{prefix}: non-persistent buffers are not in the entry")


def _quantized_of(
    tensors: dict[str, torch.Tensor], quantized: Specs, stream: torch.dtype
) -> dict[str, quant.Quantized] | None:
    """The entry's (weight, scales) pairs by DiT name (as the DLO engine names them)."""
    if not quantized:
        return None
    return {
        name.removeprefix(DIT_PREFIX): (tensors[name], tensors[quant.scale_name(name, stream)]) for name in quantized
    }


def swap_storage(
    parts: dict[str, nn.Module],
    tensors: dict[str, torch.Tensor],
    quantized: Specs | None = None,
    stream: torch.dtype = quant.FLOAT8,
) -> dict[str, quant.Quantized] | None:
    """Point every parameter and persistent buffer at its mapped tensor; Parameter objects
    stay. Checked first, so a mismatch changes nothing. A `quantized` weight gets a
    placeholder instead (its private copy goes): DLO streams it from the entry's 8-bit form
    (`stream`), returned by DiT name."""
    quantized = quantized or {}
    _check(parts, tensors, quantized, stream)
    for prefix, module in parts.items():
        for name, current in module.state_dict(keep_vars=True).items():
            full = prefix + name
            mapped = tensors[full] if full not in quantized else quant.placeholder(*quantized[full])
            if isinstance(current, nn.Parameter):
                current.data = mapped
            else:
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = mapped
    return _quantized_of(tensors, quantized, stream)


def _bind_on_meta(
    config: PipelineConfig, tp: TpGroup | None, tensors: dict[str, torch.Tensor], quantized: Specs, stream: torch.dtype
) -> tuple[nn.Module, nn.Module]:
    dit, decoder = build_dit(config, "meta", tp)
    parts = _parts(dit, decoder)
    _check(parts, tensors, quantized, stream)
    for prefix, module in parts.items():
        state = {}
        for name in module.state_dict(keep_vars=True):
            full = prefix + name
            state[name] = tensors[full] if full not in quantized else quant.placeholder(*quantized[full])
        module.load_state_dict(state, strict=True, assign=True)
        module.eval().requires_grad_(False)
    return dit, decoder


class DitWeightCache:
    """The cache as one DiT rank sees it (its TP coordinate; never its DP rank)."""

    def __init__(
        self,
        model_dir: Path,
        opts: DloOptions,
        tp: TpGroup | None,
        service_address: str | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = read_config(self.model_dir)
        self.tp = tp
        self.device = device  # where 8-bit quantisation runs
        self.stream_dtype = opts.dlo_stream_dtype
        self.stream = quant.stream_dtype(opts.dlo_stream_dtype) or quant.FLOAT8  # used only when quantised
        self.resident_layers = opts.dlo_resident_layers
        self._quantized: Specs | None = None
        self.cache = RuntimeCache(
            Path(opts.dlo_runtime_cache_dir).expanduser(), service_address, float(opts.dlo_runtime_cache_lock_timeout)
        )
        self.identity = model_identity(self.model_dir)

    @property
    def streams_quantized(self) -> bool:
        return bool(self.stream_dtype)

    def quantized_specs(self) -> Specs:
        """Full name -> (shape, model dtype) of the weights this engine streams in 8 bits; none without."""
        if not self.streams_quantized:
            return {}
        if self._quantized is None:
            dit, _ = build_dit(self.config, "meta", self.tp)
            specs = quant.quantized_specs(dit, self.resident_layers)
            self._quantized = {DIT_PREFIX + name: spec for name, spec in specs.items()}
        return self._quantized

    def _key(self, loader_version: str, digest: str) -> str:
        size, rank = _coordinate(self.tp)
        # Resident blocks are not quantised: their count changes what the entry holds.
        stream = f"{self.stream_dtype}+resident={self.resident_layers}" if self.streams_quantized else ""
        return layout_key(
            model_identity=self.identity,
            dtype=self.config.dtype,
            loader_version=loader_version,
            tp_size=size,
            tp_rank=rank,
            content_hash=digest,
            stream_dtype=stream,
        )

    def alias_key(self) -> str:
        return self._key(ALIAS_VERSION, checkpoint_fingerprint(self.model_dir / DIT_FILE))

    def layout_key_of(self, tensors: dict[str, torch.Tensor]) -> str:
        return self._key(LOADER_VERSION, content_hash(tensors))

    def skip_load(self):
        """(dit, decoder, CacheResult) mapped straight from the entry, or None on a miss."""
        alias = self.cache.lookup(self.alias_key())
        if alias.entry is None:
            return None
        try:
            key = bytes(alias.entry.tensors[ALIAS_TENSOR].numpy()).decode("ascii")
        except (KeyError, UnicodeDecodeError):
            return None
        finally:
            alias.entry.close()
        found = self.cache.lookup(key)
        if found.entry is None:
            return None
        quantized = self.quantized_specs()
        try:
            dit, decoder = _bind_on_meta(self.config, self.tp, found.entry.tensors, quantized, self.stream)
        except (LayoutMismatch, RuntimeError) as exc:
            log.warning(
                "dlo runtime cache entry does not fit the model; loading",
                key=key,
                reason="layout_mismatch",
                detail=str(exc),
            )
            found.entry.close()
            return None
        result = CacheResult(found.entry, "skip_load_hit", key)
        result.quantized = _quantized_of(found.entry.tensors, quantized, self.stream)
        return dit, decoder, result

    def streamed_form(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The final tensors as the entry stores them: with 8-bit streaming, each streamed Linear
        weight replaced by its 8-bit form and scales (quantised on this engine's device)."""
        out = dict(tensors)
        for name in self.quantized_specs():
            pair = quant.quantize_rows(out[name], self.device, self.stream)
            out[name], out[quant.scale_name(name, self.stream)] = pair
        return out

    def share(self, dit: nn.Module, decoder: nn.Module) -> CacheResult:
        """After a load: publish or find the entry and move the model onto it."""
        parts = _parts(dit, decoder)
        tensors = self.streamed_form(final_tensors(parts))
        key = self.layout_key_of(tensors)
        # `tensors` is the last reference to the private copies besides the model: both go
        # when this returns after the swap.
        outcome = self.cache.get_or_publish(key, lambda: tensors)
        if outcome.entry is None:
            return CacheResult(None, outcome.reason, key)
        try:
            quantized = swap_storage(parts, outcome.entry.tensors, self.quantized_specs(), self.stream)
        except LayoutMismatch as exc:
            log.warning(
                "dlo runtime cache entry does not fit the model", key=key, reason="layout_mismatch", detail=str(exc)
            )
            outcome.entry.close()
            return CacheResult(None, "layout_mismatch", key)
        self._record_alias(key)
        return CacheResult(outcome.entry, outcome.reason, key, quantized=quantized)

    def _record_alias(self, key: str) -> None:
        data = torch.frombuffer(bytearray(key.encode("ascii")), dtype=torch.uint8)
        alias = self.cache.get_or_publish(self.alias_key(), lambda: {ALIAS_TENSOR: data})
        if alias.entry is not None:
            alias.entry.close()


def load_through_cache(
    model_dir: Path,
    opts: DloOptions,
    tp: TpGroup | None,
    load_private,
    service_address: str | None = None,
    device: str | torch.device = "cpu",
):
    """(dit, decoder, mapped, CacheResult | None). `load_private()` is the usual host load:
    (dit, decoder, mapped, why-not-mapped). A checkpoint mapped directly needs no cache, unless
    blocks stream in 8 bits (the entry then holds the quantised form, shared by every engine)."""
    started = time.perf_counter()
    cache = DitWeightCache(model_dir, opts, tp, service_address, device)
    try:
        hit = cache.skip_load()
    except Exception as exc:  # noqa: BLE001 - the cache never stops a stage from starting
        log.warning(
            "dlo runtime cache lookup failed; loading", reason="io_error", detail=f"{type(exc).__name__}: {exc}"
        )
        hit = None
    if hit is not None:
        dit, decoder, result = hit
        result.load_s = time.perf_counter() - started
        log.info("dlo runtime cache hit; checkpoint load skipped", key=result.key, load_s=round(result.load_s, 4))
        return dit, decoder, True, result
    dit, decoder, mapped, _ = load_private()
    if mapped and not cache.streams_quantized:
        log.info("dlo runtime cache not needed: the checkpoint is mapped directly")
        return dit, decoder, True, None
    try:
        result = cache.share(dit, decoder)
    except Exception as exc:  # noqa: BLE001 - the private tensors are still whole
        log.warning("dlo runtime cache failed", detail=f"{type(exc).__name__}: {exc}")
        result = CacheResult(None, "io_error")
    result.load_s = time.perf_counter() - started
    if result.entry is None:
        log.warning(
            "dlo runtime cache not used; private weights kept",
            reason=result.reason,
            key=result.key,
            load_s=round(result.load_s, 4),
        )
        return dit, decoder, mapped, result
    log.info(
        "dlo runtime cache mapped after a load", reason=result.reason, key=result.key, load_s=round(result.load_s, 4)
    )
    return dit, decoder, True, result
