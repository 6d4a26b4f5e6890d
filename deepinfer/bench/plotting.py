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
