"""Bar chart of bench/dlo.py's JSON: step time per image size for the resident model, the
transfer floor, diffusers group offloading and stagemesh DLO (needs matplotlib, a bench-only tool).

Run: python -m bench.plot_dlo bench/results/dlo.json --output docs/img/dlo_flux.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import add_figure_output, pyplot


def _series(rows: list[dict]) -> list[tuple[str, dict[int, dict]]]:
    """(label, size -> row) for each bar of a group, in drawing order."""
    out: list[tuple[str, dict[int, dict]]] = [("resident", {}), ("floor (all blocks streamed)", {})]
    dlo: dict[tuple[int, str], dict[int, dict]] = {}  # (resident blocks, stream dtype) -> size -> row
    peer: dict[int, dict] = {}
    for r in rows:
        if r["case"] == "resident":
            out[0][1][r["size"]] = r
        elif r["case"].startswith("diffusers"):
            peer[r["size"]] = r
        else:
            dlo.setdefault((r["resident_blocks"], r.get("stream_dtype", "")), {})[r["size"]] = r
    # The floor with every block streamed: that of the DLO case with no resident block.
    for r in dlo.get((0, ""), peer).values():
        out[1][1][r["size"]] = {**r, "step_s": r["floor_s"], "ratio": None}
    if peer:
        out.append(("diffusers group offload", peer))
    out += [
        (f"stagemesh DLO{' ' + dtype if dtype else ''}, {n} resident", by_size)
        for (n, dtype), by_size in sorted(dlo.items())
    ]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="bench/dlo.py's JSON result")
    add_figure_output(parser, "docs/img/dlo_flux.png")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    plt = pyplot()
    data = json.loads(Path(args.source).read_text())
    series = _series(data["rows"])
    sizes = sorted({r["size"] for r in data["rows"]})
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(sizes), 3.8))
    for k, (label, by_size) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, s in enumerate(sizes) if s in by_size]
        rows = [by_size[s] for s in sizes if s in by_size]
        bars = ax.bar(xs, [r["step_s"] * 1e3 for r in rows], width, label=label)
        for bar, r in zip(bars, rows):
            if r.get("ratio") is not None:
                ax.annotate(
                    f"{r['ratio']:.2f}×",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(sizes)), [f"{s}²" for s in sizes])
    ax.set_ylabel("step time (ms); label: × floor")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    env = data["environment"]
    params = data["params"]
    size = f"{params / 1e9:.1f} B" if params >= 1e8 else f"{params / 1e6:.1f} M"
    fig.suptitle(
        f"layerwise offload: {data['model']} ({size} params, {data['dtype']})\n"
        f"H2D {data['h2d_bytes_per_s'] / 1e9:.1f} GB/s, {env.get('gpu') or 'cpu'}, "
        f"commit {(env.get('commit') or '?')[:8]}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
