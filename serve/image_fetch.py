"""An image URL of a chat content part to its encoded bytes: a ``data:`` URL, a local file under
``--allowed-local-media-path``, or an ``http(s)`` URL with ``--allow-remote-images`` (size- and time-limited).

Every failure is an :class:`~llmc.serve.errors.APIError` 400 naming the part (``where``); decoding the bytes is
serve/images.py's (llmc.runtime.vision).
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from llmc.serve.errors import APIError
from llmc.serve.state import ServeConfig

_CHUNK = 64 << 10  # bytes read from a remote image at a time


def _refuse(where: str, message: str, code: str = "invalid_image_url") -> APIError:
    return APIError(400, f"{where}: {message}", param=where, code=code)


def check_url(url: str, where: str, config: ServeConfig) -> None:
    """Refuse (400) a URL this server will not read, before any work: its scheme, a local file outside the allowed
    directory, a remote URL without ``--allow-remote-images``."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        return
    if scheme in ("http", "https"):
        if not config.allow_remote_images:
            raise _refuse(where, f"remote image URLs ({scheme}://) are not fetched by this server; send the image "
                          "as a data: URL (data:image/png;base64,...) or start llmc serve with --allow-remote-images",
                          "remote_images_disabled")
        return
    if scheme in ("", "file"):
        local_path(url, where, config)
        return
    raise _refuse(where, f"unsupported image URL scheme {scheme!r}; give a data: URL (data:image/png;base64,...)")


def image_bytes(url: str, where: str, config: ServeConfig) -> bytes:
    """The encoded image ``url`` names (checked as :func:`check_url`)."""
    check_url(url, where, config)
    if url.startswith("data:"):
        return data_url_bytes(url, where)
    if url.lower().startswith(("http://", "https://")):
        return _fetch(url, where, config)
    path = local_path(url, where, config)
    try:
        size = path.stat().st_size
        if size > config.max_image_bytes:
            raise _refuse(where, f"{size} bytes, over the limit of {config.max_image_bytes} for one image",
                          "image_too_large")
        return path.read_bytes()
    except OSError as exc:
        raise _refuse(where, f"cannot read the local image ({exc.strerror or type(exc).__name__})") from None


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of ``data:[<media type>][;base64],<data>`` (an image media type, or none)."""
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise _refuse(where, "bad data URL: no ',' after the media type (data:image/png;base64,...)")
    params = [p.strip().lower() for p in head.split(";")]
    media = params[0]
    if media and not media.startswith("image/"):
        raise _refuse(where, f"bad data URL: media type {media!r} is not an image (image/png, image/jpeg, "
                      "image/webp, image/gif)")
    if "base64" not in params[1:]:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _refuse(where, f"bad data URL: invalid base64 ({exc})") from None


def local_path(url: str, where: str, config: ServeConfig) -> Path:
    """The file a ``file://`` URL or a path names, resolved (symlinks followed), inside the allowed directory;
    a relative path is relative to it."""
    root = config.allowed_local_media_path
    if root is None:
        raise _refuse(where, "local image files are not served; send the image as a data: URL, or start llmc serve "
                      "with --allowed-local-media-path DIR", "local_images_disabled")
    if url.startswith("file:"):
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _refuse(where, f"file URL on another host ({parts.netloc!r}); only local files are read")
        raw = urllib.parse.unquote(parts.path)
    else:
        raw = url
    base = Path(root).resolve()
    path = (base / raw).resolve()
    if not path.is_relative_to(base):
        raise _refuse(where, f"{raw}: outside the allowed local media directory (--allowed-local-media-path)",
                      "local_image_not_allowed")
    return path


def _fetch(url: str, where: str, config: ServeConfig) -> bytes:
    """The body of a GET of ``url``: at most ``max_image_bytes``, within ``image_fetch_timeout`` seconds in all."""
    deadline = time.monotonic() + config.image_fetch_timeout
    limit = config.max_image_bytes
    request = urllib.request.Request(url, headers={"User-Agent": "llmc-serve", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(request, timeout=config.image_fetch_timeout) as response:  # noqa: S310
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _refuse(where, f"the remote image is {declared} bytes, over the limit of {limit}",
                              "image_too_large")
            chunks, size = [], 0
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _refuse(where, f"the remote image is over the limit of {limit} bytes", "image_too_large")
                if time.monotonic() > deadline:
                    raise _refuse(where, f"fetching the remote image took over {config.image_fetch_timeout} s",
                                  "image_fetch_timeout")
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        raise _refuse(where, f"fetching the remote image: HTTP {exc.code} {exc.reason}", "image_fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise _refuse(where, f"fetching the remote image failed ({reason})", "image_fetch_failed") from None
