"""FP8 compute: the Linear layers of a transformer's repeated blocks as FP8 matmuls.

Weights are quantised once, per output row (float8_e4m3fn, one float32 scale per row: the row's
largest magnitude maps to the format's largest value); activations are quantised on every call,
per token (per row of the flattened input). The product runs as `torch._scaled_mm` with rowwise
scales (CUDA, compute capability 8.9 or newer), or, with the 'torchao' back end, as torchao's
Float8DynamicActivationFloat8WeightConfig(PerRow) tensors. Inside a compiled block the activation
quantisation fuses with the ops around it.

Only layers whose both dimensions are multiples of 16 (what the FP8 kernels take) and that sit in
the repeated blocks are converted: the embedders and the final projection keep the checkpoint's
dtype, as the published FP8 recipes do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagemesh.stage_service.models.acceleration.compile import repeated_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
ALIGN = 16  # both dimensions of an FP8 matmul's operands
MIN_CAPABILITY = (8, 9)
_EPS = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8 [..., K], float32 scales [..., 1]) with x ~ q * scale, one scale
    per row; an all-zero row gets scale 1/FP8_MAX (any positive value would do)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=_EPS)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def selected_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(qualified name, layer) of every Linear the FP8 path converts: in a repeated block, both
    dimensions multiples of ALIGN."""
    inside = {id(m) for block in repeated_blocks(model) for m in block.modules()}
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) in inside and m.in_features % ALIGN == 0 and m.out_features % ALIGN == 0
    ]


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8 with per-row scales; computes in FP8 with per-token
    activation scales and returns the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] float8
        self.weight_scale = nn.Parameter(scale.reshape(1, -1), requires_grad=False)  # [1, out] float32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        q, scale = quantize_rows(rows)
        # The kernel adds a bias only into a 16-bit output; a float32 model adds its own after.
        fused_bias = self.bias is not None and x.dtype != torch.float32
        out = torch._scaled_mm(
            q,
            self.weight.t(),  # column-major, as the kernel wants its second operand
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias.to(x.dtype) if fused_bias and self.bias is not None else None,
            out_dtype=x.dtype,
        )
        if self.bias is not None and not fused_bias:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the FP8 matmul multiplies by, in float32 (what tests compare against)."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def reference_linear(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What Fp8Linear computes, in float32 on any device: quantised activations times the
    quantised weight (the FP8 kernel accumulates in float32 too)."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (q.float() * scale) @ layer.dequantized_weight().t()
    if layer.bias is not None:
        out = out + layer.bias.float()
    return out.reshape(*x.shape[:-1], layer.out_features)


def check_device(device: str | torch.device) -> None:
    """Refuse a device FP8 matmuls cannot run on, naming it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"compute_dtype = 'float8' on {dev}: FP8 matmuls need a CUDA GPU (compute capability 8.9+)")
    capability = torch.cuda.get_device_capability(dev)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"compute_dtype = 'float8' on {torch.cuda.get_device_name(dev)} (compute capability "
            f"{capability[0]}.{capability[1]}): FP8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell); "
            "leave compute_dtype unset"
        )


def _set_child(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert(model: nn.Module, backend: str = "scaled_mm") -> int:
    """Convert the selected Linear layers in place; returns how many. 'scaled_mm': Fp8Linear;
    'torchao': torchao's dynamic-activation FP8 with per-row scales on the same layers."""
    chosen = selected_linears(model)
    if backend == "scaled_mm":
        for name, layer in chosen:
            _set_child(model, name, Fp8Linear(layer))
        return len(chosen)
    if backend == "torchao":
        return _convert_torchao(model, {id(layer) for _, layer in chosen})
    raise ValueError(f"fp8_backend = {backend!r}: allowed: scaled_mm, torchao")


def _convert_torchao(model: nn.Module, chosen: set[int]) -> int:
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    if dtypes - {"bfloat16"}:
        raise ValueError(
            f"fp8_backend = 'torchao' on a model of {sorted(dtypes)} weights: its per-row FP8 takes bfloat16 "
            "weights only; serve a bfloat16 checkpoint or use fp8_backend = 'scaled_mm'"
        )

    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as exc:
        raise RuntimeError(
            f"fp8_backend = 'torchao' needs torchao: pip install 'stagemesh[fp8]' ({exc}); "
            "or use fp8_backend = 'scaled_mm'"
        ) from None

    def selected(module: nn.Module, _name: Any) -> bool:
        return id(module) in chosen

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=selected)
    return len(chosen)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two outputs, flattened, in float64 (the bench's fidelity figure)."""
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))
