"""A stage's LoRA adapters: every worker of every live group loads, drops or lists the same
adapters; the stage knows their names, so a request naming an unknown one is refused at
admission (NOT_FOUND) instead of failing its batch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from stagemesh.core import errors, logs
from stagemesh.core.adapters import AdapterInfo
from stagemesh.core.params import Params, check_adapter_name
from stagemesh.stage_service.engine.dispatch import Engine
from stagemesh.stage_service.executor.multiproc import Executor

log = logs.get_logger("stagemesh.adapters")


class StageAdapters:
    """`names`: what lora_dir gave every worker at start (None: the stage applies no adapters).
    Adapters loaded at run time are loaded again into a restarted group."""

    def __init__(
        self,
        stage_name: str,
        engine: Engine,
        executor: Executor,
        names: list[str] | None = None,
        sleep_level: Callable[[], int] = lambda: 0,
    ):
        self._stage_name = stage_name
        self._sleep_level = sleep_level
        self._engine = engine
        self._executor = executor
        self.supported = names is not None
        self._names: set[str] = set(names or ())
        # name -> (path as given, source as the workers read it), replayed into restarted groups
        self._loaded_at_runtime: dict[str, tuple[str, str]] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        chained = engine.on_worker_restarted

        async def on_restart(group: int) -> None:
            await self._replay(group)
            if chained is not None:
                await chained(group)

        engine.on_worker_restarted = on_restart

    def start(self, names: list[str] | None) -> None:
        self.supported = names is not None
        self._names = set(names or ())

    def check(self, params: Params) -> None:
        """NOT_FOUND naming the first adapter of the request this stage does not hold."""
        for i, choice in enumerate(params.adapters):
            if choice.name not in self._names:
                known = ", ".join(sorted(self._names)) or "none"
                raise errors.NotFound(
                    f"params.adapters[{i}].name: no adapter named {choice.name!r} on {self._stage_name}; "
                    f"loaded: {known} (ListAdapters, LoadAdapter)"
                )

    def _require(self) -> None:
        if not self.supported:
            raise errors.Unimplemented(
                f"{self._stage_name} applies no LoRA adapters (it holds no diffusers transformer)"
            )

    async def load(self, name: str, path: str) -> list[AdapterInfo]:
        self._require()
        check_adapter_name(name, "name")
        if not path:
            raise errors.InvalidArgument.field(
                "path", "is empty; allowed: a file or folder inside the stage's lora_dir"
            )
        async with self._lock:
            if self._sleep_level():
                # Its layers would land on a device the stage has given back.
                raise errors.FailedPrecondition(f"{self._stage_name} is asleep; call WakeUp, then LoadAdapter")
            if name in self._names:
                raise errors.InvalidArgument.field("name", f"{name!r} is loaded already; unload it first")
            answers = await self._fan_out("adapter_load", name=name, path=path)
            refused = [a for a in answers.values() if "refused" in a]
            if refused:
                # All or none: the workers that took it drop it again.
                took = [g for g, a in answers.items() if "adapters" in a]
                await self._fan_out("adapter_unload", groups=took, name=name)
                raise errors.InvalidArgument.field("path", f"{path!r}: {refused[0]['refused']}")
            infos = [info for a in answers.values() for info in a["adapters"]]
            self._names.add(name)
            self._loaded_at_runtime[name] = (path, infos[0].source if infos else path)
            return infos

    async def unload(self, name: str) -> bool:
        """False when this stage does not hold it (the gateway answers NOT_FOUND if none did)."""
        self._require()
        async with self._lock:
            if name not in self._names:
                return False
            await self._fan_out("adapter_unload", name=name)
            self._names.discard(name)
            self._loaded_at_runtime.pop(name, None)
            return True

    async def list_all(self) -> list[AdapterInfo]:
        if not self.supported:
            return []
        answers = await self._fan_out("adapter_list")
        return [info for a in answers.values() for info in a["adapters"]]

    async def _fan_out(
        self, op: str, groups: list[tuple[int, int]] | None = None, **args: Any
    ) -> dict[tuple[int, int], dict]:
        """(group, rank) -> each worker's answer; a worker that cannot answer fails the call."""
        calls = {
            (g, rank): fut
            for g in (self._engine.live_groups() if groups is None else sorted({g for g, _ in groups}))
            for rank, fut in self._executor.control_each(g, op, **args).items()
        }
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in calls.values()), return_exceptions=True)
        out = {}
        for key, result in zip(calls, results):
            if isinstance(result, BaseException):
                raise errors.Unavailable(f"{self._stage_name} worker {key[1]}: {result}")
            out[key] = result
        return out

    async def _replay(self, group: int) -> None:
        """A restarted group has lora_dir's adapters: it drops those unloaded since the start (and
        those lora_dir gives under a name loaded since from another file) and loads again those
        loaded since, so it holds what the stage's other groups hold."""
        try:
            listed = await asyncio.wrap_future(self._executor.control(group, "adapter_list"))
            held = {info.name: info.source for a in listed.values() for info in a.get("adapters", ())}
            for name, source in sorted(held.items()):
                runtime = self._loaded_at_runtime.get(name)
                if name not in self._names or (runtime is not None and runtime[1] != source):
                    await asyncio.wrap_future(self._executor.control(group, "adapter_unload", name=name))
                    del held[name]
        except (errors.StagemeshError, RuntimeError) as exc:
            log.error("adapters of a restarted group not listed", error=str(exc))
            held = {}
        for name, (path, _) in list(self._loaded_at_runtime.items()):
            if name in held:
                continue
            try:
                answer = await asyncio.wrap_future(self._executor.control(group, "adapter_load", name=name, path=path))
                refused = [a["refused"] for a in answer.values() if "refused" in a]
            except (errors.StagemeshError, RuntimeError) as exc:
                refused = [str(exc)]
            if refused:  # the group serves on; requests naming it fail until it is loaded again
                log.error("adapter not restored after a restart", adapter=name, error=refused[0])
