"""The gateway's own Prometheus readings: admission and the stages' sleep levels.

Readers run on the metrics HTTP server's thread at scrape time and only read plain attributes
of the domain objects.
"""

from __future__ import annotations

from stagemesh.core.metrics import Reader, Reading
from stagemesh.gateway.control import Admission


def gateway_readings(admission: Admission, stage_count: int) -> Reader:

    def read() -> list[Reading]:
        sleeping = dict(admission.sleeping)
        out = [
            Reading(
                "stagemesh_gateway_generation_paused",
                "1 while admission is closed (PauseGeneration, or a Sleep until Resume)",
                int(admission.paused),
            ),
            Reading(
                "stagemesh_gateway_admission_open",
                "1 when a Generate would be admitted now",
                int(not admission.paused and not sleeping),
            ),
        ]
        out += [
            Reading(
                "stagemesh_gateway_stage_sleep_level",
                "sleep level of each stage as the gateway knows it",
                sleeping.get(i, 0),
                (("stage_id", str(i)),),
            )
            for i in range(stage_count)
        ]
        return out

    return read
