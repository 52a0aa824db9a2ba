#!/usr/bin/env bash
# Creates .venv (once) with a pinned torch first, then stagemesh with its test extra (which brings
# the stage extra: torch, safetensors) and dev (lint, type-check) extras; again whenever
# pyproject.toml is newer than the last install.
# Sourced by scripts/up and scripts/test, so each works on a fresh machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STAGEMESH_VENV:-$ROOT/.venv}"
STAMP="$VENV/.stagemesh-installed"
if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The pin is the version of the local torch wheel this machine's pip finds (a CPU build), so
  # the install takes it without a download. From a plain package index the same pin is the
  # multi-GB CUDA build; pick another version (or index) with STAGEMESH_TORCH_VERSION.
  "$VENV/bin/python" -m pip install -q "torch==${STAGEMESH_TORCH_VERSION:-2.13.0}"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,dev]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
