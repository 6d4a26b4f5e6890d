"""Where an image may come from, and decoding it: `data:` URLs (base64) always; `file://` paths only inside
`--allowed-local-media-path`; `http(s)://` URLs only when remote fetching is on, with a size and a time limit.
Everything that goes wrong is an ImageError (the server's 400) naming the problem; nothing is read or fetched
outside what the policy allows.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from deepinfer.multimodal.image_processor import ImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # decoders run on untrusted bytes: only these (no EPS / Ghostscript)


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: str | None = None  # file:// URLs must resolve inside this directory; None: refused
    allow_remote: bool = True  # http(s) URLs
    allowed_domains: tuple[str, ...] | None = None  # http(s) hosts allowed; None: any
    block_private: bool = True  # refuse hosts resolving to loopback / private / link-local addresses (unless listed)
    max_bytes: int = 20 * 2**20  # encoded size of one image
    max_pixels: int = 16_000_000  # decoded width x height (decompression bombs: 48 MB as RGB)
    fetch_timeout_s: float = 10.0
    max_images: int = 8  # per request

    def check_count(self, n: int) -> None:
        if n > self.max_images:
            raise ImageError(f"{n} images in one request; at most {self.max_images} are allowed "
                             "(--limit-mm-per-prompt)")


def image_bytes(url: str, policy: MediaPolicy) -> bytes:
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    try:
        return _bytes_of(url, policy)
    except (ValueError, OSError) as e:  # a malformed URL or path, an unreadable file (ImageError passes through)
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"the image URL cannot be read: {type(e).__name__}: {e}") from None


def _bytes_of(url: str, policy: MediaPolicy) -> bytes:
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, policy)
    if scheme == "file":
        return _local_file(url, policy)
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    raise ImageError(f"unsupported image URL scheme {scheme or url[:16]!r}: use a data: URL (base64), an http(s) "
                     "URL or, with --allowed-local-media-path, a file:// URL")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise ImageError("a data: image URL must be base64 encoded (data:image/png;base64,...)")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise ImageError(f"image is larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: image URL is not valid base64") from None


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise ImageError("file:// image URLs are disabled; start the server with --allowed-local-media-path DIR")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageError(f"file:// URL with a host ({parsed.netloc!r}) is not a local path")
    root = Path(policy.allowed_local_path).resolve()
    path = Path(unquote(parsed.path)).resolve()  # symlinks and .. resolved before the check
    if not path.is_relative_to(root):
        raise ImageError(f"{path} is outside the allowed local media path")
    if not path.is_file():
        raise ImageError(f"{path}: no such file")
    if path.stat().st_size > policy.max_bytes:
        raise ImageError(f"image is larger than {policy.max_bytes} bytes")
    return path.read_bytes()


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    """GET with the size and time limits; redirects are followed by hand (at most 5), each hop's host checked."""
    import httpx

    deadline = time.monotonic() + policy.fetch_timeout_s  # for the whole fetch; httpx's timeouts are per read
    try:
        with httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                _check_remote(url, policy)
                if time.monotonic() > deadline:
                    raise httpx.TimeoutException("deadline")
                with client.stream("GET", url) as resp:
                    if resp.is_redirect and resp.headers.get("location"):
                        url = str(resp.url.join(resp.headers["location"]))
                        continue
                    if resp.status_code != 200:
                        raise ImageError(f"fetching the image gave HTTP {resp.status_code}")
                    return _read_limited(resp, policy, deadline)
            raise ImageError(f"fetching the image took more than {_MAX_REDIRECTS} redirects")
    except httpx.TimeoutException:
        raise ImageError(f"fetching the image took longer than {policy.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as e:
        raise ImageError(f"fetching the image failed: {type(e).__name__}") from None


_MAX_REDIRECTS = 5


def _check_remote(url: str, policy: MediaPolicy) -> None:
    parsed = urlparse(url)
    if not policy.allow_remote:
        raise ImageError("remote image URLs are disabled on this server")
    if parsed.scheme.lower() not in ("http", "https"):
        raise ImageError(f"an image URL redirected to an unsupported scheme {parsed.scheme!r}")
    host = (parsed.hostname or "").lower()
    listed = policy.allowed_domains is not None and host in policy.allowed_domains
    if policy.allowed_domains is not None and not listed:
        raise ImageError(f"image host {host!r} is not among the allowed media domains")
    if policy.block_private and not listed and _private(host, parsed.port):
        raise ImageError(f"image host {host!r} is a loopback, private or link-local address (list it in "
                         "--allowed-media-domains to allow it)")


def _private(host: str, port: int | None) -> bool:
    """Whether any address the host resolves to is not a public one (an unresolvable host is left to the fetch)."""
    try:
        infos = socket.getaddrinfo(host, port or 80, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return any(not ipaddress.ip_address(info[4][0].split("%")[0]).is_global for info in infos)


def _read_limited(resp, policy: MediaPolicy, deadline: float) -> bytes:
    if int(resp.headers.get("content-length") or 0) > policy.max_bytes:
        raise ImageError(f"image is larger than {policy.max_bytes} bytes")
    data = bytearray()
    for chunk in resp.iter_bytes():
        data += chunk
        if len(data) > policy.max_bytes:
            raise ImageError(f"image is larger than {policy.max_bytes} bytes")
        if time.monotonic() > deadline:
            raise ImageError(f"fetching the image took longer than {policy.fetch_timeout_s:g} s")
    return bytes(data)


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """A fully decoded RGB image; refuses non-images, other formats, corrupt files and oversize pixel counts (checked
    from the header, before decoding)."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)  # not `with`: closing would free a returned RGB image
        if img.width * img.height > policy.max_pixels:
            raise ImageError(f"image is {img.width} x {img.height} pixels; at most {policy.max_pixels} are allowed")
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"the data is not an image of a supported format ({', '.join(FORMATS)})") from None
    except Exception as e:  # noqa: BLE001  Pillow's decoders raise many types on bad input; all are the input's
        raise ImageError(f"the image is corrupt or truncated ({type(e).__name__})") from None


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    return decode_image(image_bytes(url, policy), policy)
