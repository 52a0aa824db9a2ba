"""A request's input tensors checked against what the stage's runner declares it takes, on the
wire form and before admission: a malformed request is refused alone, naming `inputs[name]`,
instead of failing the batch it would have joined (or taking a step seconds long)."""

from __future__ import annotations

from collections.abc import Mapping

from stagemesh.core import errors
from stagemesh.core.params import INIT_IMAGE_INPUT, InitImage
from stagemesh.stage_service.models.contract import TensorSpec
from stagemesh.v1 import tensor_pb2

_FLOATING = ("float32", "float16", "bfloat16", "float64")
_INIT_IMAGE_FIELD = f"inputs[{INIT_IMAGE_INPUT}]"


def check_inputs(inputs: Mapping[str, tensor_pb2.Tensor], specs: Mapping[str, TensorSpec] | None) -> None:
    """Raise InvalidArgument naming every input that is missing, unknown or of the wrong shape or
    dtype. `specs` None: the runner did not declare its inputs and checks them itself."""
    if specs is None:
        return
    violations = [
        errors.FieldViolation(f"inputs[{name}]", f"this stage takes no such input; it takes: {sorted(specs) or 'none'}")
        for name in sorted(set(inputs) - set(specs))
    ]
    violations += [
        errors.FieldViolation(f"inputs[{name}]", "missing")
        for name in sorted(set(specs) - set(inputs))
        if specs[name].required
    ]
    for name in sorted(set(specs) & set(inputs)):
        problem = _mismatch(inputs[name], specs[name])
        if problem:
            violations.append(errors.FieldViolation(f"inputs[{name}]", problem))
    if violations:
        raise errors.InvalidArgument(violations)


def init_image(inputs: Mapping[str, tensor_pb2.Tensor], supported: bool) -> InitImage | None:
    """The starting image's size, checked to be what the gateway sends (uint8 [height, width, 3]);
    None when the request has none. Width and height are then checked against the limits and the
    request's own size with the other parameters (core.params.resolve)."""
    tensor = inputs.get(INIT_IMAGE_INPUT)
    if tensor is None:
        return None
    if not supported:
        raise errors.InvalidArgument.field(_INIT_IMAGE_FIELD, "this stage's model cannot start from an image")
    shape = list(tensor.shape)
    if tensor.dtype != "uint8" or len(shape) != 3 or shape[2] != 3 or min(shape) < 1:
        raise errors.InvalidArgument.field(
            _INIT_IMAGE_FIELD, f"dtype {tensor.dtype!r} shape {shape}; allowed: uint8 [height, width, 3] (RGB)"
        )
    return InitImage(width=shape[1], height=shape[0])


def _mismatch(tensor: tensor_pb2.Tensor, spec: TensorSpec) -> str:
    wanted = "[" + ", ".join("N" if s is None else str(s) for s in spec.sizes) + "]"
    shape = list(tensor.shape)
    if len(shape) != len(spec.sizes):
        return f"shape {shape} has {len(shape)} dimensions; allowed: {wanted}"
    for got, size in zip(shape, spec.sizes):
        if size is not None and got != size:
            return f"shape {shape}; allowed: {wanted}"
        if size is None and not 1 <= got <= spec.max_size:
            return f"shape {shape}; allowed: {wanted} with N from 1 to {spec.max_size}"
    if spec.floating and tensor.dtype not in _FLOATING:
        return f"dtype {tensor.dtype!r}; allowed: {list(_FLOATING)}"
    return ""
