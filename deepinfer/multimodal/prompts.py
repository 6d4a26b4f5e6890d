"""Chat messages with image parts -> prompt token ids with one placeholder per image, shared by the server and
the offline `LLM.chat`.

An image part renders as IMAGE_SENTINEL inside its message's text; after the chat template, the prompt is split
there, each piece tokenised on its own (special tokens only for the first) and the image token id put between, so
the placeholder does not depend on how a tokenizer revision spells the image token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

from deepinfer.config_v41 import VisionConfig
from deepinfer.multimodal.image_processor import ImageError, ProcessedImage, preprocess
from deepinfer.multimodal.media import MediaPolicy, decode_image, load_image

IMAGE_SENTINEL = "\ue000<|image|>\ue000"
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def flatten_messages(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """Messages with list contents joined into strings (image parts as IMAGE_SENTINEL), and the image sources
    in order: an image_url's URL, or a PIL image / bytes given directly (offline only)."""
    flat, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            flat.append(message)
            continue
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(part.get("text") or "")
            elif kind in IMAGE_PART_TYPES:
                sources.append(_source(part, kind, i))
                text.append(IMAGE_SENTINEL)
            else:
                raise ValueError(f"messages[{i}]: content part type {kind!r} is not supported (text, image_url)")
        flat.append({**message, "content": "".join(text)})
    return flat, sources


def _source(part: dict, kind: str, i: int) -> Any:
    value = part.get(kind)
    if kind == "image_url":
        value = value.get("url") if isinstance(value, dict) else value
    if value is None:
        raise ImageError(f"messages[{i}]: the {kind} part has no image")
    return value


def tokens_around_images(encode: Callable[[str, bool], list[int]], text: str, num_images: int, image_token_id: int,
                         add_special_tokens: bool) -> list[int]:
    """The rendered prompt's ids with image_token_id where each IMAGE_SENTINEL was."""
    pieces = text.split(IMAGE_SENTINEL)
    if len(pieces) != num_images + 1:
        raise ImageError(f"the rendered prompt has {len(pieces) - 1} image positions for {num_images} images (the "
                         "chat template dropped or repeated an image part, or a text part contains the marker)")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += [image_token_id] if i else []
        if piece or (i == 0 and add_special_tokens):
            ids += encode(piece, add_special_tokens and i == 0)
    return ids


def process_sources(sources: list[Any], policy: MediaPolicy, cfg: VisionConfig) -> list[ProcessedImage]:
    """Each source (URL string, PIL image or encoded bytes) decoded and processed for the encoder."""
    policy.check_count(len(sources))
    return [preprocess(_image(src, policy), cfg) for src in sources]


def _image(src: Any, policy: MediaPolicy) -> Image.Image:
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, (bytes, bytearray)):
        return decode_image(bytes(src), policy)
    if isinstance(src, str):
        return load_image(src, policy)
    raise ImageError(f"an image must be a URL string, a PIL image or bytes, got {type(src).__name__}")
