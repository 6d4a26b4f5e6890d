"""Image inputs through the real server and the official clients: base64 images, two images, an image with tools,
streaming, the Anthropic endpoint, file:// under --allowed-local-media-path; every bad image a 400 that leaves the
server serving; a repeat of the same image served from the encoder cache and the prefix cache (read from
/metrics). The checkpoint is the vision golden tests/golden/v41/v (its tokenizer is word-level, so the text is
nonsense; the token counts and the cache behaviour are what is checked)."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from test_server import ServerProcess, _wait_for, metrics
from v41_golden import GOLDEN

V = GOLDEN / "v"
IMAGES = V / "images"
ENCODED, HITS = "deepinfer:images_encoded_total", "deepinfer:prefix_cache_hits_total"
CACHE_HITS = "deepinfer:image_encoder_cache_hits_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("images") / "server.log"
    proc = ServerProcess(V, log, "--max-model-len", "256", "--allowed-local-media-path", str(IMAGES),
                         "--limit-mm-per-prompt", '{"image": 2}', "--media-fetch-timeout", "2",
                         "--max-image-bytes", "3000000")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def noise_png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def solid_png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (40, 90, 200)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
               for p in parts]
    return [{"role": "user", "content": content}]


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=4,
                                          temperature=0, **kw)


def test_one_base64_image(client):
    text_only = _chat(client, user("the cat sat"))
    out = _chat(client, user("the cat sat", (data_url(IMAGES / "plain.png"),)))
    assert out.choices[0].finish_reason in ("length", "stop")
    # plain.png: a 3 x 6 token grid, 3 * (6 + 1) + 2 = 23 positions in place of one image part (+1: the text is
    # tokenised apart at the image, and this word-level tokenizer joins "sat" with the role marker after it)
    assert out.usage.prompt_tokens - text_only.usage.prompt_tokens in (23, 24)


def test_two_images_and_a_local_file(client):
    out = _chat(client, user("a", (data_url(IMAGES / "wide.png"),), "b", ((IMAGES / "tall.png").as_uri(),)))
    assert out.usage.prompt_tokens > 32 + 37  # wide.png's and tall.png's spans


def test_image_with_tools(client):
    tools = [{"type": "function", "function": {"name": "describe", "description": "describe a picture",
                                               "parameters": {"type": "object", "properties": {}}}}]
    out = _chat(client, user("what is this", (data_url(IMAGES / "small.png"),)), tools=tools)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_streaming_with_an_image(client):
    stream = _chat(client, user("look", (data_url(IMAGES / "big.png"),)), stream=True,
                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_anthropic_image_block(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0)
    png = base64.b64encode((IMAGES / "plain.png").read_bytes()).decode()
    msg = client.messages.create(model="v", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": "what is it"}]}])
    assert msg.usage.output_tokens == 3 and msg.usage.input_tokens > 23


def test_repeat_of_an_image_uses_the_encoder_and_prefix_caches(client, server):
    url = "data:image/png;base64," + base64.b64encode(noise_png(40, 24, seed=7)).decode()
    before = metrics(server.url)
    _chat(client, user("once more", (url,)))
    _wait_for(lambda: metrics(server.url)[ENCODED] == before[ENCODED] + 1, 5.0)
    mid = metrics(server.url)
    _chat(client, user("once more", (url,)))
    _wait_for(lambda: metrics(server.url)[HITS] > mid[HITS], 5.0)
    after = metrics(server.url)
    assert after[ENCODED] == mid[ENCODED]  # not encoded again
    # another image with the same grid: encoded, and no cached block past the text before it
    other = "data:image/png;base64," + base64.b64encode(noise_png(40, 24, seed=8)).decode()
    _chat(client, user("once more", (other,)))
    _wait_for(lambda: metrics(server.url)[ENCODED] == after[ENCODED] + 1, 5.0)
    assert metrics(server.url)["deepinfer:images_received_total"] >= before["deepinfer:images_received_total"] + 3


BAD = [
    (user("x", ("data:image/png;base64," + base64.b64encode(b"plain text").decode(),)), "not an image"),
    (user("x", ("data:image/png;base64," + base64.b64encode(noise_png(8, 8, 0)[:50]).decode(),)), "corrupt"),
    (user("x", ("data:image/png;base64,%%%",)), "base64"),
    (user("x", ("file:///etc/hostname",)), "outside the allowed"),
    (user("x", ("ftp://example.com/a.png",)), "unsupported image URL scheme"),
    (user("x", ("http://127.0.0.1:9/a.png",)), "loopback, private or link-local"),
    (user("x", ("data:image/png;base64," + base64.b64encode(noise_png(1100, 1000, 1)).decode(),)), "larger than"),
    (user("x", (solid_png(5000, 4000),)), "pixels"),  # 20 M pixels, small on the wire
    (user(*[(data_url(IMAGES / "small.png"),)] * 3), "at most 2"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "not supported"),
]


@pytest.mark.parametrize("messages,message", BAD)
def test_bad_images_are_400s_and_the_server_keeps_serving(client, server, messages, message):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, messages)
    assert message in err.value.message
    assert httpx.get(server.url + "/health").status_code == 200
    assert _chat(client, user("still here")).usage.completion_tokens == 4
