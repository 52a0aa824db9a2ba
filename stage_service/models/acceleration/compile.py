"""Regional compilation of a denoising transformer, with its compiled code kept on disk.

"Regional": each of the transformer's repeated blocks (the classes diffusers lists in the model
class's `_repeated_blocks`; the embedded DiT lists its own) has its `forward` compiled with
torch.compile. All blocks of a class share one compiled graph (torch inlines the module and takes
its parameters as graph inputs), so a 57-block FLUX compiles two graphs, not 57, and the weights
may move (sleep, DLO slots) without a recompile: the guards check the tensors' shapes, dtypes and
devices, not their addresses.

Diffusers' own `compile_repeated_blocks` compiles each block's whole module call, hooks included.
Compiling `forward` instead keeps the hooks outside the graph: DLO's forward pre-hooks (which point
a block's parameters at its device slot) and diffusers' step-cache hooks (which decide on the host
whether a block runs) stay plain Python around compiled code, and the kernels are the same.

The compiled artifacts (inductor's FX graph and AOTAutograd caches, Triton's kernels) are written
under `<root>/compile/<key>/`, where the key hashes the torch and Triton versions, the GPU, the
model's layout (class, config, every weight's name, shape and dtype) and the options that change
the graph. A restarted stage, or a second one on the node, with the same key loads them instead
of compiling: it still traces the blocks (seconds), but runs no inductor or Triton compile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.weight_store.store import CacheStore

log = logs.get_logger("stagemesh.compile")

COMPILE_DIR = "compile"  # under the node-local cache root (dlo_runtime_cache_dir)
KEY_FILE = "key.json"  # what the key hashes, beside the artifacts: for people, never read back
# Bumped when what is stored under a key changes meaning.
LAYOUT_VERSION = 1
_COMPILED = "_stagemesh_compiled_forward"


# Models whose class declares no `_repeated_blocks` (diffusers 0.42's SD3): their blocks by class.
DECLARED_BLOCKS = {"SD3Transformer2DModel": ("JointTransformerBlock",)}


def repeated_block_classes(model: nn.Module) -> tuple[str, ...]:
    """The class names of the model's repeated blocks: diffusers' `_repeated_blocks` (on its
    models and the embedded DiT alike), else DECLARED_BLOCKS; empty when neither names any."""
    declared = tuple(getattr(model, "_repeated_blocks", None) or ())
    return declared or DECLARED_BLOCKS.get(type(model).__name__, ())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    names = set(repeated_block_classes(model))
    return [m for m in model.modules() if type(m).__name__ in names]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def model_layout(model: nn.Module) -> dict[str, Any]:
    """What of the model the compiled code depends on: its class, its config and every tensor's
    name, shape and dtype (not the values)."""
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, dict):
        config = getattr(config, "__dict__", repr(config))
    tensors = [
        [name, list(t.shape), str(t.dtype)]
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not name.startswith("_")
    ]
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": _jsonable(config),
        "tensors": tensors,
    }


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return str(getattr(triton, "__version__", ""))


def device_identity(device: str | torch.device) -> str:
    """The GPU's name and compute capability (kernels are tuned per GPU); 'cpu' for the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"


def key_material(model: nn.Module, device: str | torch.device, options: dict[str, Any]) -> dict[str, Any]:
    return {
        "layout_version": LAYOUT_VERSION,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": device_identity(device),
        "model": model_layout(model),
        "options": _jsonable(options),
    }


def cache_key(material: dict[str, Any]) -> str:
    """A hex digest of `material` (key_material's): equal exactly when the compiled code can be shared."""
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def use_cache_dir(root: str | Path, material: dict[str, Any]) -> Path:
    """Point inductor (and Triton, whose cache lives inside inductor's) at `root/compile/<key>/`
    for this process, before anything is compiled. A process serves one model: the variable is
    the process's to set."""
    store = CacheStore(Path(root).expanduser())
    store.ensure_root()  # created private, or refused (owner, mode) as the cache service would
    path = store.root / COMPILE_DIR / cache_key(material)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    described = path / KEY_FILE
    if not described.exists():
        temp = path / f".{KEY_FILE}.{os.getpid()}"
        temp.write_text(json.dumps(material, sort_keys=True, indent=1))
        temp.replace(described)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.pop("TRITON_CACHE_DIR", None)  # inside inductor's, so it is keyed too
    return path


def compile_blocks(model: nn.Module, fullgraph: bool = True, **compile_options: Any) -> int:
    """Compile every repeated block's `forward` in place; returns how many blocks. A block
    already compiled is left as it is. `fullgraph=False` lets a block with collectives inside
    (sequence parallelism) break its graph around them instead of failing."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"compile = 'regional': {type(model).__name__} declares no repeated blocks (_repeated_blocks); "
            "set compile = 'off'"
        )
    count = 0
    for block in blocks:
        if getattr(block, _COMPILED, False):
            continue
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, **compile_options)
        setattr(block, _COMPILED, True)
        count += 1
    return count


def compile_counters() -> dict[str, int]:
    """This process's compile activity: graphs compiled, and inductor's FX-graph cache hits and
    misses (a hit loads compiled code from disk instead of compiling)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "fxgraph_cache_hit": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
        "fxgraph_cache_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
    }
