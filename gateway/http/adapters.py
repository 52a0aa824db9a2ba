"""LoRA adapters over HTTP: each adapter is a model of GET /v1/models (chosen with `model`, as
OpenAI-compatible servers select adapters), and /v1/omni/adapters loads, drops and lists them
(the control token guards them as it guards LoadAdapter, UnloadAdapter and ListAdapters)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict

from stagemesh.core import errors, logs
from stagemesh.gateway.adapters import AdapterControl
from stagemesh.gateway.http import openai_schema as schema

log = logs.get_logger("stagemesh.gateway.http")


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: str


async def models(adapters: AdapterControl, created: int) -> dict[str, Any]:
    """The base model, then each adapter by its name (its `parent` the base model's id)."""
    base = {"id": schema.MODEL_ID, "object": "model", "created": created, "owned_by": "stagemesh"}
    try:
        names = await adapters.names(None)
    except errors.StagemeshError as exc:  # the base model is served all the same
        log.warning("adapters not listed in /v1/models", reason=str(exc))
        names = []
    listed = [{**base, "id": name, "parent": schema.MODEL_ID, "root": schema.MODEL_ID} for name in names]
    return {"object": "list", "data": [base, *listed]}


def add_routes(app: FastAPI, adapters: AdapterControl, ctl: Depends) -> None:
    @app.get("/v1/omni/adapters", dependencies=[ctl])
    async def list_adapters() -> dict:
        return {"adapters": [dataclasses.asdict(i) for i in await adapters.list_all(None)]}

    @app.post("/v1/omni/adapters", dependencies=[ctl])
    async def load_adapter(body: LoadBody) -> dict:
        return {"adapters": [dataclasses.asdict(i) for i in await adapters.load(body.name, body.path, None)]}

    @app.delete("/v1/omni/adapters/{name}", dependencies=[ctl])
    async def unload_adapter(name: str) -> dict:
        return {"name": name, "stage_ids": await adapters.unload(name, None)}
