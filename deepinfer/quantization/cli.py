"""`deepinfer quantize --method awq --calib FILE --out DIR [MODEL]` (docs/quantization.md)."""

from __future__ import annotations

import argparse
import json


def add_parser(commands) -> None:
    sub = commands.add_parser("quantize", help="write an AWQ int4 checkpoint of a model (docs/quantization.md)")
    sub.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    sub.add_argument("--method", choices=("awq", "rtn"), default="awq",
                     help="awq: activation-aware scales and clipping; rtn: plain round-to-nearest")
    sub.add_argument("--calib", metavar="FILE", help="local UTF-8 text file of calibration text (awq)")
    sub.add_argument("--out", required=True, metavar="DIR", help="directory to write the int4 checkpoint to")
    sub.add_argument("--group-size", type=int, default=128, help="inputs sharing one scale and zero point")
    sub.add_argument("--calib-samples", type=int, default=32, help="calibration windows")
    sub.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration window")
    sub.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deepinfer.llm import resolve_model
    from deepinfer.quantization.quantize import QuantizeOptions, quantize

    model, _ = resolve_model(args.model)
    opts = QuantizeOptions(args.method, args.group_size, Path(args.calib) if args.calib else None,
                           args.calib_samples, args.calib_seq_len)
    report = quantize(model, args.out, opts)
    summary = {k: v for k, v in report.items() if k != "rtn_weights"}
    print(json.dumps(summary, indent=1))
    return 0
