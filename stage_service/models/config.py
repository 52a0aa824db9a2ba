"""Dimensions of the embedded default pipeline (AR text encoder + DiT denoiser + decoder).

The same model classes build every preset; only these numbers change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch at import: a stage checks its folder's config before it imports torch
    import torch

# Byte tokenizer ids: 0..255 are raw UTF-8 bytes.
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB = 259

# The dtypes a config may name (torch's names for them).
DTYPES = ("float32", "bfloat16", "float16")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _strict_kwargs(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Reject unknown keys so a config written by a newer format is not half-read."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    _require(not unknown, f"{cls.__name__}: unknown key(s) {unknown}")
    return dict(data)


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = BYTE_VOCAB
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 512
    decode_tokens: int = 4

    def __post_init__(self) -> None:
        _require(self.vocab_size >= BYTE_VOCAB, f"vocab_size must be >= {BYTE_VOCAB}")
        _require(self.d_model > 0 and self.n_layers > 0, "d_model and n_layers must be > 0")
        _require(self.n_heads > 0 and self.d_model % self.n_heads == 0, "d_model must be divisible by n_heads")
        _require(self.decode_tokens >= 0, "decode_tokens must be >= 0")
        # Room for BOS, at least one prompt byte and every decoded token.
        _require(self.max_seq_len >= self.decode_tokens + 2, "max_seq_len must be >= decode_tokens + 2")

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt length in tokens (BOS included) after truncation."""
        return self.max_seq_len - self.decode_tokens


@dataclass(frozen=True)
class DiTConfig:
    latent_channels: int = 4
    vae_scale: int = 8
    patch_size: int = 2
    hidden_size: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    cond_dim: int = 64
    decoder_channels: int = 32

    def __post_init__(self) -> None:
        positive = (
            self.latent_channels,
            self.vae_scale,
            self.patch_size,
            self.hidden_size,
            self.depth,
            self.num_heads,
            self.cond_dim,
            self.decoder_channels,
        )
        _require(all(v > 0 for v in positive), "DiTConfig sizes must be > 0")
        _require(self.vae_scale & (self.vae_scale - 1) == 0, "vae_scale must be a power of two")
        _require(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        # The 2-D sin/cos position code splits hidden_size into 4 equal parts.
        _require(self.hidden_size % 4 == 0, "hidden_size must be divisible by 4")
        _require(self.mlp_ratio > 0, "mlp_ratio must be > 0")

    @property
    def pixel_multiple(self) -> int:
        """Image width and height must be multiples of this."""
        return self.vae_scale * self.patch_size

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class PipelineConfig:
    lm: LMConfig = field(default_factory=LMConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    weight_seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        # The LM hidden states are the DiT's conditioning tokens.
        _require(
            self.dit.cond_dim == self.lm.d_model,
            f"dit.cond_dim ({self.dit.cond_dim}) must equal lm.d_model ({self.lm.d_model})",
        )
        _require(0 <= self.weight_seed < 2**63, "weight_seed must be in [0, 2**63)")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"lm": asdict(self.lm), "dit": asdict(self.dit), "weight_seed": self.weight_seed, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        data = _strict_kwargs(cls, data)
        lm = LMConfig(**_strict_kwargs(LMConfig, data.pop("lm", {})))
        dit = DiTConfig(**_strict_kwargs(DiTConfig, data.pop("dit", {})))
        return cls(lm=lm, dit=dit, **data)

    @classmethod
    def tiny(cls) -> PipelineConfig:
        """CPU-fast default: the only config with trained weights (shipped in models/trained/;
        they draw coloured shapes at 64 x 64, docs/MODELS.md)."""
        return cls(lm=LMConfig(), dit=DiTConfig())

    @classmethod
    def flux_sized(cls) -> PipelineConfig:
        """A ~12B-parameter DiT in the size class of FLUX.1, for offload and memory benchmarks."""
        lm = LMConfig(d_model=1024, n_layers=4, n_heads=16)
        dit = DiTConfig(
            latent_channels=16,
            hidden_size=3072,
            depth=57,
            num_heads=24,
            mlp_ratio=4.0,
            cond_dim=1024,
            decoder_channels=128,
        )
        return cls(lm=lm, dit=dit, dtype="bfloat16")
