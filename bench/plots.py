"""PNG plots from results.json, two per pair x mode: OUT/PAIR-MODE-itl_cdf.png and -load.png.
matplotlib is imported here only, lazily: without it the harness still runs and says how to get
the plots later (`python -m bench --replot results.json`)."""

from __future__ import annotations

from pathlib import Path

MISSING = ("matplotlib is not installed: no PNG plots. Install it (matplotlib==3.11.2) and run "
           "`python -m bench --replot {json}` to draw them from the saved results.")


def plot_all(data: dict, out: Path, json_path: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING.format(json=json_path))
        return []
    names = {c["key"]: f"({c['key']}) {c['name']}" for c in data["configs"]}
    written = []
    for run in data["runs"]:
        key = f"{run['pair']}/{run['mode']}"
        loads = data["pairs"][run["pair"]]["plan"]["loads"]
        samples = data.get("itl_samples", {}).get(key, {})
        stem = out / f"{run['pair']}-{run['mode']}"
        written += [_itl_cdf(plt, names, loads, samples, key, Path(f"{stem}-itl_cdf.png")),
                    _load(plt, names, loads, run["results"], key, Path(f"{stem}-load.png"))]
    return written


def _itl_cdf(plt, names: dict, loads: list[dict], samples: dict, title: str, path: Path) -> Path:  # noqa: ANN001
    import numpy as np

    fig, axes = _grid(plt, len(loads))
    for ax, load in zip(axes, loads, strict=False):
        for cfg, per_load in samples.items():
            xs = np.sort(np.asarray(per_load.get(load["name"], []), dtype=float))
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=names[cfg], lw=1.3)
        ax.set_xscale("log")
        ax.set_title(load["label"])
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("fraction of tokens")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"ITL CDF per configuration — {title}")
    _legend(fig, axes, len(loads))
    return _save(fig, path, plt)


def _load(plt, names: dict, loads: list[dict], res: dict, title: str, path: Path) -> Path:  # noqa: ANN001
    import numpy as np

    labels = [x["label"].replace(" (single stream)", "") for x in loads]
    panels = [("output tokens/s", lambda s: s["tokens_per_s"]), ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"]),
              ("ITL p99 (ms)", lambda s: s["itl_ms"]["p99"]), ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
              ("end-to-end p50 (s)", lambda s: s["e2e_s"]["p50"])]
    fig, axes = _grid(plt, len(panels))
    for ax, (name, get) in zip(axes, panels, strict=False):
        for cfg, per_load in res.items():
            ys = [get(per_load[x["name"]]) if x["name"] in per_load else None for x in loads]
            ys = [np.nan if y is None else y for y in ys]
            ax.plot(range(len(loads)), ys, marker="o", label=names[cfg], ls="--" if cfg == "hf" else "-")
        ax.set_xticks(range(len(loads)), labels, rotation=30, fontsize=8)
        ax.set_title(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"latency and throughput against load — {title} (anchor: one request at a time)")
    _legend(fig, axes, len(panels))
    return _save(fig, path, plt)


def _grid(plt, n: int) -> tuple:  # noqa: ANN001
    """Panels in rows of three; the legend takes a spare cell, or a strip below a full grid."""
    rows = -(-n // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(14, 4.2 * rows + (1.3 if n % 3 == 0 else 0)), squeeze=False)
    return fig, list(axes.flat)


def _legend(fig, axes: list, used: int) -> None:  # noqa: ANN001
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[used:]:
        ax.axis("off")
    for ax in axes[:used]:
        ax.xaxis.set_minor_formatter(_null())
    if used < len(axes):
        axes[used].legend(handles, labels, loc="center", fontsize=9, frameon=False)
        fig.tight_layout()
    else:
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)


def _null():  # noqa: ANN202
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _save(fig, path: Path, plt) -> Path:  # noqa: ANN001
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
