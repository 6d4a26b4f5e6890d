"""Image inputs, the pure parts: size plans, span layout and placeholder expansion, media policy (what may be read
or fetched, and the 400s), chunk boundaries around image spans, prefix-cache keys by image content."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.config_v41 import VisionConfig
from deepinfer.engine.kv_cache import chain_hashes
from deepinfer.engine.scheduler import whole_images
from deepinfer.multimodal.image_processor import (
    END,
    IMAGE,
    NEWLINE,
    START,
    ImageError,
    num_span_tokens,
    plan_grid,
    preprocess,
    span_types,
)
from deepinfer.multimodal.inputs import ImageSpan, check_spans, expand_placeholders
from deepinfer.multimodal.media import MediaPolicy, image_bytes, load_image
from deepinfer.multimodal.prompts import IMAGE_SENTINEL, flatten_messages, tokens_around_images

CFG = VisionConfig(2, 64, 4, 96, 4, 10000.0, 2, 64, 1024, 3.0)  # the vision golden's config (tests/golden/v41/v)
REAL = VisionConfig(32, 1024, 16, 2816, 14, 10000.0, 3, 1024, 544 * 544, None)  # V4.1-Flash's shapes


def png(w: int, h: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("cfg", [CFG, REAL])
@pytest.mark.parametrize("size", [(96, 24), (30, 52), (12, 10), (200, 120), (1, 300), (300, 1), (4000, 3000)])
def test_plans_fit_the_token_limit_in_whole_patches(cfg, size):
    plan = plan_grid(*size, cfg)
    assert num_span_tokens(plan.n_llm_h, plan.n_llm_w) <= cfg.max_image_tokens
    assert plan.height % cfg.patch_size == 0 and plan.width % cfg.patch_size == 0
    assert plan.n_llm_h == -(-(plan.height // cfg.patch_size) // cfg.downsample_ratio)


def test_small_images_are_upscaled_and_large_ones_shrunk():
    small, big = plan_grid(12, 10, CFG), plan_grid(4000, 3000, REAL)
    assert small.width * small.height >= CFG.min_pixels
    assert num_span_tokens(big.n_llm_h, big.n_llm_w) <= 1024 < num_span_tokens(3000 // 42, 4000 // 42)
    wide = plan_grid(96, 24, CFG)  # wider than max_wh_ratio: planned at 3:1
    assert wide.width == 3 * wide.height


def test_span_layout():
    assert span_types(2, 3) == [START, IMAGE, IMAGE, IMAGE, NEWLINE, IMAGE, IMAGE, IMAGE, NEWLINE, END]
    assert num_span_tokens(2, 3) == len(span_types(2, 3))


def test_patches_and_digest_follow_the_pixels():
    a = preprocess(Image.open(io.BytesIO(png(40, 24))), CFG)
    assert a.patches.dtype == torch.bfloat16 and a.patches.shape == (a.n_vit_h * a.n_vit_w, 3, 4, 4)
    assert float(a.patches.abs().max()) <= 1.0
    again = preprocess(Image.open(io.BytesIO(png(40, 24))), CFG)
    other = preprocess(Image.open(io.BytesIO(png(40, 24, seed=1))), CFG)
    assert a.digest == again.digest != other.digest


def test_placeholders_expand_in_order_and_are_checked():
    imgs = [preprocess(Image.open(io.BytesIO(png(40, 24, s))), CFG) for s in (0, 1)]
    ids, spans = expand_placeholders([5, 9, 510, 7, 510, 8], imgs, 510)
    assert [s.offset for s in spans] == [2, 2 + imgs[0].num_tokens + 1]
    assert ids[spans[0].offset:spans[0].end] == [510] * imgs[0].num_tokens and ids[-1] == 8
    check_spans(ids, spans, 510, CFG)
    with pytest.raises(ImageError, match="2 image placeholders but 1 images"):
        expand_placeholders([510, 510], imgs[:1], 510)
    with pytest.raises(ImageError, match="outside any image"):
        check_spans(ids + [510], spans, 510, CFG)
    shifted = ImageSpan(spans[0].offset + 1, *(getattr(spans[0], k) for k in
                                                ("n_vit_h", "n_vit_w", "n_llm_h", "n_llm_w", "digest", "patches")))
    with pytest.raises(ImageError):
        check_spans(ids, [shifted], 510, CFG)


def test_wire_form_round_trips():
    img = preprocess(Image.open(io.BytesIO(png(40, 24))), CFG)
    span = expand_placeholders([510], [img], 510)[1][0]
    back = ImageSpan.from_wire(span.to_wire())
    assert torch.equal(back.patches, span.patches) and back.digest == span.digest and back.offset == 0
    with pytest.raises(ImageError, match="malformed"):
        ImageSpan.from_wire({"offset": 0})


def test_data_urls_and_bad_images(tmp_path):
    policy = MediaPolicy()
    assert load_image(data_url(png(8, 6)), policy).size == (8, 6)
    for url, message in [("data:image/png,abc", "base64"), ("data:image/png;base64,@@@", "not valid base64"),
                         (data_url(b"not an image at all"), "not an image"),
                         (data_url(png(8, 6)[:60]), "corrupt"), ("ftp://host/x.png", "unsupported image URL"),
                         ("", "non-empty")]:
        with pytest.raises(ImageError, match=message):
            load_image(url, policy)
    with pytest.raises(ImageError, match="larger than"):
        image_bytes(data_url(png(64, 64)), MediaPolicy(max_bytes=100))
    with pytest.raises(ImageError, match="pixels"):
        load_image(data_url(png(64, 64)), MediaPolicy(max_pixels=1000))
    with pytest.raises(ImageError, match="at most 1"):
        MediaPolicy(max_images=1).check_count(2)


def test_local_files_only_inside_the_allowed_directory(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(png(8, 6))
    (outside / "b.png").write_bytes(png(8, 6))
    (inside / "link.png").symlink_to(outside / "b.png")
    allowed = MediaPolicy(allowed_local_path=str(inside))
    assert load_image(f"file://{inside}/a.png", allowed).size == (8, 6)
    with pytest.raises(ImageError, match="disabled"):
        load_image(f"file://{inside}/a.png", MediaPolicy())
    for url in (f"file://{outside}/b.png", f"file://{inside}/../secret/b.png", f"file://{inside}/link.png"):
        with pytest.raises(ImageError, match="outside the allowed"):
            load_image(url, allowed)
    with pytest.raises(ImageError, match="no such file"):
        load_image(f"file://{inside}/missing.png", allowed)


def test_remote_urls_follow_the_policy():
    with pytest.raises(ImageError, match="disabled"):
        image_bytes("http://127.0.0.1:9/x.png", MediaPolicy(allow_remote=False))
    with pytest.raises(ImageError, match="allowed media domains"):
        image_bytes("http://127.0.0.1:9/x.png", MediaPolicy(allowed_domains=("example.com",)))
    with pytest.raises(ImageError, match="loopback, private or link-local"):  # by default
        image_bytes("http://127.0.0.1:9/x.png", MediaPolicy())
    with pytest.raises(ImageError, match="failed"):  # listed, so fetched: nothing listens on the discard port
        image_bytes("http://127.0.0.1:9/x.png", MediaPolicy(fetch_timeout_s=2, allowed_domains=("127.0.0.1",)))
    with pytest.raises(ImageError, match="cannot be read"):
        image_bytes("http://[::1/x.png", MediaPolicy())


def test_chunks_never_end_inside_an_image_span():
    spans = ((10, 30, "a"), (40, 45, "b"))
    assert whole_images(spans, 0, 8, 8) == 8  # before the span
    assert whole_images(spans, 0, 20, 20) == 10  # would end inside: stops at the span's start
    assert whole_images(spans, 10, 5, 5) == 0  # starts at the span, too small a budget: waits
    assert whole_images(spans, 10, 5, 25) == 20  # starts at the span: takes it whole
    assert whole_images(spans, 15, 5, 64) == 15  # a prefix hit inside the span: to its end
    assert whole_images(spans, 30, 12, 12) == 10 and whole_images(spans, 0, 60, 60) == 60


def test_prefix_cache_keys_blocks_by_image_content():
    tokens = [1] * 4 + [510] * 8 + [2] * 4
    plain = chain_hashes(tokens, 4, None, [])
    a = chain_hashes(tokens, 4, None, [], ((4, 12, "img-a"),))
    b = chain_hashes(tokens, 4, None, [], ((4, 12, "img-b"),))
    assert a[0] == b[0] == plain[0]  # the text block before the image is shared
    assert a[1] != b[1] and a[3] != b[3]  # every block from the image on depends on which image it was
    assert chain_hashes(tokens, 4, None, [], ((4, 12, "img-a"),)) == a


def test_messages_flatten_and_tokenise_around_images():
    flat, sources = flatten_messages([{"role": "user", "content": [
        {"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "text", "text": " and"}, {"type": "image_pil", "image_pil": "PIL"}]}])
    assert flat[0]["content"] == f"look {IMAGE_SENTINEL} and{IMAGE_SENTINEL}" and sources == ["data:x", "PIL"]
    encode = lambda text, special: ([0] if special else []) + [len(w) for w in text.split()]  # noqa: E731
    ids = tokens_around_images(encode, f"a b{IMAGE_SENTINEL}ccc{IMAGE_SENTINEL}", 2, 510, True)
    assert ids == [0, 1, 1, 510, 3, 510]
    with pytest.raises(ImageError, match="image positions"):
        tokens_around_images(encode, "no marker", 1, 510, True)
    with pytest.raises(ValueError, match="not supported"):
        flatten_messages([{"role": "user", "content": [{"type": "audio_url"}]}])


@pytest.fixture(scope="module")
def web():
    """A local HTTP server: /img.png, /big (5 MB), /slow (trickles), /404, /away (redirects to another host)."""
    import http.server
    import threading
    import time

    body = png(16, 12)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:9/elsewhere.png")
                self.end_headers()
                return
            if self.path == "/home":
                self.send_response(302)
                self.send_header("Location", "/img.png")
                self.end_headers()
                return
            data = {"/img.png": body, "/big": b"x" * 5_000_000, "/slow": body}.get(self.path)
            self.send_response(404 if data is None else 200)
            self.end_headers()
            for i in range(0, len(data or b""), 64):
                self.wfile.write(data[i:i + 64])
                if self.path == "/slow":
                    self.wfile.flush()
                    time.sleep(0.2)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_fetches_keep_their_limits(web):
    policy = MediaPolicy(fetch_timeout_s=1.0, max_bytes=1_000_000, block_private=False)
    assert load_image(f"{web}/img.png", policy).size == (16, 12)
    assert load_image(f"{web}/home", policy).size == (16, 12)  # a redirect on the same host
    for path, message in [("/big", "larger than"), ("/slow", "longer than 1 s"), ("/404", "HTTP 404")]:
        with pytest.raises(ImageError, match=message):
            image_bytes(web + path, policy)
    with pytest.raises(ImageError, match="allowed media domains"):  # each redirect hop is checked
        image_bytes(f"{web}/away", MediaPolicy(allowed_domains=("127.0.0.1",)))
    with pytest.raises(ImageError, match="supported format"):  # a real PNG decoder, but no EPS / TIFF / ...
        load_image("data:image/tiff;base64," + base64.b64encode(_tiff()).decode(), MediaPolicy())


def _tiff() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "TIFF")
    return buf.getvalue()
