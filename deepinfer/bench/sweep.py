"""`deepinfer bench sweep`: `bench serve` over a list of concurrencies or request rates, with the
throughput-latency curve as a PNG; `deepinfer bench plot` draws several sweep files (engines) on one figure.

A sweep file is JSON: ``{"label", "model", "varied", "config", "machine", "points": [{"max_concurrency",
"request_rate", "num_prompts", "summary"}]}`` where ``summary`` is ``BenchSummary.to_dict()``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from deepinfer.bench.machine import machine_facts
from deepinfer.bench.plotting import pyplot
from deepinfer.bench.serve import (
    add_serve_args,
    check_serve_args,
    fetch_model,
    load_tokenizer,
    run_config,
    run_serve_point,
    write_result_json,
)

VARIED = {"concurrency": "max_concurrency", "rates": "request_rate"}


def parse_values(text: str, kind: str) -> list[float]:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]``; concurrencies must be integers >= 1, rates > 0 (``inf`` allowed)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{kind} expects comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"--{kind} is empty")
    if kind == "concurrency" and not all(math.isfinite(v) and v >= 1 and v == int(v) for v in values):
        raise ValueError(f"--concurrency values must be integers >= 1, got {text!r}")
    if kind == "rates" and not all(v > 0 for v in values):
        raise ValueError(f"--rates values must be > 0 (inf sends all at once), got {text!r}")
    return values


def point_args(args: argparse.Namespace, kind: str, value: float) -> argparse.Namespace:
    """The `bench serve` options of one sweep point: the varied option set, prompts scaled if asked."""
    point = argparse.Namespace(**vars(args))
    if kind == "concurrency":
        point.max_concurrency = int(value)
        scaled = (args.prompts_per_concurrency or 0) * int(value)
    else:
        point.request_rate = value
        scaled = 0
    point.num_prompts = max(args.num_prompts, scaled)
    return point


def _point_record(point: argparse.Namespace, summary) -> dict:
    rate = point.request_rate
    return {"max_concurrency": point.max_concurrency, "request_rate": str(rate) if math.isinf(rate) else rate,
            "num_prompts": point.num_prompts, "summary": summary.to_dict()}


def run_sweep(args: argparse.Namespace, records_dir: Path | None = None) -> dict:
    """Every point of the sweep, in the order given; returns the sweep document (see module doc).
    With ``records_dir``, each point's per-request records go to ``<varied>-<value>.json`` there."""
    kind = "concurrency" if args.concurrency else "rates"
    values = parse_values(args.concurrency or args.rates, kind)
    tokenizer = load_tokenizer(args.tokenizer)
    model = args.model or fetch_model(args.base_url, args.api_key)
    points = []
    for value in values:
        point = point_args(args, kind, value)
        print(f"--- {VARIED[kind]} = {value:g} ({point.num_prompts} prompts)", flush=True)
        summary, records = run_serve_point(point, model, tokenizer)
        print(summary.format_table(), flush=True)
        if records_dir is not None:
            write_result_json(str(records_dir / f"{VARIED[kind]}-{value:g}.json"), summary, records,
                              run_config(point, model))
        points.append(_point_record(point, summary))
    return {"label": args.label or model, "model": model, "varied": VARIED[kind],
            "config": run_config(args, model), "machine": machine_facts(), "points": points}


# --- plots -----------------------------------------------------------------------------------------
def _series(doc: dict, key: str) -> list[float]:
    """One summary value per point; ``key`` is ``field`` or ``field.stat`` (e.g. ``tpot_ms.median``)."""
    name, _, stat = key.partition(".")
    values = [p["summary"][name] for p in doc["points"]]
    return [v[stat] if stat else v for v in values]


def _x_values(doc: dict) -> list[float]:
    return [float(p[doc["varied"]]) for p in doc["points"]]


def _panels(docs: Sequence[dict]) -> list[tuple[str, str, str, str]]:
    """(x key, y key, x label, y label) per panel; a goodput panel when every sweep measured goodput."""
    varied = docs[0]["varied"].replace("_", " ")
    panels = [("@varied", "output_throughput", varied, "output tokens/s"),
              ("output_throughput", "tpot_ms.median", "output tokens/s", "median TPOT (ms)"),
              ("output_throughput", "ttft_ms.median", "output tokens/s", "median TTFT (ms)")]
    if all(p["summary"].get("request_goodput") is not None for d in docs for p in d["points"]):
        panels.append(("@varied", "request_goodput", varied, "goodput (req/s)"))
    return panels


def plot_sweeps(docs: Sequence[dict], output: str | Path, title: str | None = None) -> Path:
    """Throughput-latency curves of one or more sweeps (one colour per label) as one PNG."""
    plt = pyplot()

    if not docs or len({d["varied"] for d in docs}) != 1:
        raise ValueError("plot needs at least one sweep, all varying the same option")
    panels = _panels(docs)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
    for ax, (xkey, ykey, xlabel, ylabel) in zip(axes, panels):
        for doc in docs:
            xs = _x_values(doc) if xkey == "@varied" else _series(doc, xkey)
            ax.plot(xs, _series(doc, ykey), marker="o", label=doc["label"])
        if xkey == "@varied" and all(math.isfinite(x) for d in docs for x in _x_values(d)):
            ax.set_xscale("log", base=2)
        if ykey.startswith("ttft"):  # queueing makes TTFT span orders of magnitude across engines
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return Path(output)


def load_sweep(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read sweep file {path}: {e}") from None
    if not isinstance(doc, dict) or not {"label", "varied", "points"} <= doc.keys():
        raise ValueError(f"{path} is not a `deepinfer bench sweep` result (needs label, varied, points)")
    return doc


# --- entry points ----------------------------------------------------------------------------------
def main_sweep(args: argparse.Namespace) -> int:
    if bool(args.concurrency) == bool(args.rates):
        raise ValueError("give exactly one of --concurrency and --rates")
    check_serve_args(args)
    others = [load_sweep(p) for p in args.compare or ()]
    out_dir = Path(args.output_dir)
    doc = run_sweep(args, records_dir=out_dir / "points")
    (out_dir / "sweep.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    png = plot_sweeps([doc, *others], out_dir / "sweep.png", title=args.title)
    print(f"wrote {out_dir / 'sweep.json'} and {png}", flush=True)
    return 0


def main_plot(args: argparse.Namespace) -> int:
    png = plot_sweeps([load_sweep(p) for p in args.files], args.output, title=args.title)
    print(f"wrote {png}", flush=True)
    return 0


def add_sweep_args(sub: argparse.ArgumentParser) -> None:
    add_serve_args(sub, run_outputs=False)
    g = sub.add_argument_group("sweep")
    g.add_argument("--concurrency", metavar="LIST", help="comma-separated --max-concurrency values, e.g. 1,4,16,64")
    g.add_argument("--rates", metavar="LIST", help="comma-separated --request-rate values, e.g. 1,2,4,inf")
    g.add_argument("--prompts-per-concurrency", type=int, metavar="K",
                   help="send max(--num-prompts, K x concurrency) prompts per concurrency point")
    g.add_argument("--label", help="name of this sweep in plots (default: the model name)")
    g.add_argument("--output-dir", default="bench-sweep", help="where sweep.json and sweep.png go "
                                                               "(default: %(default)s)")
    g.add_argument("--compare", nargs="+", metavar="SWEEP_JSON", help="earlier sweeps to draw on the same plot")
    g.add_argument("--title", help="plot title")


def add_plot_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("files", nargs="+", metavar="SWEEP_JSON", help="sweep results to draw together")
    sub.add_argument("--output", "-o", default="sweep.png", help="PNG path (default: %(default)s)")
    sub.add_argument("--title", help="plot title")
