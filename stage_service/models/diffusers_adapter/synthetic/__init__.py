"""Diffusers-format folders with random weights, built offline from diffusers' and transformers'
own classes and written with `save_pretrained`: a tiny pipeline of each family for CPU tests
(`write_tiny`), one module per family. Tokenizers are made here from small vocabularies (no
download).
"""

from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import (
    FLUX_VAE,
    TINY_FLUX,
    TINY_VAE,
    flux_components,
    sd3_components,
)
from stagemesh.stage_service.models.diffusers_adapter.synthetic.tiny import TINY_FAMILIES, write_pipeline, write_tiny

__all__ = [
    "FLUX_VAE",
    "TINY_FAMILIES",
    "TINY_FLUX",
    "TINY_VAE",
    "flux_components",
    "sd3_components",
    "write_pipeline",
    "write_tiny",
]
