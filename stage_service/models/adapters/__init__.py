"""LoRA adapters on a diffusers transformer, chosen per batch.

Adapters are peft's unfused low-rank layers, added through diffusers' own loader
(`transformer.load_lora_adapter` over what `pipe.lora_state_dict` converted) and switched with
`set_adapters`: the base weights are never rewritten, so switching reloads nothing and a compiled
transformer keeps its graph. `files` reads and checks an adapter file; `registry` holds a
worker's adapters, applies a batch's set and keeps at most `max_device_adapters` on the device.
"""

from stagemesh.stage_service.models.adapters.files import AdapterFileError, discover, resolve_source
from stagemesh.stage_service.models.adapters.registry import AdapterRegistry, UnknownAdapter, control_ops, for_runner

__all__ = [
    "AdapterFileError",
    "AdapterRegistry",
    "UnknownAdapter",
    "control_ops",
    "discover",
    "for_runner",
    "resolve_source",
]
