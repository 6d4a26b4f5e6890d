"""The vision encoder's outputs by image digest, and the per-step rows of image spans built from them.

An image is encoded once and its features kept (least recently used dropped first, within a byte budget), so the
same image in another request, a preempted request's recompute, the n samples of one request and a prefix-cache
replay over an image all reuse it. Every encoder run is counted and timed (the engine's image metrics).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from deepinfer.layers.metadata import IMAGE_TYPE, ImageRows


class EncoderCache:
    def __init__(self, encode: Callable[[torch.Tensor, int, int], torch.Tensor], max_bytes: int = 512 * 2**20):
        self.encode, self.max_bytes = encode, max_bytes
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.images_encoded = 0  # encoder runs
        self.cache_hits = 0
        self.encoder_seconds = 0.0

    def features(self, span) -> torch.Tensor:
        """[n_llm_h * n_llm_w, hidden] of span's image (multimodal.inputs.ImageSpan)."""
        hit = self._features.get(span.digest)
        if hit is not None:
            self._features.move_to_end(span.digest)
            self.cache_hits += 1
            return hit
        start = time.perf_counter()
        out = self.encode(span.patches, span.n_vit_h, span.n_vit_w)
        self.encoder_seconds += time.perf_counter() - start
        self.images_encoded += 1
        self._keep(span.digest, out)
        return out

    def _keep(self, digest: str, out: torch.Tensor) -> None:
        size = _size(out)
        while self._features and self._bytes + size > self.max_bytes:
            self._bytes -= _size(self._features.popitem(last=False)[1])
        if size <= self.max_bytes:
            self._features[digest] = out
            self._bytes += size

    def step_rows(self, chunks: list[tuple[tuple, int, int, int]], device: torch.device) -> ImageRows | None:
        """ImageRows of a step from (spans, first row, first position, end position) per request chunk."""
        rows, types, feats = [], [], []
        for spans, row0, start, end in chunks:
            for span in spans:
                lo, hi = max(span.offset, start), min(span.end, end)
                if lo >= hi:
                    continue
                span_types = span.types()
                rows += range(row0 + lo - start, row0 + hi - start)
                types += span_types[lo - span.offset:hi - span.offset]
                first = sum(t == IMAGE_TYPE for t in span_types[:lo - span.offset])
                count = sum(t == IMAGE_TYPE for t in span_types[lo - span.offset:hi - span.offset])
                feats.append(self.features(span)[first:first + count])
        if not rows:
            return None
        long = dict(dtype=torch.long, device=device)
        return ImageRows(torch.tensor(rows, **long), torch.tensor(types, **long), torch.cat(feats).to(device))


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
