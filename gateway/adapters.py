"""LoRA adapter control at the gateway: LoadAdapter, UnloadAdapter and ListAdapters fanned out
to every replica of every stage that holds the diffusion transformer (supports_adapters)."""

from __future__ import annotations

import asyncio

from stagemesh.core import converters, errors, logs
from stagemesh.core.adapters import AdapterInfo
from stagemesh.core.params import check_adapter_name
from stagemesh.gateway.stages import ReplicaFailure, StageClient
from stagemesh.v1 import control_pb2

log = logs.get_logger("stagemesh.gateway.adapters")


class AdapterControl:
    def __init__(self, stages: list[StageClient]):
        self._stages = stages
        self._lock = asyncio.Lock()  # one load or unload at a time over the mesh

    def _holders(self) -> list[StageClient]:
        holders = [s for s in self._stages if s.supports_adapters]
        if not holders:
            raise errors.Unimplemented(
                "no stage of this pipeline applies LoRA adapters (they need a diffusers-format "
                "model's diffusion or denoise stage)"
            )
        return holders

    async def load(self, name: str, path: str, timeout: float | None) -> list[AdapterInfo]:
        check_adapter_name(name, "name")
        if not path:
            raise errors.InvalidArgument.field(
                "path", "is empty; allowed: a file or folder inside the stages' lora_dir"
            )
        request = control_pb2.LoadAdapterRequest(name=name, path=path)
        async with self._lock:
            holders = self._holders()
            results = await asyncio.gather(
                *(s.each_replica("LoadStageAdapter", request, timeout=timeout) for s in holders)
            )
            failures = [r.error for replies in results for _, r in replies if isinstance(r, ReplicaFailure)]
            if failures:
                # All or none: the stages that took it drop it again, so no request sees it half-loaded.
                await self._unload_everywhere(name, timeout)
                raise failures[0]
            infos = [
                converters.adapter_info_from_proto(info)
                for replies in results
                for _, reply in replies
                for info in reply.adapters
            ]
        log.info("adapter loaded", adapter=name, path=path, workers=len(infos))
        return infos

    async def unload(self, name: str, timeout: float | None) -> list[int]:
        check_adapter_name(name, "name")
        async with self._lock:
            self._holders()
            dropped = await self._unload_everywhere(name, timeout)
        if not dropped:
            known = sorted({i.name for i in await self.list_all(timeout)})
            raise errors.NotFound(f"no adapter named {name!r}; loaded: {', '.join(known) or 'none'}")
        return dropped

    async def _unload_everywhere(self, name: str, timeout: float | None) -> list[int]:
        request = control_pb2.UnloadAdapterRequest(name=name)
        holders = [s for s in self._stages if s.supports_adapters]
        results = await asyncio.gather(
            *(s.each_replica("UnloadStageAdapter", request, timeout=timeout) for s in holders)
        )
        dropped = set()
        for replies in results:
            for _, reply in replies:
                if isinstance(reply, ReplicaFailure):
                    raise reply.error
                dropped.update(reply.stage_ids)
        return sorted(dropped)

    async def list_all(self, timeout: float | None) -> list[AdapterInfo]:
        holders = [s for s in self._stages if s.supports_adapters]
        request = control_pb2.ListAdaptersRequest()
        results = await asyncio.gather(
            *(s.each_replica("ListStageAdapters", request, timeout=timeout) for s in holders)
        )
        infos = []
        for replies in results:
            for _, reply in replies:
                if isinstance(reply, ReplicaFailure):
                    raise reply.error
                infos += [converters.adapter_info_from_proto(i) for i in reply.adapters]
        return sorted(infos, key=lambda i: (i.name, i.stage_id, i.rank))

    async def names(self, timeout: float | None) -> list[str]:
        return sorted({i.name for i in await self.list_all(timeout)})
