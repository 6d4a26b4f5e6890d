"""Image -> ViT patches and the LLM token span it becomes (DeepSeek-V4.1's preprocessing).

Size plan (a pure function of the original size and the vision config): an image wider than `max_wh_ratio` x its
height is treated as that aspect; one under `min_pixels` is scaled up (aspect kept); each side is rounded up to
whole patches; if its span would exceed `max_image_tokens`, the largest aspect-keeping size that fits is solved for.
Pixels: images at least `max_wh_ratio` wide are stretched to the planned size, the others fitted inside it and
padded with mid grey (centred, Pillow's `ImageOps.pad`); then RGB / 255, normalised to [-1, 1], in bf16.

Span layout: `[START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]`; every position carries the image token
id, only the types tell them apart, and the IMAGE slots take the aligner's rows in reading order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from deepinfer.config_v41 import VisionConfig
from deepinfer.layers.metadata import IMAGE_END, IMAGE_NEWLINE, IMAGE_START, IMAGE_TYPE
from deepinfer.models.vision_v41 import llm_grid

START, IMAGE, NEWLINE, END = IMAGE_START, IMAGE_TYPE, IMAGE_NEWLINE, IMAGE_END  # token types inside a span
PAD_GREY = (127, 127, 127)


class ImageError(ValueError):
    """An image input that cannot be used: not an image, corrupt, too large, not allowed (an HTTP 400)."""


@dataclass(frozen=True)
class GridPlan:
    n_llm_h: int
    n_llm_w: int
    height: int  # pixels the image is resized / padded to
    width: int


def num_span_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    return [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]


def _token_grid(height: int, width: int, cfg: VisionConfig) -> tuple[int, int]:
    return llm_grid(int(height) // cfg.patch_size, int(width) // cfg.patch_size, cfg.downsample_ratio)


def _fit(height: float, width: float, cfg: VisionConfig) -> tuple[int, int]:
    """The largest aspect-keeping pixel size whose span has at most max_image_tokens; very tall / wide images
    collapse to one column / row of cells."""
    limit, cell, p = cfg.max_image_tokens, cfg.cell, cfg.patch_size
    aspect = height / width
    max_w = math.sqrt((limit - 2) / aspect + 0.25) - 0.5  # n_h * (n_w + 1) + 2 <= limit with n_h = aspect * n_w
    max_h = max_w * aspect
    if max_w < 1.0:
        return (limit - 2) // 2 * cell, cell
    if max_h < 1.0:
        return cell, (limit - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_grid(width: int, height: int, cfg: VisionConfig) -> GridPlan:
    p = cfg.patch_size
    w, h = float(width), float(height)
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if 0 < w * h < cfg.min_pixels:
        scale = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    n_h, n_w = _token_grid(best_h, best_w, cfg)
    if num_span_tokens(n_h, n_w) > cfg.max_image_tokens:
        best_h, best_w = _fit(h, w, cfg)
        n_h, n_w = _token_grid(best_h, best_w, cfg)
    if best_h < p or best_w < p or num_span_tokens(n_h, n_w) > cfg.max_image_tokens:
        raise ImageError(f"a {width} x {height} image cannot be fitted into {cfg.max_image_tokens} image tokens")
    return GridPlan(n_h, n_w, int(best_h), int(best_w))


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the encoder; `digest` names its pixels (equal digests encode equally)."""

    patches: torch.Tensor  # bf16 [n_vit_h * n_vit_w, 3, p, p], reading order
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    digest: str

    @property
    def num_tokens(self) -> int:
        return num_span_tokens(self.n_llm_h, self.n_llm_w)

    @property
    def num_features(self) -> int:
        return self.n_llm_h * self.n_llm_w


def _pixels(image: Image.Image, plan: GridPlan, cfg: VisionConfig) -> Image.Image:
    if cfg.max_wh_ratio is not None and image.width >= cfg.max_wh_ratio * image.height:
        return image.resize((plan.width, plan.height))
    return ImageOps.pad(image, (plan.width, plan.height), color=PAD_GREY)


def preprocess(image: Image.Image, cfg: VisionConfig) -> ProcessedImage:
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    plan = plan_grid(rgb.width, rgb.height, cfg)
    p, n_h, n_w = cfg.patch_size, plan.height // cfg.patch_size, plan.width // cfg.patch_size
    x = torch.from_numpy(np.asarray(_pixels(rgb, plan, cfg), dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    patches = x.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, p, p).contiguous()
    digest = hashlib.blake2b(patches.view(torch.int16).numpy().tobytes(), digest_size=16,
                             person=b"deepinfer-img").hexdigest() + f"-{n_h}x{n_w}"
    return ProcessedImage(patches, n_h, n_w, plan.n_llm_h, plan.n_llm_w, digest)
