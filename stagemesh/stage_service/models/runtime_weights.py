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
from stagemesh.stage_service.offload.config import DloOptions
from stagemesh.stage_service.runtime_cache.lookup import MappedEntry, RuntimeCache, content_hash, layout_key

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


def _check(parts: dict[str, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    want = final_tensors(parts)
    if want.keys() != tensors.keys():
        diff = sorted(want.keys() ^ tensors.keys())
        raise LayoutMismatch(f"names differ, e.g. {diff[:3]}")
    for name, t in want.items():
        m = tensors[name]
        if tuple(m.shape) != tuple(t.shape) or m.dtype != t.dtype:
            raise LayoutMismatch(f"{name}: entry {tuple(m.shape)} {m.dtype}, model {tuple(t.shape)} {t.dtype}")
    for prefix, module in parts.items():
        persistent = set(module.state_dict(keep_vars=True))
        if any(n not in persistent for n, _ in module.named_buffers()):
            raise LayoutMismatch(f"{prefix}: non-persistent buffers are not in the entry")


def swap_storage(parts: dict[str, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Point every parameter and persistent buffer at its mapped tensor; Parameter objects
    stay. Checked first, so a mismatch changes nothing."""
    _check(parts, tensors)
    for prefix, module in parts.items():
        for name, current in module.state_dict(keep_vars=True).items():
            mapped = tensors[prefix + name]
            if isinstance(current, nn.Parameter):
                current.data = mapped
            else:
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = mapped


def _bind_on_meta(
    config: PipelineConfig, tp: TpGroup | None, tensors: dict[str, torch.Tensor]
) -> tuple[nn.Module, nn.Module]:
    dit, decoder = build_dit(config, "meta", tp)
    parts = _parts(dit, decoder)
    _check(parts, tensors)
    for prefix, module in parts.items():
        state = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
        module.load_state_dict(state, strict=True, assign=True)
        module.eval().requires_grad_(False)
    return dit, decoder


class DitWeightCache:
    """The cache as one DiT rank sees it (its TP coordinate; never its DP rank)."""

    def __init__(
        self, model_dir: Path, opts: DloOptions, tp: TpGroup | None, service_address: str | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = read_config(self.model_dir)
        self.tp = tp
        self.cache = RuntimeCache(
            Path(opts.dlo_runtime_cache_dir).expanduser(), service_address, float(opts.dlo_runtime_cache_lock_timeout)
        )
        self.identity = model_identity(self.model_dir)

    def _key(self, loader_version: str, digest: str) -> str:
        size, rank = _coordinate(self.tp)
        return layout_key(
            model_identity=self.identity,
            dtype=self.config.dtype,
            loader_version=loader_version,
            tp_size=size,
            tp_rank=rank,
            content_hash=digest,
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
        try:
            dit, decoder = _bind_on_meta(self.config, self.tp, found.entry.tensors)
        except (LayoutMismatch, RuntimeError) as exc:
            log.warning(
                "dlo runtime cache entry does not fit the model; loading",
                key=key,
                reason="layout_mismatch",
                detail=str(exc),
            )
            found.entry.close()
            return None
        return dit, decoder, CacheResult(found.entry, "skip_load_hit", key)

    def share(self, dit: nn.Module, decoder: nn.Module) -> CacheResult:
        """After an ordinary load: publish or find the entry and move the model onto it."""
        parts = _parts(dit, decoder)
        tensors = final_tensors(parts)
        key = self.layout_key_of(tensors)
        # `tensors` is the last reference to the private copies besides the model: both go
        # when this returns after the swap.
        outcome = self.cache.get_or_publish(key, lambda: tensors)
        if outcome.entry is None:
            return CacheResult(None, outcome.reason, key)
        try:
            swap_storage(parts, outcome.entry.tensors)
        except LayoutMismatch as exc:
            log.warning(
                "dlo runtime cache entry does not fit the model", key=key, reason="layout_mismatch", detail=str(exc)
            )
            outcome.entry.close()
            return CacheResult(None, "layout_mismatch", key)
        self._record_alias(key)
        return CacheResult(outcome.entry, outcome.reason, key)

    def _record_alias(self, key: str) -> None:
        data = torch.frombuffer(bytearray(key.encode("ascii")), dtype=torch.uint8)
        alias = self.cache.get_or_publish(self.alias_key(), lambda: {ALIAS_TENSOR: data})
        if alias.entry is not None:
            alias.entry.close()


def load_through_cache(
    model_dir: Path, opts: DloOptions, tp: TpGroup | None, load_private, service_address: str | None = None
):
    """(dit, decoder, mapped, CacheResult | None). `load_private()` is the usual host load:
    (dit, decoder, mapped, why-not-mapped). A checkpoint mapped directly needs no cache."""
    started = time.perf_counter()
    cache = DitWeightCache(model_dir, opts, tp, service_address)
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
    if mapped:
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
        return dit, decoder, False, result
    log.info(
        "dlo runtime cache mapped after a load", reason=result.reason, key=result.key, load_s=round(result.load_s, 4)
    )
    return dit, decoder, True, result
