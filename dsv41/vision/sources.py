"""Where image bytes come from: data URLs, base64 payloads and local files — never the network.

A chat message's image blocks become records (chat/encoding.py, TOKENIZER-AND-CHAT §4.1): OpenAI
`image_url` parts give `{"url": …}`, Anthropic blocks their `source` (`{"type": "base64", "data": …}`),
others `data`. `ImageSources` reads a record's bytes under its limits: a size cap, and local files only
where it allows them (the command line: any path; the server: paths under one directory it was given,
none by default). `prompt_images` turns a prompt's token ids and records into the ids with image spans.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

from ..chat.encoding import IMAGE_PLACEHOLDER
from ..config import ModelConfig
from ..errors import ImageError
from .processor import MAX_IMAGE_PIXELS, ImageInput, load_image
from .spans import PromptImage, expand_images

MAX_IMAGE_BYTES = 20 << 20


@dataclass(frozen=True)
class ImageSources:
    """How records may be read: `local_files` True (any path), a directory (paths under it) or None."""

    local_files: bool | Path | None = None
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    def read(self, record: dict, what: str = "image") -> bytes:
        """The bytes a record stands for (ImageError naming `what` if they cannot be had)."""
        if not isinstance(record, dict):
            raise ImageError(f"{what}: expected an image record, got {type(record).__name__}")
        data = record.get("data")
        if isinstance(data, bytes):
            return self._sized(data, what)
        if isinstance(data, str):
            return self._base64(data, what)
        source = record.get("source")
        if isinstance(source, dict):
            if source.get("data") is not None:
                return self._base64(source["data"], what)
            if source.get("url"):
                return self.read({"url": source["url"]}, what)
            raise ImageError(f"{what}: an image source needs base64 `data` or a `url` "
                             f"(source type {source.get('type')!r})")
        url = record.get("url")
        if isinstance(url, str) and url:
            return self._url(url, what)
        raise ImageError(f"{what}: the image record has no data, source or url (keys: {sorted(record)})")

    def _url(self, url: str, what: str) -> bytes:
        if url.startswith("data:"):
            header, comma, payload = url.partition(",")
            if not comma or ";base64" not in header:
                raise ImageError(f"{what}: a data URL must be base64 (data:image/png;base64,…), got {header[:40]!r}")
            return self._base64(payload, what)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in ("http", "https", "ftp"):
            raise ImageError(f"{what}: {scheme} URLs are not fetched (dsv41 makes no network requests); send the "
                             f"image as a data URL or base64")
        if scheme == "file":
            url = url[len("file://"):] if url.startswith("file://") else url[len("file:"):]
        return self._file(Path(url), what)

    def _file(self, path: Path, what: str) -> bytes:
        if self.local_files is None or self.local_files is False:
            raise ImageError(f"{what}: local files are not accepted here ({path}); send a data URL or base64")
        resolved = path.expanduser().resolve()
        if isinstance(self.local_files, Path):
            root = self.local_files.expanduser().resolve()
            if not resolved.is_relative_to(root):
                raise ImageError(f"{what}: {path} is outside the image directory {root}")
        try:
            size = resolved.stat().st_size
            if size > self.max_bytes:
                raise ImageError(f"{what}: {path} is {size:,} bytes, more than the limit of {self.max_bytes:,}")
            return resolved.read_bytes()
        except FileNotFoundError:
            raise ImageError(f"{what}: no such file: {path}") from None
        except IsADirectoryError:
            raise ImageError(f"{what}: {path} is a directory") from None
        except PermissionError:
            raise ImageError(f"{what}: cannot read {path} (permission denied)") from None

    def _base64(self, payload, what: str) -> bytes:
        if not isinstance(payload, str):
            raise ImageError(f"{what}: base64 image data must be a string")
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise ImageError(f"{what}: the image data is larger than the limit of {self.max_bytes:,} bytes")
        try:
            return self._sized(base64.b64decode(payload, validate=True), what)
        except (binascii.Error, ValueError):
            raise ImageError(f"{what}: the image data is not valid base64") from None

    def _sized(self, data: bytes, what: str) -> bytes:
        if len(data) > self.max_bytes:
            raise ImageError(f"{what}: {len(data):,} bytes, more than the limit of {self.max_bytes:,}")
        return data

    def load(self, record: dict, cfg: ModelConfig, what: str = "image") -> ImageInput:
        return load_image(self.read(record, what), cfg, what=what, max_pixels=self.max_pixels)


def prompt_images(ids: list[int], records: list[dict], cfg: ModelConfig, sources: ImageSources,
                  where: str = "image", tokenizer=None) -> tuple[list[int], tuple[PromptImage, ...]]:
    """A prompt's ids with each image placeholder expanded into its image's span; → (ids, the spans).
    The images are named `{where} 0`, `{where} 1`, … in errors. With `tokenizer`, its id of the
    placeholder, if it has one, must be the config's image_token_id (TOKENIZER-AND-CHAT §7)."""
    if not records:
        return ids, ()
    if not cfg.vision_enabled:
        raise ImageError("this model has no vision encoder (vision_n_layers is 0); it cannot take images")
    known = None if tokenizer is None else tokenizer.token_to_id(IMAGE_PLACEHOLDER)
    if known is not None and known != cfg.image_token_id:
        raise ImageError(f"the tokenizer's {IMAGE_PLACEHOLDER} is token {known}, but the config's image_token_id is "
                         f"{cfg.image_token_id}: prompts' images would not be found")
    images = [sources.load(r, cfg, f"{where} {k}") for k, r in enumerate(records)]
    return expand_images(ids, images, cfg.image_token_id)
