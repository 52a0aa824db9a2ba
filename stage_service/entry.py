"""`stagemesh stage`: the stage service's start, light on purpose.

The stage checks its model folder and spawns its workers (executor.early) before it imports
grpc's server, torch and its engine (server.py): the workers' interpreters, their imports and
their loads run while the stage imports, instead of after. The folder check imports no torch
(a diffusers folder's JSON and safetensors headers, the embedded model's config and checksums);
only the embedded model's first use, which writes its weights, does.
"""

from __future__ import annotations

import argparse
import signal

from stagemesh.core import auth, logs, serve, startup
from stagemesh.stage_service.executor import worker_startup
from stagemesh.stage_service.executor.early import EarlyWorkers
from stagemesh.stage_service.models.diffusers_adapter import FolderError
from stagemesh.stage_service.models.model_dir import prepare_model_dir
from stagemesh.stage_service.settings import StageSettings
from stagemesh.weight_store.errors import CheckpointError

log = logs.get_logger("stagemesh.stage")


class _Stopped(BaseException):
    """A stop signal before the service's own handling of it (serve.run) was in place."""


def _stop_starting(signum: int, frame: object) -> None:
    raise _Stopped()


async def run_stage(settings: StageSettings) -> None:
    # Until serve.run takes SIGTERM and SIGINT over, a stop ends the start here: the workers
    # spawned so far are killed and the stage exits 0, as a stop while they load does.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_starting)
    early: EarlyWorkers | None = None
    try:
        # Before the spawn: the workers inherit the cache service's token and CA from it.
        worker_startup.export_cache_security(auth.load_token(settings.token_file or None), settings.tls_ca)
        with startup.phase("model folder"):
            prepare_model_dir(settings)  # nothing else runs yet: blocking the loop costs nothing
        early = EarlyWorkers(settings)
        with startup.phase("stage imports"):
            from stagemesh.stage_service import server
        await server.serve_stage(settings, early)
    except _Stopped:
        log.info("stopped while starting")
    finally:
        if early is not None:
            early.close()


def main(args: argparse.Namespace) -> None:
    settings = StageSettings.from_args(args)
    logs.configure(f"stage-{settings.stage_id}", args.log_level)
    startup.begin(f"stage-{settings.stage_id}")
    # An incomplete --model-dir is a refused option (as `stagemesh up --model` treats it); an
    # unreadable checkpoint fails the start.
    serve.main("stage service", run_stage(settings), option_errors=(FolderError,), start_errors=(CheckpointError,))
