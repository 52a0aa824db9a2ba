"""An interpreter environment in which the `stage` extra is not installed: a meta path finder,
loaded by sitecustomize, makes importing torch (and the other packages only that extra or the
diffusers extra bring) fail as it does where they are absent, in the process and its children."""

from __future__ import annotations

import os
from pathlib import Path

STAGE_EXTRA = ("torch", "safetensors", "diffusers", "transformers", "accelerate")

_SITECUSTOMIZE = '''
import sys

BLOCKED = frozenset({blocked!r})


class _NotInstalled:
    """Ahead of every other finder: these top-level packages (and their submodules) are absent."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def without_stage_extra(folder: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for subprocesses (sitecustomize is found through PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(blocked=tuple(STAGE_EXTRA)))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    return env
