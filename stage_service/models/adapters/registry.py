"""A worker's LoRA adapters: loaded into the transformer as peft's unfused layers, the set a batch
names applied with `set_adapters` (or none: `disable_lora`), at most `max_device_adapters` kept
on the device and the rest in host memory, least recently used moved out first."""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.core.adapters import AdapterInfo
from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import AdapterChoice, check_adapter_name
from stagemesh.stage_service.models.adapters import files

log = logs.get_logger("stagemesh.adapters")


@contextlib.contextmanager
def _expected_peft_notices():
    """peft warns when a second adapter joins a model and when an active one is deleted: both are
    how a registry works (several adapters, each batch setting its own set), not news for the log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute", category=UserWarning)
        warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted", category=UserWarning)
        yield


class UnknownAdapter(KeyError):
    """A name this worker does not hold."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.message = f"no adapter named {name!r}; loaded: {', '.join(known) or 'none'} (ListAdapters)"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Prepared:
    """An adapter file read and checked, not yet added to the transformer."""

    name: str
    source: str  # relative to lora_dir
    weights: files.AdapterWeights
    layers: int
    read_s: float


@dataclass
class _Adapter:
    name: str
    source: str  # relative to lora_dir
    layers: int
    params: list[nn.Parameter] = field(default_factory=list)
    on_device: bool = True

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def _adapter_params(transformer: nn.Module, name: str) -> list[nn.Parameter]:
    """The low-rank tensors peft made for adapter `name`: each tuner layer keeps them in
    ModuleDicts / ParameterDicts keyed by the adapter's name (lora_A.NAME.weight, ...)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = []
    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            for key, param in module.named_parameters():
                parts = key.split(".")
                if len(parts) > 1 and parts[1] == name and parts[0] in module.adapter_layer_names:
                    out.append(param)
    return out


class AdapterRegistry:
    """`pipe`: the stage's diffusers pipeline (its `lora_state_dict` converts file formats);
    `transformer`: the module adapters are added to; `max_device_adapters` 0: no bound."""

    def __init__(
        self,
        pipe,
        transformer: Any,
        device: str | torch.device,
        lora_dir: str = "",
        max_device_adapters: int = 0,
        stage_id: int = 0,
        rank: int = 0,
    ) -> None:
        self.pipe = pipe
        self.transformer = transformer
        self.device = torch.device(device)
        self.lora_dir = lora_dir
        self.max_device_adapters = max_device_adapters
        self.stage_id = stage_id
        self.rank = rank
        self._adapters: collections.OrderedDict[str, _Adapter] = collections.OrderedDict()  # LRU order
        self._applied: tuple[tuple[str, float], ...] | None = None  # what the transformer runs with now
        self._released: list[_Adapter] = []  # moved to the host by a sleep, back on wake

    # registration ----------------------------------------------------------------------------
    def load_dir(self) -> list[AdapterInfo]:
        """Every adapter of lora_dir (at start): a bad file fails the start, naming it."""
        if not self.lora_dir:
            return []
        loaded = []
        for name, path in files.discover(self.lora_dir).items():
            try:
                loaded.append(self.load(name, str(path.relative_to(Path(self.lora_dir)))))
            except files.AdapterFileError as exc:
                raise files.AdapterFileError(f"lora_dir {self.lora_dir}: adapter {name!r}: {exc}") from None
        return loaded

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read, check and add one adapter (`prepare`, then `attach`)."""
        return self.attach(self.prepare(name, path))

    def prepare(self, name: str, path: str) -> Prepared:
        """Read and check the file: no change to the transformer, so a worker runs this on a
        thread beside its batches and only `attach` waits for the batch in flight to end."""
        check_adapter_name(name, "name")
        if name in self._adapters:
            raise files.AdapterFileError(f"an adapter named {name!r} is loaded already; unload it first")
        started = time.perf_counter()
        source = files.resolve_source(self.lora_dir, path)
        weights = files.read(self.pipe, source)
        layers = files.check_layers(self.transformer, weights)
        relative = str(source.relative_to(Path(self.lora_dir).resolve()))
        return Prepared(name, relative, weights, layers, time.perf_counter() - started)

    def attach(self, prepared: Prepared) -> AdapterInfo:
        """Add a prepared adapter as peft's layers; it lands on the device only where the bound
        leaves room (the adapters in use stay), else in host memory until a request names it."""
        name = prepared.name
        if name in self._adapters:
            raise files.AdapterFileError(f"an adapter named {name!r} is loaded already; unload it first")
        started = time.perf_counter()
        weights = prepared.weights
        try:
            with _expected_peft_notices():
                self.transformer.load_lora_adapter(
                    weights.state_dict,
                    network_alphas=weights.network_alphas,
                    adapter_name=name,
                    metadata=weights.metadata,
                    prefix="transformer",
                )
        except (ValueError, RuntimeError) as exc:
            self._forget_partial(name)
            raise files.AdapterFileError(f"{Path(prepared.source).name} does not fit this model: {exc}") from None
        self._applied = None  # peft makes a new adapter active: the next batch sets its own set
        entry = _Adapter(name, prepared.source, prepared.layers)
        entry.params = _adapter_params(self.transformer, name)
        room = not self.max_device_adapters or self.resident_count() < self.max_device_adapters
        self._place(entry, room)
        self._adapters[name] = entry
        self._adapters.move_to_end(name, last=False)  # not used yet: first to leave the device
        log.info(
            "adapter loaded",
            adapter=name,
            source=entry.source,
            bytes=entry.nbytes,
            layers=entry.layers,
            on_device=entry.on_device,
            read_ms=round(prepared.read_s * 1e3, 1),
            attach_ms=round((time.perf_counter() - started) * 1e3, 1),
        )
        return self.info(entry)

    def unload(self, name: str) -> AdapterInfo:
        entry = self._get(name)
        with _expected_peft_notices():
            self.transformer.delete_adapters(name)
        del self._adapters[name]
        self._applied = None
        return self.info(entry)

    def _forget_partial(self, name: str) -> None:
        config = getattr(self.transformer, "peft_config", None) or {}
        if name in config:
            self.transformer.delete_adapters(name)

    def _get(self, name: str) -> _Adapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapter(name, sorted(self._adapters)) from None

    # per batch -------------------------------------------------------------------------------
    def apply(self, choices: tuple[AdapterChoice, ...]) -> None:
        """Make the transformer run with exactly `choices` (none: the base model)."""
        wanted = tuple((c.name, float(c.scale)) for c in choices)
        entries = [self._get(name) for name, _ in wanted]
        for entry in entries:
            self._adapters.move_to_end(entry.name)
        self._make_room(entries)
        if wanted == self._applied:
            return
        if not self._adapters:
            self._applied = wanted
            return
        if not wanted:
            self.transformer.disable_lora()
        else:
            self.transformer.enable_lora()
            self.transformer.set_adapters([n for n, _ in wanted], [s for _, s in wanted])
        self._applied = wanted

    def _make_room(self, needed: list[_Adapter]) -> None:
        """`needed` on the device; least recently used others moved to the host past the bound."""
        for entry in needed:
            if not entry.on_device:
                self._place(entry, True)
        if not self.max_device_adapters:
            return
        keep = {e.name for e in needed}
        excess = self.resident_count() - max(self.max_device_adapters, len(needed))
        for entry in list(self._adapters.values()):  # least recently used first
            if excess <= 0:
                break
            if entry.on_device and entry.name not in keep:
                self._place(entry, False)
                excess -= 1

    def _place(self, entry: _Adapter, on_device: bool) -> None:
        """On a CPU stage both places are the same memory; the state (and so the bound) is kept alike."""
        device = self.device if on_device else torch.device("cpu")
        for param in entry.params:
            param.data = param.data.to(device)
        entry.on_device = on_device

    def resident_count(self) -> int:
        return sum(1 for e in self._adapters.values() if e.on_device)

    # reporting ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._adapters)

    def info(self, entry: _Adapter) -> AdapterInfo:
        return AdapterInfo(
            entry.name, entry.source, self.stage_id, self.rank, entry.nbytes, entry.on_device, entry.layers
        )

    def infos(self) -> list[AdapterInfo]:
        return sorted((self.info(e) for e in self._adapters.values()), key=lambda i: i.name)

    # sleep -------------------------------------------------------------------------------------
    def for_sleep(self, level: int) -> _AdapterSleep:
        """What a sleep at `level` releases with the weights (a models.contract.DeviceHolder)."""
        return _AdapterSleep(self, level)


class _AdapterSleep:
    """Level 1: the adapters on the device wait in host memory and come back on wake. Level 2:
    they are dropped, as the base weights are, and read again from their files on wake (a file
    gone meanwhile is logged and that adapter stays unloaded on the worker)."""

    def __init__(self, registry: AdapterRegistry, level: int) -> None:
        self.registry = registry
        self.level = level
        self._moved: list[_Adapter] = []
        self._dropped: list[_Adapter] = []

    def release_device(self) -> int:
        registry = self.registry
        on_cpu = registry.device.type == "cpu"
        if self.level == 1:
            self._moved = [e for e in registry._adapters.values() if e.on_device]
            for entry in self._moved:
                registry._place(entry, False)
            return 0 if on_cpu else sum(e.nbytes for e in self._moved)  # a CPU stage's host is its device
        self._dropped = list(registry._adapters.values())
        released = sum(e.nbytes for e in self._dropped)
        if self._dropped:
            with _expected_peft_notices():
                registry.transformer.delete_adapters([e.name for e in self._dropped])
        registry._adapters.clear()
        registry._applied = None
        return released

    def restore_device(self) -> int:
        registry = self.registry
        if self.level == 1:
            for entry in self._moved:
                if entry.name in registry._adapters:
                    registry._place(entry, True)
            moved, self._moved = self._moved, []
            return 0 if registry.device.type == "cpu" else sum(e.nbytes for e in moved)
        taken = 0
        for entry in self._dropped:  # least recently used first, as they were
            try:
                taken += registry.load(entry.name, entry.source).bytes
            except files.AdapterFileError as exc:
                log.error("adapter not reloaded after sleep level 2", adapter=entry.name, error=str(exc))
        for entry in self._dropped:  # the order and places they had
            if entry.name in registry._adapters:
                registry._adapters.move_to_end(entry.name)
                registry._place(registry._adapters[entry.name], entry.on_device)
        self._dropped = []
        return taken


def for_runner(runner, settings, device: str, rank: int) -> AdapterRegistry | None:
    """The registry of a runner holding a diffusers transformer (`runner.transformer` and
    `runner.pipe`); None for the others, which apply no adapters."""
    transformer = getattr(runner, "transformer", None)
    pipe = getattr(runner, "pipe", None)
    if transformer is None or not hasattr(transformer, "load_lora_adapter") or not hasattr(pipe, "lora_state_dict"):
        return None
    registry = AdapterRegistry(
        pipe,
        transformer,
        device,
        lora_dir=settings.lora_dir,
        max_device_adapters=settings.max_device_adapters,
        stage_id=settings.stage_id,
        rank=rank,
    )
    registry.load_dir()
    return registry


def control_ops(registry: AdapterRegistry, attach=None) -> dict:
    """The worker's control operations on its adapters. A refusal (a bad file, an unknown name)
    is an answer, {"refused": why, "unknown": bool}, not a failure: the stage maps it to the
    caller's status."""

    def guarded(op):
        def call(**args):
            try:
                return {"adapters": op(**args)}
            except (files.AdapterFileError, InvalidArgument) as exc:
                return {"refused": str(exc), "unknown": False}
            except UnknownAdapter as exc:
                return {"refused": str(exc), "unknown": True}

        return call

    return {
        "adapter_load": guarded(lambda name, path: [registry.load(name, path)]),
        "adapter_unload": guarded(lambda name: [registry.unload(name)]),
        "adapter_list": guarded(registry.infos),
        # The second half of a load read on a thread (worker.adapter_loads).
        "adapter_attach": guarded(lambda rpc_id: attach(rpc_id)),
    }
