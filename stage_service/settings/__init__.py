"""The stage's settings, the bottom of the stage service: every room reads them and they import
nothing of the service, nor torch (the CLI and `stagemesh up` read them too).

`StageSettings` (stage.py) holds every option of a stage, the DLO ones from `DloOptions` (dlo.py).
"""

from stagemesh.stage_service.settings.dlo import DEFAULT_RUNTIME_CACHE_DIR, STREAM_DTYPES, DloOptions
from stagemesh.stage_service.settings.stage import (
    HEARTBEAT_S,
    IMAGE_PARALLEL_KINDS,
    KINDS,
    PRESETS,
    SLEEP_HOST_BUFFERS,
    StageSettings,
)

__all__ = [
    "DEFAULT_RUNTIME_CACHE_DIR",
    "HEARTBEAT_S",
    "IMAGE_PARALLEL_KINDS",
    "KINDS",
    "PRESETS",
    "SLEEP_HOST_BUFFERS",
    "STREAM_DTYPES",
    "DloOptions",
    "StageSettings",
]
