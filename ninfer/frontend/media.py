"""Images of OpenAI ``image_url`` parts -> Qwen3.5 vision input, with an identity and a byte budget.

    url         data:<type>;base64,<payload>, or file:///abs/path only under the server's allowed
                local media path (vLLM's --allowed-local-media-path); http(s) is refused: nothing
                is fetched from the network
    decode      Pillow on a fixed list of formats; the pixel count is checked from the header
                before any pixel is decoded (decompression bombs); transparency composited onto
                white, then RGB, as transformers' convert_to_rgb
    preprocess  transformers' Qwen2VLImageProcessor (PIL backend, the one Qwen3.5 maps to):
                smart_resize to multiples of patch·merge within [min_pixels, max_pixels], resize
                (bicubic), ·1/255, (x - mean) / std, patches [N, C·T·P·P] in 2×2 merge-block
                order with the one frame repeated T times; grid_thw (1, H/P, W/P)
    identity    digest = blake2b(version, the parameters that change pixel_values,
                blake2b(the original bytes)): the same image re-sent hits, a different image
                behind identical prompt tokens never does
    cache       MediaCache: prepared images by digest, least recently used out, within a byte
                budget; thread-safe (the server prepares on a thread pool)
    prompt      expand_image_pads: each rendered <|vision_start|><|image_pad|><|vision_end|> gets
                N / merge² pads; per image (offset of its first pad, num_tokens, digest)

Numpy and Pillow only, no torch: the frontend prepares, the worker runs the tower on
``torch.from_numpy(pixel_values)`` (native/model/vision.py). pixel_values equal transformers'
bit for bit (tests/frontend/test_media.py). EXIF orientation is not applied (transformers does
not either); an animated image is its first frame.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import unquote, urlparse

import msgspec
import numpy as np
from msgspec import Meta, Struct
from PIL import Image, UnidentifiedImageError

from ninfer import protocol as P
from ninfer.errors import ConfigError, MediaError, ModelLoadError
from ninfer.frontend import schema as S

# what Pillow may open: OpenAI's four and BMP; never the rare ones, nor EPS (it runs Ghostscript)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# changes when decoding or preprocessing would make different pixel_values from the same input
VERSION = b"ninfer-media-1\0"

Positive = Annotated[int, Meta(ge=1)]
Triple = tuple[float, float, float]


class ImageParams(Struct, frozen=True, kw_only=True):
    """Everything besides the image that decides pixel_values (a ``preprocessor_config.json``).

    Defaults: Qwen3.5 / Qwen3-VL checkpoints (size 64..16384 merged tokens of 32×32 pixels).
    """

    min_pixels: Positive = 64 * 32 * 32
    max_pixels: Positive = 16384 * 32 * 32
    patch_size: Positive = 16
    temporal_patch_size: Positive = 2
    merge_size: Positive = 2
    image_mean: Triple = (0.5, 0.5, 0.5)
    image_std: Triple = (0.5, 0.5, 0.5)
    rescale_factor: Annotated[float, Meta(gt=0)] = 1 / 255
    resample: Annotated[int, Meta(ge=0, le=5)] = 3   # a PIL filter; 3 = bicubic

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: one merged token is factor²."""
        return self.patch_size * self.merge_size


DEFAULT_PARAMS = ImageParams()


class MediaLimits(Struct, frozen=True, kw_only=True):
    """What the server accepts before preparing (not in the digest: it never changes pixels)."""

    max_bytes: Positive = 20 * 2 ** 20
    max_image_pixels: Positive = 89_478_485   # Pillow's own MAX_IMAGE_PIXELS default
    allowed_local_path: str | None = None     # file:// URLs only under this directory


DEFAULT_LIMITS = MediaLimits()


class ImageTokens(Struct, frozen=True):
    """The ids of ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` (config.json)."""

    start: int
    pad: int
    end: int


class PreparedImage(Struct, frozen=True):
    """One image ready for the tower. pixel_values: [N, 3·T·P·P] float32, read-only (shared)."""

    digest: str
    grid_thw: tuple[int, int, int]
    pixel_values: np.ndarray
    num_tokens: int     # N / merge²: the image's pads in the prompt
    nbytes: int


class ImageSpan(Struct, frozen=True):
    """Where one image sits in the expanded prompt: its pads are ids[offset:offset+num_tokens]."""

    offset: int
    num_tokens: int
    digest: str


# ---- the model directory ----------------------------------------------------------------------

def media_config(model_dir: str | Path) -> tuple[ImageParams, ImageTokens]:
    """The preprocessing parameters and vision token ids of a Qwen3.5 directory."""
    d = Path(model_dir)
    raw = _read_json(d / "config.json")
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelLoadError(f"{d / 'config.json'}: no 'vision_config' object (not a vision-language model)")
    pre = d / "preprocessor_config.json"
    params = image_params(_read_json(pre) if pre.is_file() else {}, vision, str(pre))
    return params, image_tokens(raw, str(d / "config.json"))


def image_params(pre: dict[str, Any], vision: dict[str, Any], where: str) -> ImageParams:
    """``preprocessor_config.json`` over Qwen3.5's defaults; the patch geometry is the tower's.

    As transformers, legacy ``min_pixels`` / ``max_pixels`` keys win over ``size``. A geometry
    other than the tower's, or a step switched off, is refused: the tower would see other pixels.
    """
    geometry = {"patch_size": vision.get("patch_size", DEFAULT_PARAMS.patch_size),
                "temporal_patch_size": vision.get("temporal_patch_size", DEFAULT_PARAMS.temporal_patch_size),
                "merge_size": vision.get("spatial_merge_size", DEFAULT_PARAMS.merge_size)}
    for key, value in geometry.items():
        if key in pre and pre[key] != value:
            raise ModelLoadError(f"{where}: {key}={pre[key]!r} but the vision tower's is {value}")
    for step in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if pre.get(step, True) is not True:
            raise ModelLoadError(f"{where}: {step}={pre[step]!r} is not supported (Qwen3.5 always does it)")
    size = pre.get("size") or {}
    fields = {**geometry,
              "min_pixels": pre.get("min_pixels", size.get("shortest_edge", DEFAULT_PARAMS.min_pixels)),
              "max_pixels": pre.get("max_pixels", size.get("longest_edge", DEFAULT_PARAMS.max_pixels)),
              "image_mean": _triple(pre.get("image_mean", DEFAULT_PARAMS.image_mean)),
              "image_std": _triple(pre.get("image_std", DEFAULT_PARAMS.image_std)),
              "rescale_factor": pre.get("rescale_factor", DEFAULT_PARAMS.rescale_factor),
              "resample": pre.get("resample", DEFAULT_PARAMS.resample)}
    try:
        params = msgspec.convert(fields, ImageParams)
    except msgspec.ValidationError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    if params.min_pixels > params.max_pixels or 0.0 in params.image_std:
        raise ModelLoadError(f"{where}: needs min_pixels <= max_pixels and a non-zero image_std, got {params}")
    return params


def image_tokens(raw: dict[str, Any], where: str) -> ImageTokens:
    ids = {k: raw.get(f"{k}_token_id") for k in ("vision_start", "image", "vision_end")}
    bad = [f"{k}_token_id" for k, v in ids.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ModelLoadError(f"{where}: no integer {', '.join(bad)}")
    return ImageTokens(ids["vision_start"], ids["image"], ids["vision_end"])


def _triple(x: Any) -> Any:
    """A scalar mean/std means all three channels (as transformers); anything else is checked."""
    return [x] * 3 if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return raw


# ---- reading an image_url ---------------------------------------------------------------------

def read_image_url(url: str, limits: MediaLimits, where: str = "image_url") -> bytes:
    """The encoded image behind ``url``: a base64 data URL, or an allowed local file."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, limits.max_bytes, where)
    if scheme == "file":
        return _file_url(url, limits, where)
    if scheme in ("http", "https"):
        raise MediaError(f"{where}: remote URLs are not fetched; send a data: URL (data:image/png;base64,...)")
    raise MediaError(f"{where}: unsupported URL {url[:40]!r}; send a data: URL (data:image/png;base64,...)"
                     " or, where the server allows local media, a file:// URL")


def _data_url(url: str, max_bytes: int, where: str) -> bytes:
    """Strict base64 (line breaks allowed): a corrupt payload is an error, not silently skipped."""
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise MediaError(f"{where}: only base64 data URLs are supported (data:image/png;base64,...)")
    try:
        data = base64.b64decode(payload.encode("ascii").translate(None, b" \t\r\n"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise MediaError(f"{where}: the data URL is not valid base64 ({exc})") from None
    _check_bytes(len(data), max_bytes, where)
    return data


def _file_url(url: str, limits: MediaLimits, where: str) -> bytes:
    """A regular file under the allowed local path (symlinks resolved before the check)."""
    if limits.allowed_local_path is None:
        raise MediaError(f"{where}: file:// URLs are not allowed (the server has no allowed local media path); "
                         "send a data: URL")
    parts = urlparse(url)
    raw_path = Path(unquote(parts.path))
    if parts.netloc not in ("", "localhost") or not raw_path.is_absolute():
        raise MediaError(f"{where}: a file URL names an absolute local path (file:///dir/image.png), got {url[:60]!r}")
    root = Path(limits.allowed_local_path).resolve()
    path = raw_path.resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"{where}: {raw_path} is outside the allowed local media path {root}")
    if not path.is_file():
        raise MediaError(f"{where}: {raw_path} is not a regular file")
    try:
        _check_bytes(path.stat().st_size, limits.max_bytes, where)
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"{where}: cannot read {raw_path} ({exc.strerror})") from None
    _check_bytes(len(data), limits.max_bytes, where)
    return data


def _check_bytes(n: int, max_bytes: int, where: str) -> None:
    if n > max_bytes:
        raise MediaError(f"{where}: the image is {n} bytes, more than the limit of {max_bytes}")


# ---- decoding ---------------------------------------------------------------------------------

def load_image(url: str, *, limits: MediaLimits = DEFAULT_LIMITS,
               where: str = "image_url") -> tuple[bytes, Image.Image]:
    """(the original bytes, the decoded RGB image) of one ``image_url``."""
    data = read_image_url(url, limits, where)
    return data, to_rgb(open_image(data, limits.max_image_pixels, where), where)


def open_image(data: bytes, max_image_pixels: int, where: str) -> Image.Image:
    """The image with only its header read: format and pixel count are checked before decoding."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        raise MediaError(f"{where}: too many pixels ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"{where}: not an image that can be decoded ({', '.join(FORMATS)}): {exc}") from None
    w, h = img.size
    if w * h > max_image_pixels:
        raise MediaError(f"{where}: the image is {w}x{h} = {w * h} pixels, more than the limit of {max_image_pixels}")
    return img


def to_rgb(img: Image.Image, where: str) -> Image.Image:
    """The pixels decoded, transparency composited onto white, RGB: transformers' convert_to_rgb."""
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            white = Image.new("RGBA", img.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
        return img.convert("RGB")
    except Exception as exc:  # corrupt input raises OSError, SyntaxError, zlib.error, struct.error, ...
        raise MediaError(f"{where}: the image data is corrupt ({type(exc).__name__}: {exc})") from None


# ---- preprocessing ----------------------------------------------------------------------------

def smart_resize(height: int, width: int, params: ImageParams, where: str = "image_url") -> tuple[int, int]:
    """transformers' smart_resize: multiples of the factor, within [min_pixels, max_pixels],
    the aspect ratio kept as closely as possible (Python's round, as theirs)."""
    f = params.factor
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"{where}: the image is {width}x{height}; its aspect ratio must be at most 200")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > params.max_pixels:
        beta = math.sqrt(height * width / params.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def preprocess(rgb: Image.Image, params: ImageParams) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB image -> (pixel_values [N, 3·T·P·P] float32, grid_thw)."""
    h, w = smart_resize(rgb.height, rgb.width, params)
    pixels = np.asarray(rgb.resize((w, h), resample=params.resample))     # [h, w, 3] uint8
    x = _levels(params)[pixels, np.arange(3)]                             # [h, w, 3] float32
    p = params.patch_size
    return _patchify(x, params), (1, h // p, w // p)


@lru_cache(maxsize=16)
def _levels(params: ImageParams) -> np.ndarray:
    """[256, 3]: every uint8 level rescaled and normalised per channel in transformers' exact
    float steps (float64 · factor -> float32, then (x - mean) / std in float32), so one lookup
    per pixel gives their values bit for bit without a float64 copy of the image."""
    v = (np.arange(256, dtype=np.float64) * params.rescale_factor).astype(np.float32)
    mean = np.array(params.image_mean, dtype=np.float32)
    std = np.array(params.image_std, dtype=np.float32)
    return (v[:, None] - mean) / std


def _patchify(x: np.ndarray, params: ImageParams) -> np.ndarray:
    """[h, w, C] -> [N, C·T·P·P]: patches in merge-block order (the tower's patch_coords), each
    [C, T, P, P] flattened with the single frame repeated T times."""
    h, w, c = x.shape
    p, m, t = params.patch_size, params.merge_size, params.temporal_patch_size
    gh, gw = h // p, w // p
    blocks = x.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)  # bh bw mh mw C ph pw
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    out = frames.reshape(gh * gw, c * t * p * p)   # a copy: frames is a broadcast view
    out.flags.writeable = False
    return out


# ---- identity and preparation -----------------------------------------------------------------

def media_digest(data: bytes, params: ImageParams) -> str:
    """blake2b over the version, the parameters and the hash of the original bytes."""
    h = hashlib.blake2b(VERSION, digest_size=32)
    h.update(msgspec.json.encode(params))
    h.update(hashlib.blake2b(data, digest_size=32).digest())
    return h.hexdigest()


def prepare_image(data: bytes, params: ImageParams, *, max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels,
                  max_prepared_bytes: int | None = None, where: str = "image_url") -> PreparedImage:
    """Decode and preprocess one encoded image; a prepared size over ``max_prepared_bytes`` is
    refused from the header, before any pixel is decoded."""
    img = open_image(data, max_image_pixels, where)
    h, w = smart_resize(img.height, img.width, params, where)
    nbytes = h * w * 3 * params.temporal_patch_size * 4     # h·w/P² patches of 3·T·P² float32
    if max_prepared_bytes is not None and nbytes > max_prepared_bytes:
        raise MediaError(f"{where}: the image ({img.width}x{img.height}, resized to {w}x{h}) needs {nbytes} bytes "
                         f"prepared, more than the whole media budget of {max_prepared_bytes} bytes")
    pixel_values, grid = preprocess(to_rgb(img, where), params)
    return PreparedImage(digest=media_digest(data, params), grid_thw=grid, pixel_values=pixel_values,
                         num_tokens=grid[1] * grid[2] // params.merge_size ** 2, nbytes=pixel_values.nbytes)


class MediaCache:
    """Prepared images by digest, least recently used evicted first, within ``budget_bytes`` of
    pixel_values. Preparation runs outside the lock, so a thread pool prepares in parallel; two
    threads preparing the same new image both compute and the first one stored is kept. Eviction
    drops only the cache's reference: a request holds its own PreparedImage objects."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 1:
            raise ConfigError(f"media budget_bytes={budget_bytes} is out of range: allowed >= 1")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, PreparedImage] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = self._hits = self._misses = self._evictions = 0

    def get_or_prepare(self, data: bytes, params: ImageParams, *,
                       max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels,
                       where: str = "image_url") -> PreparedImage:
        key = media_digest(data, params)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return hit
            self._misses += 1
        image = prepare_image(data, params, max_image_pixels=max_image_pixels,
                              max_prepared_bytes=self.budget_bytes, where=where)
        with self._lock:
            return self._store(image)

    def _store(self, image: PreparedImage) -> PreparedImage:
        kept = self._entries.get(image.digest)
        if kept is not None:
            self._entries.move_to_end(image.digest)
            return kept
        self._entries[image.digest] = image
        self._bytes += image.nbytes
        while self._bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
        return image

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "budget_bytes": self.budget_bytes,
                    "hits": self._hits, "misses": self._misses, "evictions": self._evictions}


# ---- requests ---------------------------------------------------------------------------------

def prepare_messages(messages: list[S.Message], cache: MediaCache, params: ImageParams,
                     limits: MediaLimits = DEFAULT_LIMITS) -> list[PreparedImage]:
    """Every image part of the messages, prepared, in the order the chat template renders them
    (message by message, part by part). Audio and file parts stay check_media's to refuse."""
    out = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if isinstance(part, S.ImagePart):
                where = f"messages[{i}].content[{j}].image_url"
                data = read_image_url(part_url(part.image_url, where), limits, where)
                out.append(cache.get_or_prepare(data, params, max_image_pixels=limits.max_image_pixels, where=where))
    return out


def part_url(image_url: Any, where: str) -> str:
    """OpenAI's ``{"url": ..., "detail": ...}`` (detail ignored, as vLLM), or the bare string."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise MediaError(f'{where}: expected an object {{"url": "data:image/png;base64,..."}}')
    return url


def expand_image_pads(ids: list[int], images: list[PreparedImage],
                      tokens: ImageTokens) -> tuple[list[int], list[ImageSpan]]:
    """The rendered prompt (one pad per image between vision start and end, as the template
    writes it) with image k's pad repeated images[k].num_tokens times, as transformers'
    processor expands it; and each image's span. A pad count other than the image count (e.g.
    "<|image_pad|>" typed in a message's text) or a pad outside start … end is refused."""
    pads = [k for k, t in enumerate(ids) if t == tokens.pad]
    if len(pads) != len(images):
        raise MediaError(f"the prompt has {len(pads)} image placeholders for {len(images)} images")
    out: list[int] = []
    spans = []
    last = 0
    for k, image in zip(pads, images):
        if not (0 < k < len(ids) - 1 and ids[k - 1] == tokens.start and ids[k + 1] == tokens.end):
            raise MediaError(f"prompt token {k}: an image placeholder outside <|vision_start|> ... <|vision_end|>")
        out += ids[last:k]
        spans.append(ImageSpan(offset=len(out), num_tokens=image.num_tokens, digest=image.digest))
        out += [tokens.pad] * image.num_tokens
        last = k + 1
    out += ids[last:]
    return out, spans


def request_media(ids: list[int], images: list[PreparedImage], spans: list[ImageSpan],
                  vocab_size: int) -> tuple[list[int], list[P.MediaItem]]:
    """The expanded prompt with each image's pads replaced by its identity ids
    (``protocol.media_token_ids``) and the RequestSpec's ``media``: what the engine computes
    and what its caches compare (the same text with another image never matches)."""
    out = list(ids)
    items = []
    for image, span in zip(images, spans):
        digest = bytes.fromhex(span.digest)
        out[span.offset:span.offset + span.num_tokens] = P.media_token_ids(digest, span.num_tokens, vocab_size)
        px = np.ascontiguousarray(image.pixel_values, dtype="<f4")
        items.append(P.MediaItem(offset=span.offset, num_tokens=span.num_tokens, digest=digest,
                                 grid_thw=tuple(image.grid_thw), pixel_values=px.tobytes(),
                                 shape=tuple(px.shape)))
    return out, items
