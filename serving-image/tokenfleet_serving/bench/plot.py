"""Pictures of benchmark results: the ``--plot FILE.png`` of every ``tokenfleet bench`` command.

Each benchmark draws its own axes from its result dict (so a picture can be redrawn from a saved --json file) with
these helpers: ``figure`` (panels stacked in one picture, matplotlib's non-interactive Agg backend), and ``save``
(which writes the PNG with a footnote saying on what hardware and under what load it was measured, as every
result table must). matplotlib is imported only when a picture is asked for; the serving image does not ship it.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib, or the project's dev extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def add_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """The common --plot flag; ``what`` says what the picture shows."""
    parser.add_argument("--plot", metavar="FILE.png", help=f"draw {what} into FILE.png (matplotlib)")


def figure(panels: int, title: str, *, columns: int = 1, width: float = 9.0, panel_height: float = 3.3,
           sharex: bool = False) -> tuple[Any, list[Any]]:
    """A figure of ``panels`` axes in ``columns`` columns, and the axes as a flat list."""
    plt = pyplot()
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width, panel_height * rows + 0.6), sharex=sharex, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    return fig, flat[:panels]


def where_measured(hardware: dict[str, Any] | None) -> str:
    """One line: the CPU, cores and load average a result was measured with."""
    hw = hardware or {}
    cpu = hw.get("cpu") or hw.get("model") or hw.get("cpu_model") or "unknown CPU"
    cores = hw.get("cores") or hw.get("logical_cpus") or os.cpu_count()
    parts = [str(cpu), f"{cores} cores"]
    if hw.get("isa") or hw.get("isa_level"):
        parts.append(str(hw.get("isa") or hw.get("isa_level")))
    loads = [f"{hw[k]:.1f}" for k in ("loadavg_1m_start", "loadavg_1m", "loadavg_1m_end") if isinstance(hw.get(k), int | float)]
    if loads:
        parts.append("1-min load average " + " -> ".join(loads))
    return ", ".join(parts)


def save(fig: Any, path: str | Path, hardware: dict[str, Any] | None) -> Path:
    """Write the picture with a footnote on where it was measured; returns the path."""
    plt = pyplot()
    fig.text(0.01, 0.005, "measured on: " + where_measured(hardware), fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
