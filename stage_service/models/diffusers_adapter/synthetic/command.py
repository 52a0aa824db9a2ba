"""`stagemesh synthesize`: a random-weight folder of a family, tiny or at published size."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from stagemesh.stage_service.models.diffusers_adapter.synthetic.tiny import TINY_FAMILIES, write_tiny


def synthesize(args) -> int:
    """`stagemesh synthesize`: write a random-weight folder of a family, tiny or full size."""
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()):
        print(f"stagemesh synthesize: {out} exists and is not empty; give a new folder", file=sys.stderr)
        return 2
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import FULL_SIZE_FAMILIES

    if args.size == "full" and args.family not in FULL_SIZE_FAMILIES:
        print(
            f"stagemesh synthesize: --size full of --family {args.family} is not available; "
            f"allowed: --size tiny, or --size full with one of {', '.join(FULL_SIZE_FAMILIES)}",
            file=sys.stderr,
        )
        return 2
    if args.size == "tiny":
        write_tiny(out, args.family, args.seed)
    else:
        from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import write_full

        dtype = getattr(torch, args.dtype)
        write_full(out, args.family, dtype, args.seed, args.text_layers, report=lambda line: print(line, flush=True))
    print(f"{out}: {TINY_FAMILIES[args.family][0]} ({args.size}, random weights)")
    return 0
