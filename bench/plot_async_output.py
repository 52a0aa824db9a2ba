"""Plot QPS vs resolution from bench/async_output.py's JSON (needs matplotlib, a bench-only tool).

Run: python -m bench.plot_async_output bench/results/async_output.json --output docs/img/async_output_qps.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import add_figure_output, pyplot


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="bench/async_output.py's JSON result")
    add_figure_output(parser, "docs/img/async_output_qps.png")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    plt = pyplot()
    data = json.loads(Path(args.source).read_text())
    points = data["points"]
    batches = sorted({p["batch"] for p in points})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = sorted((p for p in points if p["batch"] == batch), key=lambda p: p["size"])
        sizes = [p["size"] for p in rows]
        for key, label, style in (
            ("forward_rps", "(a) forward-only, synchronized per pass", "k--"),
            ("pipelined_forward_rps", "(e) forward-only, pipelined (device rate)", "k:"),
            ("sync_qps", "(b) async off (step_execution)", "o-"),
            ("async_qps", "(c) async on", "s-"),
        ):
            if key in rows[0]:  # (e) since commit e6d269f
                ax.plot(sizes, [p[key] for p in rows], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("resolution (pixels per side)")
        ax.set_ylabel("requests / s")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    env = data["environment"]
    fig.suptitle(f"async output, {env.get('gpu') or 'cpu'}, commit {env.get('commit')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
