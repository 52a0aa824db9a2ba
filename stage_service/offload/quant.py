"""8-bit weight streaming: streamed blocks' Linear weights stored and copied in 8 bits.

Each Linear weight of a streamed block is quantised once, at load, per output channel (row), in
one of two formats (`dlo_stream_dtype`):
  - float8_e4m3fn: scale = max|row| / 448 (e4m3's largest finite value), q = w / scale rounded
    to the nearest e4m3 value: a floating format, so each element keeps 3 mantissa bits
    (relative error up to 1/16; 2.6 % RMS on a Gaussian row of 3072);
  - int8: scale = max|row| / 127, q = round(w / scale) in [-127, 127]: a uniform grid, absolute
    error up to scale / 2 (0.85 % RMS on the same row, a third of e4m3's: without outliers
    inside a row, the grid's 254 steps beat e4m3's 3 mantissa bits).
Scales are stored in bfloat16, rounded up so no element leaves the range. Biases, norm weights
and every other tensor stay in the model's dtype. On the device the block is rebuilt in its slot
in the model's dtype before it runs: the other tensors are copied as they are, and each weight is
`q * scale` (every e4m3 value and every integer up to 127 is exact in bfloat16, so one
rounding), in one pass on a GPU (dequant.py). Rebuilding runs on the engine's second stream, so
it overlaps the next blocks' host-to-device copies and the previous block's compute (docs/DLO.md,
"8-bit weight streaming").

A block's stream layout: the slot layout's head (every tensor that is not quantised, byte for
byte), then each weight's 8-bit bytes and its scales, 256-byte aligned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from stagemesh.stage_service.offload import dequant
from stagemesh.stage_service.offload.layout import BlockLayout, Entry, align_up, byte_view, pack_range
from stagemesh.stage_service.offload.plan import OffloadPlan, discover, pick_resident
from stagemesh.stage_service.settings import STREAM_DTYPES

FLOAT8 = torch.float8_e4m3fn
INT8 = torch.int8
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0  # symmetric: -128 is never used, so -q is always representable
_RANGE = {FLOAT8: FP8_MAX, INT8: INT8_MAX}
_BY_NAME = {"float8_e4m3fn": FLOAT8, "int8": INT8}
SCALE_DTYPE = torch.bfloat16
# Name of a weight's scales next to its 8-bit tensor (runtime-cache entries). A parameter named
# "weight" cannot also be a module, so no real tensor is called "<...>.weight.fp8_scale".
_SCALE_SUFFIX = {FLOAT8: ".fp8_scale", INT8: ".int8_scale"}
_QUANTIZABLE = (torch.bfloat16, torch.float16, torch.float32)

Quantized = tuple[torch.Tensor, torch.Tensor]  # (8-bit weight, one scale per output channel)


def stream_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a `dlo_stream_dtype` value; None streams the model's own dtype."""
    if name not in STREAM_DTYPES:
        raise ValueError(f"dlo_stream_dtype must be one of {list(STREAM_DTYPES)}, got {name!r}")
    return _BY_NAME[name] if name else None


def dtype_name(dtype: torch.dtype | None) -> str:
    """The `dlo_stream_dtype` value of a torch dtype ("" for None)."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def check_stream_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _RANGE:
        raise ValueError(f"stream_dtype must be None (as stored), torch.float8_e4m3fn or torch.int8, got {dtype}")


def scale_name(name: str, dtype: torch.dtype) -> str:
    """The runtime-cache name of the scales of weight `name` quantised to `dtype`."""
    return name + _SCALE_SUFFIX[dtype]


def quantizable(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """A Linear's weight matrix in a floating dtype wider than 8 bits."""
    return isinstance(module, nn.Linear) and name == "weight" and tensor.dim() == 2 and tensor.dtype in _QUANTIZABLE


def refuse_float8_blocks(layouts: list[BlockLayout], dtype: torch.dtype) -> None:
    """8-bit streaming of a model that already holds float8 block tensors is refused."""
    for layout in layouts:
        for e in layout.entries:
            if e.dtype.is_floating_point and e.dtype.itemsize == 1:
                raise ValueError(
                    f"dlo_stream_dtype = {dtype_name(dtype)!r} on a model already in 8-bit floats "
                    f"({e.qualname} is {dtype_name(e.dtype)}): stream it as stored "
                    "(leave dlo_stream_dtype unset)"
                )


def quantize_rows(
    weight: torch.Tensor, work_device: str | torch.device = "cpu", dtype: torch.dtype = FLOAT8
) -> Quantized:
    """(q, scale) of a 2-D weight in `dtype` (FLOAT8 or INT8), computed on `work_device` in
    float32 and returned on the host."""
    check_stream_dtype(dtype)
    top = _RANGE[dtype]
    w = weight.detach().to(work_device, torch.float32)
    exact = w.abs().amax(dim=1) / top
    scale = exact.to(SCALE_DTYPE)
    # Round up, so that |w| / scale <= top for every element of the row: the next bfloat16 above
    # a positive one is its bit pattern plus one (integer arithmetic works on every device).
    above = (scale.view(torch.int16) + 1).view(SCALE_DTYPE)
    scale = torch.where(scale.float() < exact, above, scale)
    scale = torch.where(exact > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    scaled = w / scale.float().unsqueeze(1)
    if dtype == INT8:
        scaled.round_()  # to nearest, ties to even
    q = scaled.clamp_(-top, top).to(dtype)
    return q.cpu(), scale.cpu()


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """out = q * scale per row, in out's dtype, with no temporary (one pass on a GPU: dequant.py)."""
    dequant.dequantize_into(out, q, scale)


@dataclass(frozen=True)
class _Span:
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Weight:
    slot: Entry  # where the rebuilt weight goes in the slot
    q: _Span  # its 8-bit bytes in the stream layout
    scale: _Span


class QuantizedLayout:
    """One block as stored on the host and copied: the slot layout's head as it is, then each
    tail weight in `dtype` (FLOAT8 or INT8) + scales. `given`: weights already quantised (a
    runtime-cache entry), by qualified name; else they are quantised from the block's tensors on
    `work_device` each time `sources()` is called (once, by the store that packs them)."""

    def __init__(
        self,
        slot: BlockLayout,
        work_device: str | torch.device,
        given: Mapping[str, Quantized] | None = None,
        dtype: torch.dtype = FLOAT8,
    ) -> None:
        check_stream_dtype(dtype)
        self.dtype = dtype
        self.slot = slot
        self.path = slot.path
        self.module = slot.module
        self.entries = slot.entries
        self.work_device = torch.device(work_device)
        self.given = given
        self.weights: list[_Weight] = []
        offset = slot.head_nbytes
        for e in slot.tail:
            q = _Span(align_up(offset), e.nbytes // e.dtype.itemsize)
            scale = _Span(align_up(q.offset + q.nbytes), e.shape[0] * SCALE_DTYPE.itemsize)
            self.weights.append(_Weight(e, q, scale))
            offset = scale.offset + scale.nbytes
        self.nbytes = offset
        if given is not None:
            for w in self.weights:
                _check_given(w.slot, given.get(w.slot.qualname), dtype)

    def needs_values(self) -> bool:
        head = [e for e in self.entries if e.offset < self.slot.head_nbytes]
        if any(e.current().is_meta for e in head):
            return True
        return self.given is None and any(w.slot.current().is_meta for w in self.weights)

    def quantized(self) -> dict[str, Quantized]:
        """Each tail weight's (q, scale), by qualified name."""
        if self.given is not None:
            return {w.slot.qualname: self.given[w.slot.qualname] for w in self.weights}
        return {w.slot.qualname: quantize_rows(w.slot.current(), self.work_device, self.dtype) for w in self.weights}

    def sources(self) -> list[tuple[_Span | Entry, torch.Tensor]]:
        head = self.slot.sources(upto=self.slot.head_nbytes)
        quantized = self.quantized()
        tail: list[tuple[_Span | Entry, torch.Tensor]] = []
        for w in self.weights:
            q, scale = quantized[w.slot.qualname]
            tail += [(w.q, byte_view(q)), (w.scale, byte_view(scale))]
        return [*head, *tail]

    def pack_range(self, sources, lo: int, hi: int, out: torch.Tensor, non_blocking: bool = False) -> None:
        pack_range(sources, lo, hi, out, non_blocking)

    def bind_packed(self, host: torch.Tensor) -> None:
        """The packed copy is not in the block's dtype: the block's tensors become placeholders
        until the engine binds them to a slot, so its private copies are released."""
        self.slot.bind([placeholder(e.shape, e.dtype) for e in self.entries])

    def expand(self, packed: torch.Tensor, slot: torch.Tensor) -> None:
        """Rebuild the block in `slot` (uint8, the slot layout) from `packed` (uint8, this
        layout) on the current stream."""
        head = self.slot.head_nbytes
        if head:
            slot[:head].copy_(packed[:head])
        for w in self.weights:
            e = w.slot
            out = slot[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            q = packed[w.q.offset : w.q.offset + w.q.nbytes].view(self.dtype).view(e.shape)
            scale = packed[w.scale.offset : w.scale.offset + w.scale.nbytes].view(SCALE_DTYPE)
            dequantize_into(out, q, scale)


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `shape` holding one element (a stride-0 view): stands in for a weight
    whose values live elsewhere. Not "meta": a parameter cannot move between meta and a device."""
    return torch.zeros((), dtype=dtype).expand(shape)


def _check_given(e: Entry, pair: Quantized | None, dtype: torch.dtype) -> None:
    if pair is None:
        raise ValueError(f"{e.qualname}: no quantised weight given for a streamed Linear weight")
    q, scale = pair
    rows = e.shape[0]
    if tuple(q.shape) != e.shape or q.dtype != dtype or tuple(scale.shape) != (rows,) or scale.dtype != SCALE_DTYPE:
        raise ValueError(
            f"{e.qualname}: given {tuple(q.shape)} {q.dtype} with scales {tuple(scale.shape)} {scale.dtype}, "
            f"expected {e.shape} {dtype} with ({rows},) {SCALE_DTYPE}"
        )


def quantized_specs(
    model: nn.Module, resident_layers: int = 0, plan: OffloadPlan | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Qualified name -> (shape, dtype) of every weight an engine with these options streams
    in 8 bits (no AllGather): the Linear weights of the blocks that are not resident. Works on a
    model built on "meta"."""
    found = discover(model, plan)
    kept = {b.path for b in pick_resident(found, resident_layers, 1)}
    out = {}
    for block in found.blocks:
        if block.path not in kept:
            for e in BlockLayout(block.module, block.path, tail=quantizable).tail:
                out[e.qualname] = (e.shape, e.dtype)
    return out
