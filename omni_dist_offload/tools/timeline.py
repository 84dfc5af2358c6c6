"""Charts for the benchmark: overhead per case and variant, and one forward as a block timeline.

Both draw on a bare matplotlib ``Figure`` (Agg), never through ``pyplot``: no global backend or
figure state changes, so the library can draw inside any program. matplotlib is the optional
``bench`` extra (``pip install -e ".[bench]"``).

The timeline takes ``OffloadHandle.trace_report()`` as it is: per ring, one lane for compute and
one for copies (host-to-device, or shard copy plus all-gather), a bar per block labelled with its
index, and the exposed waits (compute standing still until a block's bytes arrive) in red on the
compute lane. Times are ms from the forward's first block; a copy that starts before 0 was
prefetched during the previous forward (block 0, by the last block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["draw_overhead", "draw_timeline", "image_formats"]

_COLORS = {"peer": "#9e9e9e", "rank-local": "#1f77b4", "allgather": "#2ca02c"}
#: The other variants' colours, given out in the order they appear (matplotlib's tab20, less the
#: colours above and the red of the exposed waits).
_MORE_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78",
                "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#ff9896", "#7f7f7f")
_COMPUTE = ("#4c72b0", "#7fa3d6")  # alternating, so neighbouring blocks stay distinct
_COPY = ("#dd8452", "#f0b27a")
_WAIT = "#d62728"


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure  # optional: the bench extra
    except ImportError:
        raise ImportError("drawing benchmark charts needs matplotlib: pip install -e '.[bench]'") from None
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def image_formats() -> list[str]:
    """The suffixes (no dot, lower case) of the files a chart can be saved as: ``savefig`` picks
    the format by the path's suffix, and saves a path without one as PNG."""
    from matplotlib.backend_bases import FigureCanvasBase  # optional: the bench extra
    return sorted(FigureCanvasBase.get_supported_filetypes())


def draw_overhead(results: Sequence[Any], path: str | Path, title: str = "") -> Path:
    """Bars of overhead (forward / resident) per case, one per variant that is not resident
    (every variant the run measured, in its order), each with its floor marked and its value
    written above it; with ``--stagger`` rows (a ``rank``), one group of bars per case and rank.
    ``results`` are ``bench.CaseResult``s."""
    cases = list(dict.fromkeys(_case(r) for r in results))
    variants = list(dict.fromkeys(r.variant for r in results if r.variant != "resident"))
    colors = _variant_colors(variants)
    rows = {(_case(r), r.variant): r for r in results}
    fig = _figure(max(6.0, 1.2 + 0.9 * len(cases) * max(1, len(variants))), 4.5)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(variants))
    top = max([r.overhead for r in results] + [1.0])
    for j, variant in enumerate(variants):
        for i, case in enumerate(cases):
            r = rows.get((case, variant))
            if r is None:
                continue
            x = i + (j - (len(variants) - 1) / 2) * width
            ax.bar(x, r.overhead, width * 0.9, color=colors[variant], hatch="" if r.bitwise_equal else "//")
            ax.hlines(r.floor_overhead, x - width * 0.45, x + width * 0.45, colors="black", linewidth=2)
            ax.annotate(f"{r.overhead:.3f}x", (x, r.overhead), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7)
    # A log axis keeps a 1.02x next to a 5x readable; the labels give the exact values.
    if top > 3:
        from matplotlib.ticker import (  # optional: the bench extra
            LogLocator,
            NullFormatter,
            ScalarFormatter,
        )

        ax.set_yscale("log")
        ax.set_ylim(0.9, top * 1.6)
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, top * 1.15)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(cases)), cases, rotation=15 if len(cases) > 3 else 0, fontsize=8)
    ax.set_ylabel("forward time / resident")
    ax.set_title("Streaming overhead per case (black tick: floor; hatched: not bitwise equal)"
                 + (f"\n{title}" if title else ""), fontsize=9)
    handles = [_patch(colors[v], v) for v in variants]
    if not all(r.bitwise_equal for r in results):
        handles.append(_patch("white", "not bitwise equal", hatch="//"))
    if len(handles) > 4:  # below the chart, where it hides no bar
        fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=min(6, len(handles)))
    elif handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left")
    _save(fig, path)
    return Path(path)


def _case(r: Any) -> str:
    """A row's case, as ``bench.format_table`` names it: with ``--stagger`` every rank reports
    its own row of each case and variant, so the rank is part of the case (keyed without it, one
    rank's rows would overwrite the other's)."""
    return f"{r.preset} {r.blocks}b {r.shape}" + (f" r{r.rank}" if r.rank is not None else "")


def _save(fig: Any, path: str | Path) -> None:
    """Write exactly ``path``: with no suffix (or a bare dot), as PNG. ``savefig`` would add the
    format's suffix, writing another file than the one checked before the run."""
    suffix = Path(path).suffix.lstrip(".")
    fig.savefig(path, format=None if suffix else "png")


def _variant_colors(variants: Sequence[str]) -> dict[str, str]:
    """A colour per variant: the fixed ones of :data:`_COLORS`, the others from
    :data:`_MORE_COLORS` in turn (again from the start past its end)."""
    more = iter(c for _ in range(1 + len(variants) // len(_MORE_COLORS)) for c in _MORE_COLORS)
    return {v: _COLORS[v] if v in _COLORS else next(more) for v in variants}


def draw_budget_sweep(results: Sequence[Any], path: str | Path, title: str = "") -> Path:
    """Forward / resident against the device budget (as a share of the block bytes), per case:
    measured, predicted by the planner (its predicted forward / the measured resident forward)
    and the floor. ``results`` are ``bench.CaseResult``s; only budget variants are drawn."""
    # One line per case (and rank, with --stagger) and variant: rank-local@30% and
    # fp8-streamed@30% are two lines.
    lines: dict[tuple[str, str], list[Any]] = {}
    for r in results:
        if r.device_budget is not None:
            lines.setdefault((_case(r), r.variant.split("@")[0]), []).append(r)
    resident = {_case(r): r.forward_ms for r in results if r.variant == "resident"}
    fig = _figure(6.5, 4.2)
    ax = fig.add_subplot()
    for k, ((case, variant), rows) in enumerate(lines.items()):
        label = f"{case} {variant}"
        rows = sorted(rows, key=lambda r: r.device_budget)
        # The budget as a share of the case's block bytes (what --budget's percents are of).
        x = [100 * r.device_budget / (r.block_mib * 2**20) for r in rows]
        color = f"C{k}"
        ax.plot(x, [r.overhead for r in rows], "o-", color=color, label=f"{label}: measured")
        # Only the planner's own predictions: a row without one (every block resident, so the
        # planner measured nothing) has no predicted point rather than an assumed 1.0.
        pred = [(xi, r.predicted_ms / resident[case]) for xi, r in zip(x, rows) if r.predicted_ms]
        if pred:
            ax.plot(*zip(*pred), "s--", color=color, alpha=0.7, label=f"{label}: predicted")
        ax.plot(x, [r.floor_overhead for r in rows], ":", color=color, alpha=0.6, label=f"{label}: floor")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("device budget, % of the block bytes (resident blocks + slots)")
    ax.set_ylabel("forward time / resident")
    ax.set_title("Residency planner: overhead against the device budget" + (f"\n{title}" if title else ""),
                 fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, path)
    return Path(path)


def draw_timeline(rings: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """One forward per ring from ``handle.trace_report()``: a compute lane and a copy lane."""
    if not rings:
        raise ValueError("the trace report has no rings: apply_offload(trace=True) streamed nothing, "
                         "or no forward ran before trace_report()")
    spans = [_span(ring) for ring in rings]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    fig = _figure(14.0, 1.2 + 1.5 * len(rings))
    axes = fig.subplots(len(rings), 1, squeeze=False)[:, 0]
    for ax, ring in zip(axes, rings):
        _draw_ring(ax, ring, hi - lo)
        ax.set_xlim(lo - 0.01 * (hi - lo), hi + 0.01 * (hi - lo))
    axes[-1].set_xlabel("ms from the forward's first block")
    handles = [_patch(_COMPUTE[0], "compute"), _patch(_COPY[0], "copy (transfer)"),
               _patch(_WAIT, "exposed wait")]
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=3)
    if title:
        fig.suptitle(title, fontsize=10)
    _save(fig, path)
    return Path(path)


def _span(ring: dict[str, Any]) -> tuple[float, float]:
    starts, ends = [0.0], [ring.get("forward_ms", 0.0)]
    for b in ring["blocks"]:
        starts.append(b["compute_start_ms"] - b["wait_ms"])
        ends.append(b["compute_start_ms"] + b["compute_ms"])
        if b.get("transfer_start_ms") is not None:
            starts.append(b["transfer_start_ms"])
            ends.append(b["transfer_start_ms"] + (b["transfer_ms"] or 0.0))
    return min(starts), max(ends)


def _draw_ring(ax, ring: dict[str, Any], span: float) -> None:
    compute_y, copy_y, h = 1.0, 0.0, 0.7
    for k, b in enumerate(ring["blocks"]):
        label = str(b["index"])
        _bar(ax, b["compute_start_ms"], b["compute_ms"], compute_y, h, _COMPUTE[k % 2], label, span)
        if b["wait_ms"] > 0:
            ax.broken_barh([(b["compute_start_ms"] - b["wait_ms"], b["wait_ms"])],
                           (compute_y - h / 2, h), facecolors=_WAIT)
        if b.get("transfer_start_ms") is not None and b.get("transfer_ms") is not None:
            _bar(ax, b["transfer_start_ms"], b["transfer_ms"], copy_y, h, _COPY[k % 2], label, span)
    ax.axvline(0.0, color="black", linewidth=0.6, linestyle=":")
    ax.set_yticks([copy_y, compute_y], ["copy", "compute"])
    ax.set_ylim(-0.6, 1.6)
    gbps = [b["gbps"] for b in ring["blocks"] if b.get("gbps")]
    rate = f", median copy {sorted(gbps)[len(gbps) // 2]:.1f} GB/s" if gbps else ""
    ax.set_title(f"{ring['component']}: forward {ring['forward_ms']:.2f} ms, exposed wait "
                 f"{ring['exposed_wait_ms']:.2f} ms ({ring['exposed_share']:.1%}){rate}",
                 fontsize=9, loc="left")


def _bar(ax, start: float, width: float, y: float, h: float, color: str, label: str, span: float) -> None:
    ax.broken_barh([(start, width)], (y - h / 2, h), facecolors=color, edgecolors="white", linewidth=0.3)
    # A label only where it fits: with 57 blocks most bars are a few pixels wide.
    if span > 0 and width / span > 0.012 * max(1, len(label)):
        ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=7, color="white")


def _patch(color: str, label: str, hatch: str = ""):
    from matplotlib.patches import Patch  # optional: the bench extra

    return Patch(facecolor=color, label=label, hatch=hatch, edgecolor="black" if hatch else None)
