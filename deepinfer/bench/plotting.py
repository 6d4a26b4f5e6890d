"""matplotlib for the benchmark plots, loaded only when a plot is drawn (it is the `bench` extra)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend, or ValueError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or the `bench` extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series in each group, side by side, the groups labelled on the x axis and the series in a
    legend. series: label -> one value per group."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
