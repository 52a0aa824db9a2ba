"""Worker processes spawned at the stage's start, before its own heavy imports.

A stage used to import grpc, torch and its engine, bind its port, and only then spawn its
workers, which import torch again: two interpreter starts one after the other. Spawned here,
from the light entry (stage_service/entry.py) right after the model folder is checked, the
workers import and load while the stage imports; the executor adopts the groups when it is
built. What no executor adopted (the stage failed first) is killed by `close`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from stagemesh.core import logs
from stagemesh.stage_service.executor import worker_startup
from stagemesh.stage_service.executor.group import WorkerGroup, WorkerProcess, build_groups
from stagemesh.stage_service.settings import StageSettings

log = logs.get_logger("stagemesh.executor")


class EarlyWorkers:
    """Every group of the stage, its processes started; `at`: when the first was spawned."""

    def __init__(self, settings: StageSettings) -> None:
        self.at = time.time()
        self.groups: list[WorkerGroup] = build_groups(settings, os.getpid())
        self._taken = False
        ctx = mp.get_context("spawn")
        try:
            for g in self.groups:
                for spec in g.fresh_specs(worker_startup.READY_TIMEOUT_S):
                    process, requests, results = worker_startup.spawn(ctx, spec)
                    g.workers.append(WorkerProcess(spec, process, requests, results, group=g.index))
                    log.info("worker started", rank=spec.rank, pid=process.pid, early=True)
        except BaseException:
            self.close()
            raise

    def take(self) -> list[WorkerGroup]:
        """The groups, for the executor: from here on it owns the processes."""
        self._taken = True
        return self.groups

    def close(self) -> None:
        """Kill what no executor took (the stage failed before it built one), with its queues;
        of adopted groups, kill only a process still alive (the stage failed before its
        executor was started or shut down: a normal stop has stopped them already)."""
        for g in self.groups:
            for w in g.workers:
                if w.process.is_alive():
                    w.process.kill()
                w.process.join(worker_startup.JOIN_TIMEOUT_S)
                if not self._taken:
                    w.requests.cancel_join_thread()
                    w.requests.close()
                    w.results.close()
            if not self._taken:
                g.workers = []
