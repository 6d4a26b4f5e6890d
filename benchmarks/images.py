"""Image inputs through the server: time to first token of a chat request with a new image, with a repeat of the
same image (encoder cache and prefix cache hits), and with the same text and another image of the same size
(encoded again, nothing cached past the text before it); the three alternate, in one run.

The checkpoint is the vision golden's tiny text model (tests/golden/v41/v) with a vision tower of V4.1-Flash's width
(dim 1024, 16 heads, inter 2816, patch 14, 3 x 3 aligner, 544 x 544 minimum pixels) but `--vit-layers` layers
instead of 32, random weights: so the encoder's share of a request is visible, as it is on the real model. Writes
benchmarks/results/images.{json,png}.

    python benchmarks/images.py [--rounds 8] [--vit-layers 4] [--size 544]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from deepinfer.bench.machine import machine_facts
from deepinfer.config_v41 import VisionConfig
from deepinfer.models.vision_v41 import Aligner, VisionTower

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_V = ROOT / "tests" / "golden" / "v41" / "v"
RESULTS = Path(__file__).parent / "results"


def build_checkpoint(out: Path, layers: int) -> VisionConfig:
    """The golden v text model with a V4.1-Flash-width vision tower of `layers` layers (seeded random weights)."""
    shutil.copytree(GOLDEN_V, out, ignore=shutil.ignore_patterns("cpu", "images"))
    cfg_path = out / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": layers, "hidden_size": 1024,
                            "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14,
                            "rope_theta": 10000.0, "downsample_ratio": 3, "max_image_tokens": 200,
                            "min_pixels": 544 * 544, "max_wh_ratio": None}
    cfg_path.write_text(json.dumps(raw, indent=2))
    v = raw["vision_config"]
    cfg = VisionConfig(layers, 1024, 16, 2816, 14, 10000.0, 3, v["max_image_tokens"], v["min_pixels"], None)
    torch.manual_seed(0)
    tensors = {k: t for k, t in load_file(str(out / "model.safetensors")).items()
               if not k.startswith(("vision.", "aligner."))}
    dim = raw["text_config"]["hidden_size"]
    for prefix, module in (("vision.", VisionTower(cfg)), ("aligner.", Aligner(cfg, dim))):
        for name, p in module.state_dict().items():
            tensors[prefix + name] = (p * 0.5 if p.dim() > 1 else p).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return cfg


def png_url(size: int, seed: int) -> str:
    rgb = np.random.default_rng(seed).integers(0, 255, (size // 8, size // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).resize((size, size), Image.Resampling.BILINEAR).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(client, model: str, url: str) -> tuple[float, int]:
    """Seconds until a 1-token answer is back (its prefill, the encoder included, is the time to first token),
    and the prompt's token count."""
    start = time.perf_counter()
    out = client.chat.completions.create(
        model=model, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is in the picture"},
                                               {"type": "image_url", "image_url": {"url": url}}]}])
    return time.perf_counter() - start, out.usage.prompt_tokens


def run(args) -> dict:
    import openai

    sys.path.insert(0, str(ROOT / "tests"))
    from test_server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "v-vit"
        build_checkpoint(ckpt, args.vit_layers)
        server = ServerProcess(ckpt, Path(tmp) / "server.log", "--max-model-len", "256", "--kv-cache-memory-bytes",
                               str(64 * 2**20), env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
        try:
            server.wait_ready(600)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
            model = client.models.list().data[0].id
            ttft(client, model, png_url(args.size, 10_000))  # warm-up
            times = {"new image": [], "same image again": [], "another image, same size": []}
            prompt_tokens = 0
            for r in range(args.rounds):
                first, prompt_tokens = ttft(client, model, png_url(args.size, 2 * r))
                times["new image"].append(first)
                times["same image again"].append(ttft(client, model, png_url(args.size, 2 * r))[0])
                times["another image, same size"].append(ttft(client, model, png_url(args.size, 2 * r + 1))[0])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in
                                                                   times.items()), flush=True)
        finally:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"machine": machine_facts(), "vit_layers": args.vit_layers, "image_size": args.size,
            "prompt_tokens": prompt_tokens, "rounds": args.rounds, "ttft_s": times, "median_ttft_s": med,
            "repeat_speedup": med["new image"] / med["same image again"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["median_ttft_s"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, [result["median_ttft_s"][k] * 1e3 for k in names], color=["#888", "#2a7", "#c64"])
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"{result['image_size']} px image, {result['vit_layers']}-layer ViT of V4.1-Flash width")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--vit-layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=544)
    result = run(parser.parse_args())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "images.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "images.png")
    print(json.dumps(result["median_ttft_s"], indent=2), f"repeat speedup {result['repeat_speedup']:.2f}x")


if __name__ == "__main__":
    main()
