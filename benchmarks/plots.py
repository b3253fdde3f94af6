"""PNG plots of a ``compare.py`` result set (matplotlib, optional: the ``bench`` extra).

Every function takes the flat rows that ``compare.py`` produces (one per system, concurrency and
output length) and writes one PNG; ``make_plots`` writes them all and returns their paths, or an
empty dict when matplotlib is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _systems(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in rows))


def _output_lens(rows: Sequence[Row]) -> list[int]:
    return sorted({int(r["output_len"]) for r in rows})


def _series(rows: Sequence[Row], system: str, output_len: int, key: str) -> tuple[list, list]:
    pts = sorted((r["concurrency"], r.get(key)) for r in rows
                 if r["system"] == system and r["output_len"] == output_len
                 and r.get(key) is not None)
    return [c for c, _ in pts], [v for _, v in pts]


def _panels(plt: Any, n: int, title: str) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.0), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def _concurrency_axis(ax: Any, rows: Sequence[Row]) -> None:
    ticks = sorted({int(r["concurrency"]) for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(rows: Sequence[Row], path: Path) -> Path:
    """Output tokens/s against concurrency, one panel per output length, one line per system."""
    plt = _plt()
    lens = _output_lens(rows)
    fig, axes = _panels(plt, len(lens), "Output throughput")
    for ax, olen in zip(axes, lens):
        for system in _systems(rows):
            xs, ys = _series(rows, system, olen, "output_throughput")
            if xs:
                ax.plot(xs, ys, marker="o", label=system)
        _concurrency_axis(ax, rows)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{olen} output tokens")
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_latency(rows: Sequence[Row], metric: str, path: Path) -> Path:
    """Median (solid) and p99 (dashed) of ``metric`` (ttft or tpot) against concurrency."""
    plt = _plt()
    lens = _output_lens(rows)
    fig, axes = _panels(plt, len(lens), f"{metric.upper()} (solid: median, dashed: p99)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, olen in zip(axes, lens):
        for i, system in enumerate(_systems(rows)):
            color = colors[i % len(colors)]
            xs, ys = _series(rows, system, olen, f"median_{metric}_ms")
            if xs:
                ax.plot(xs, ys, marker="o", color=color, label=system)
            xs, ys = _series(rows, system, olen, f"p99_{metric}_ms")
            if xs:
                ax.plot(xs, ys, marker="x", linestyle="--", color=color)
        _concurrency_axis(ax, rows)
        ax.set_ylabel("ms")
        ax.set_title(f"{olen} output tokens")
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


def acceptance_by_system(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Per system: drafts, accepted tokens per position and the rates, summed over its rows."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        per_pos = r.get("accepted_per_position")
        if not r.get("num_drafts") or not per_pos:
            continue
        agg = out.setdefault(r["system"], {"num_drafts": 0.0, "num_accepted_tokens": 0.0,
                                           "accepted_per_position": []})
        agg["num_drafts"] += r["num_drafts"]
        agg["num_accepted_tokens"] += r.get("num_accepted_tokens") or 0.0
        acc = agg["accepted_per_position"]
        acc.extend([0.0] * (len(per_pos) - len(acc)))
        for i, v in enumerate(per_pos):
            acc[i] += v
    for agg in out.values():
        d = agg["num_drafts"]
        agg["rate_per_position"] = [v / d for v in agg["accepted_per_position"]]
        agg["mean_acceptance_length"] = 1.0 + agg["num_accepted_tokens"] / d
    return out


def plot_acceptance(rows: Sequence[Row], path: Path) -> Path | None:
    """Per-position acceptance rate of each speculative system (all its runs pooled)."""
    acc = acceptance_by_system(rows)
    if not acc:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    width = 0.8 / len(acc)
    for i, (system, agg) in enumerate(acc.items()):
        rates = agg["rate_per_position"]
        xs = [p + i * width for p in range(len(rates))]
        ax.bar(xs, rates, width=width,
               label=f"{system} (mean acceptance length {agg['mean_acceptance_length']:.2f})")
    longest = max(len(a["rate_per_position"]) for a in acc.values())
    ax.set_xticks([p + 0.4 - width / 2 for p in range(longest)])
    ax.set_xticklabels([str(p) for p in range(longest)])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1)
    ax.set_title("Speculative decoding: acceptance per position")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def make_plots(rows: Sequence[Row], out_dir: Path, prefix: str = "compare") -> dict[str, Path]:
    """All plots into ``out_dir``; {} when matplotlib is missing or there is nothing to plot."""
    if not have_matplotlib() or not rows:
        return {}
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {
        "throughput": plot_throughput(rows, out_dir / f"{prefix}_throughput.png")}
    if any(r.get("median_ttft_ms") is not None for r in rows):
        paths["ttft"] = plot_latency(rows, "ttft", out_dir / f"{prefix}_ttft.png")
    if any(r.get("median_tpot_ms") is not None for r in rows):
        paths["tpot"] = plot_latency(rows, "tpot", out_dir / f"{prefix}_tpot.png")
    acc = plot_acceptance(rows, out_dir / f"{prefix}_acceptance.png")
    if acc is not None:
        paths["acceptance"] = acc
    return paths
