#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels a bare GPU machine (Python 3.12, its own torch)
# needs to run the tests in tests/gpu and the benchmarks (python -m bench.NAME). Install them there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# transformers and tokenizers as here (the machine's own are older) for python -m bench.real_pipeline;
# peft for bench.lora; OpenTelemetry for bench.investigations.resident_gap (a traced mesh).
# The generated stubs need grpcio/protobuf at least as new as the generator (grpcio-tools 1.85.1).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl \
  structlog==26.1.0 grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
  grpcio-reflection==1.85.1 grpcio-status==1.85.3 googleapis-common-protos==1.76.0 \
  diffusers==0.42.1 accelerate==1.15.0 transformers==5.24.0 tokenizers==0.23.3 peft==0.21.2 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
ls -1 .whl
