"""An image reference resolved to its bytes, and the bytes checked to be an image Pillow reads whole.

References are what inputs write: a local path (relative to the input file), a ``file://`` or
``data:`` URL, or bytes from a dataset's ``Image`` column (``{"bytes": ..., "path": ...}``). packprep
is offline: an ``http(s)://`` URL is a rejection, never a download. Every failure is a ``Rejected``
whose reason names the image, so that the record's rejection says which of its images is bad.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ..errors import Rejected

REMOTE = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")


@dataclass(frozen=True)
class ImageFile:
    """An image's bytes and where they came from (``source``: as written, or ``bytes:<sha256>`` for bytes
    the input itself holds: a dataset's, a data: URL's)."""

    source: str
    data: bytes
    sha256: str
    path: str | None = None  # the file read, resolved (None: bytes from the input itself)


def resolve(reference: Any, base_dir: str) -> ImageFile:
    """The bytes ``reference`` names, or Rejected."""
    if isinstance(reference, dict):
        if isinstance(reference.get("bytes"), (bytes, bytearray)) and reference["bytes"]:
            data = bytes(reference["bytes"])
            return ImageFile(f"bytes:{_sha(data)}", data, _sha(data))
        reference = reference.get("path") or reference.get("url")
    if isinstance(reference, (bytes, bytearray)):
        data = bytes(reference)
        return ImageFile(f"bytes:{_sha(data)}", data, _sha(data))
    if not isinstance(reference, str) or not reference.strip():
        raise Rejected(f"an image reference that is not a path or URL: {str(reference)[:80]!r}", "image_missing")
    if reference.startswith("data:"):
        data = _data_url(reference)
        return ImageFile(f"bytes:{_sha(data)}", data, _sha(data))  # the input holds the only copy
    if reference.lower().startswith(REMOTE):
        raise Rejected(f"{reference[:200]} is a remote URL: packprep reads no network; download the images and "
                       "write local paths", "image_remote")
    path = local_path(reference, base_dir)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise Rejected(f"{reference} does not exist (looked for {path})", "image_missing") from None
    except IsADirectoryError:
        raise Rejected(f"{reference} is a folder, not an image file", "image_missing") from None
    except OSError as exc:
        raise Rejected(f"{reference} cannot be read: {exc.strerror}", "image_missing") from None
    return ImageFile(reference, data, _sha(data), path)


def local_path(reference: str, base_dir: str) -> str:
    """A path or ``file://`` URL as a file name, relative ones from ``base_dir`` (the input's folder)."""
    if reference.startswith("file://"):
        reference = unquote(urlparse(reference).path)
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(reference)))


def _data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        return unquote(payload).encode("latin-1", "replace")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise Rejected(f"{url[:40]}... is a data: URL whose base64 does not decode", "image_corrupt") from None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_image(image: ImageFile):
    """The decoded image (pixels loaded), or Rejected: empty, not an image, truncated, or more pixels
    than Pillow's ``MAX_IMAGE_PIXELS`` (a decompression bomb)."""
    from PIL import Image

    if not image.data:
        raise Rejected(f"{image.source} is empty (0 bytes)", "image_empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            picture = Image.open(io.BytesIO(image.data))
            picture.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise Rejected(f"{image.source} has more pixels than Pillow reads safely ({Image.MAX_IMAGE_PIXELS:,}, "
                       "PIL.Image.MAX_IMAGE_PIXELS): a decompression bomb or a very large image",
                       "image_too_large") from None
    except Image.UnidentifiedImageError:
        raise Rejected(f"{image.source} is not an image Pillow can read ({len(image.data)} bytes)",
                       "image_corrupt") from None
    except (OSError, SyntaxError, ValueError) as exc:
        code = "image_truncated" if "truncated" in str(exc) else "image_corrupt"
        raise Rejected(f"{image.source} cannot be decoded: {str(exc)[:120]}", code) from None
    if picture.width == 0 or picture.height == 0:
        raise Rejected(f"{image.source} has no pixels ({picture.width}x{picture.height})", "image_empty")
    return picture


def named(number: int, exc: Rejected) -> Rejected:
    """``exc`` with the image's number in the record in front of its reason."""
    return Rejected(f"image {number}: {exc}", exc.code)
