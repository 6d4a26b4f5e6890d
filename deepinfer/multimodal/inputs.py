"""A prompt's images as the engine carries them: each image's span in the prompt, its grids, its digest and its
patches; placeholder expansion; the wire form (msgpack has no tensors).

Invariants: spans are in prompt order, do not overlap, and every position of a span holds the image token id; a
span's IMAGE positions take the encoder's rows in reading order (image_processor.span_types).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from deepinfer.config_v41 import VisionConfig
from deepinfer.models.vision_v41 import llm_grid
from deepinfer.multimodal.image_processor import ImageError, ProcessedImage, num_span_tokens, span_types


@dataclass(frozen=True, eq=False)
class ImageSpan:
    offset: int  # prompt position of the span's START token
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    digest: str
    patches: torch.Tensor  # bf16 [n_vit_h * n_vit_w, 3, p, p]

    @property
    def length(self) -> int:
        return num_span_tokens(self.n_llm_h, self.n_llm_w)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def types(self) -> list[int]:
        return span_types(self.n_llm_h, self.n_llm_w)

    @cached_property
    def wire(self) -> dict:
        """The wire form, built once (the server builds it off the event loop: the patches are megabytes)."""
        return self.to_wire()

    def to_wire(self) -> dict:
        raw = self.patches.contiguous().view(torch.int16).numpy().tobytes()
        return {"offset": self.offset, "grid": [self.n_vit_h, self.n_vit_w, self.n_llm_h, self.n_llm_w],
                "digest": self.digest, "shape": list(self.patches.shape), "patches": raw}

    @classmethod
    def from_wire(cls, d: dict) -> ImageSpan:
        try:
            data = torch.frombuffer(bytearray(d["patches"]), dtype=torch.int16).view(torch.bfloat16)
            patches = data.view(*d["shape"])
            return cls(int(d["offset"]), *(int(x) for x in d["grid"]), str(d["digest"]), patches)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ImageError(f"malformed image input: {e}") from None


def image_keys(spans) -> tuple[tuple[int, int, str], ...]:
    """(offset, end, digest) per span: what the prefix cache's block hashes take of a prompt's images."""
    return tuple((s.offset, s.end, s.digest) for s in spans or ())


def expand_placeholders(token_ids: list[int], images: list[ProcessedImage], image_token_id: int
                        ) -> tuple[list[int], list[ImageSpan]]:
    """Each occurrence of image_token_id in `token_ids` (one per image, in order) becomes that image's span."""
    count = sum(t == image_token_id for t in token_ids)
    if count != len(images):
        raise ImageError(f"the prompt has {count} image placeholders but {len(images)} images were given")
    ids, spans, it = [], [], iter(images)
    for t in token_ids:
        if t != image_token_id:
            ids.append(t)
            continue
        img = next(it)
        spans.append(ImageSpan(len(ids), img.n_vit_h, img.n_vit_w, img.n_llm_h, img.n_llm_w, img.digest, img.patches))
        ids += [image_token_id] * img.num_tokens
    return ids, spans


def check_spans(token_ids: list[int], spans: list[ImageSpan], image_token_id: int, cfg: VisionConfig) -> None:
    """What the engine requires of a request's images (they may come from any client of the engine)."""
    end = 0
    for s in spans:
        if s.offset < end or s.end > len(token_ids):
            raise ImageError("image spans must be in prompt order, inside the prompt, without overlapping")
        if any(t != image_token_id for t in token_ids[s.offset:s.end]):
            raise ImageError(f"the image span at {s.offset} does not hold image tokens ({image_token_id})")
        shape = (s.n_vit_h * s.n_vit_w, 3, cfg.patch_size, cfg.patch_size)
        if s.patches is None or tuple(s.patches.shape) != shape:
            raise ImageError(f"image at {s.offset}: patches must be {list(shape)}")
        if min(s.n_vit_h, s.n_vit_w) < 1 or (s.n_llm_h, s.n_llm_w) != llm_grid(s.n_vit_h, s.n_vit_w,
                                                                                cfg.downsample_ratio):
            raise ImageError(f"image at {s.offset}: its token grid does not follow from its patch grid")
        if s.length > cfg.max_image_tokens:
            raise ImageError(f"image at {s.offset} has {s.length} tokens; at most {cfg.max_image_tokens}")
        end = s.end
    stray = sum(t == image_token_id for t in token_ids) - sum(s.length for s in spans)
    if stray:
        raise ImageError(f"the prompt holds {stray} image tokens outside any image's span")
