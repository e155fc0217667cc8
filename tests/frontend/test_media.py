"""Frontend media preparation (ninfer/frontend/media.py): pixel_values, grid_thw and the expanded
prompt against transformers' Qwen3.5 processor (Qwen2VLImageProcessorPil + Qwen3VLProcessor's
pad expansion) on the tiny qwen3_5_vision directory; identity, the cache and its budget, and
every refused input."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
from PIL import Image

from ninfer.errors import MediaError, ModelLoadError, RequestError
from ninfer.frontend import schema as S
from ninfer.frontend.media import (
    DEFAULT_PARAMS,
    ImageParams,
    ImageTokens,
    MediaCache,
    MediaLimits,
    expand_image_pads,
    load_image,
    media_config,
    media_digest,
    prepare_image,
    prepare_messages,
    read_image_url,
)
from ninfer.frontend.render import ChatTokenizer
from ninfer.tiny.build import make_tiny_model

# (height, width) -> resized: rounded up, rounded down, downscaled to max_pixels, oblong, upscaled to
# min_pixels (twice: one side rounds to 0), exact
SIZES = [(50, 70), (100, 100), (120, 200), (40, 300), (33, 97), (10, 12), (128, 128)]


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_media"), arch="qwen3_5_vision"))


@pytest.fixture(scope="module")
def params(tiny_vision) -> ImageParams:
    return media_config(tiny_vision)[0]


@pytest.fixture(scope="module")
def hf_image_processor(tiny_vision):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoImageProcessor.from_pretrained(tiny_vision)


def encoded(height: int, width: int, seed: int = 0, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A noise image (noise makes every resize tap and channel count) in ``fmt``."""
    rng = np.random.RandomState(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode if mode in ("RGB", "RGBA", "L") else "RGB"]
    arr = rng.randint(0, 256, (height, width, channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr)
    if mode == "RGBA":
        arr[..., 3] = rng.choice([0, 128, 255], (height, width))
        img = Image.fromarray(arr, "RGBA")
    elif mode == "P":
        img = img.quantize(16)
        img.info["transparency"] = 3
    buf = io.BytesIO()
    img.save(buf, fmt, **({"transparency": 3} if mode == "P" else {}))
    return buf.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def hf_prepare(processor, data: bytes) -> tuple[np.ndarray, list]:
    """transformers on the image as Pillow opens the same bytes (its own convert_to_rgb runs)."""
    out = processor(images=[Image.open(io.BytesIO(data))])
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"]).tolist()


# ---- pixel_values against transformers ----------------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_pixel_values_equal_transformers(params, hf_image_processor, size):
    data = encoded(*size, seed=sum(size))
    ours = prepare_image(data, params)
    ref, grid = hf_prepare(hf_image_processor, data)
    assert [list(ours.grid_thw)] == grid
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref.shape
    assert np.array_equal(ours.pixel_values, ref)            # measured: bit-identical
    assert ours.num_tokens == ours.grid_thw[1] * ours.grid_thw[2] // 4 == ref.shape[0] // 4
    assert ours.nbytes == ref.nbytes


def test_resize_bounds_of_the_tiny_model(params):
    """The tiny model's bounds (64² .. 128² pixels' area) take each regime of smart_resize."""
    grids = [prepare_image(encoded(*s), params).grid_thw for s in SIZES]
    assert grids == [(1, 4, 4), (1, 6, 6), (1, 6, 10), (1, 2, 18), (1, 4, 8), (1, 4, 6), (1, 8, 8)]


@pytest.mark.hf
@pytest.mark.parametrize("mode,fmt", [("RGBA", "PNG"), ("P", "PNG"), ("L", "PNG"), ("RGB", "JPEG"),
                                      ("RGB", "WEBP"), ("P", "GIF"), ("RGB", "BMP")])
def test_modes_and_formats_equal_transformers(params, hf_image_processor, mode, fmt):
    """Transparency is composited onto white and other modes made RGB as transformers does."""
    data = encoded(70, 90, seed=7, mode=mode, fmt=fmt)
    ours = prepare_image(data, params)
    ref, grid = hf_prepare(hf_image_processor, data)
    assert [list(ours.grid_thw)] == grid and np.array_equal(ours.pixel_values, ref)


@pytest.mark.hf
def test_qwen3_5_default_parameters_equal_transformers():
    """Qwen3.5's own bounds (64 .. 16384 tokens) and a directory without preprocessor_config."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": DEFAULT_PARAMS.min_pixels, "longest_edge": DEFAULT_PARAMS.max_pixels},
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for size in [(90, 120), (300, 410)]:
        data = encoded(*size, seed=3)
        ours = prepare_image(data, DEFAULT_PARAMS)
        ref, grid = hf_prepare(hf, data)
        assert [list(ours.grid_thw)] == grid and np.array_equal(ours.pixel_values, ref)
    assert ours.grid_thw == (1, 18, 26)


# ---- the model directory ----------------------------------------------------------------------

def test_media_config_of_a_directory(tiny_vision, tmp_path):
    params, tokens = media_config(tiny_vision)
    raw = json.loads(open(f"{tiny_vision}/config.json").read())
    assert tokens == ImageTokens(raw["vision_start_token_id"], raw["image_token_id"], raw["vision_end_token_id"])
    assert (params.min_pixels, params.max_pixels, params.image_mean) == (64 * 64, 128 * 128, (0.5, 0.5, 0.5))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert media_config(tmp_path)[0] == DEFAULT_PARAMS        # no preprocessor_config.json: Qwen3.5's
    pre = json.loads(open(f"{tiny_vision}/preprocessor_config.json").read())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "min_pixels": 1024}))
    assert media_config(tmp_path)[0].min_pixels == 1024          # legacy keys win, as in transformers
    for bad, match in [({"patch_size": 14}, "patch_size=14 but the vision tower's is 16"),
                       ({"do_normalize": False}, "do_normalize=False is not supported"),
                       ({"image_std": [0.5, 0.5]}, "image_std"),
                       ({"size": {"shortest_edge": 9000, "longest_edge": 4096}}, "min_pixels <= max_pixels")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, **bad}))
        with pytest.raises(ModelLoadError, match=match):
            media_config(tmp_path)


# ---- identity ---------------------------------------------------------------------------------

def test_digest_is_content_and_parameters(params):
    a, b = encoded(64, 64, seed=1), encoded(64, 64, seed=2)
    assert prepare_image(a, params).digest == prepare_image(bytes(a), params).digest == media_digest(a, params)
    assert media_digest(a, params) != media_digest(b, params)              # same size, other pixels
    for change in ({"min_pixels": 1024}, {"max_pixels": 8192}, {"image_mean": (0.4, 0.5, 0.5)},
                   {"rescale_factor": 1 / 256}, {"resample": 2}):
        assert media_digest(a, msgspec.structs.replace(params, **change)) != media_digest(a, params)


# ---- the cache --------------------------------------------------------------------------------

def test_cache_hits_evicts_least_recent_and_counts(params):
    imgs = [encoded(128, 128, seed=s) for s in range(3)]
    one = 128 * 128 * 3 * 2 * 4
    cache = MediaCache(budget_bytes=int(2.5 * one))
    a, b, c = (cache.get_or_prepare(d, params) for d in imgs)
    assert cache.stats() == {"entries": 2, "bytes": 2 * one, "budget_bytes": int(2.5 * one),
                             "hits": 0, "misses": 3, "evictions": 1}
    assert cache.get_or_prepare(imgs[2], params) is c                       # a hit is the same object
    assert cache.get_or_prepare(imgs[0], params) is not a                   # a was evicted: prepared again
    assert cache.get_or_prepare(imgs[2], params) is c                       # c was used more recently than b
    assert cache.stats()["evictions"] == 2 and cache.stats()["hits"] == 2
    assert np.array_equal(cache.get_or_prepare(imgs[0], params).pixel_values, a.pixel_values)


def test_an_image_over_the_whole_budget_is_a_clear_error(params):
    cache = MediaCache(budget_bytes=100_000)
    with pytest.raises(MediaError, match=r"needs 393216 bytes prepared, more than the whole media budget "
                                         r"of 100000 bytes"):
        cache.get_or_prepare(encoded(128, 128), params, where="messages[0].content[1].image_url")
    assert cache.stats()["entries"] == 0


def test_cache_is_thread_safe(params):
    imgs = [encoded(64 + 16 * s, 64, seed=s) for s in range(3)]
    cache = MediaCache(budget_bytes=10 ** 8)
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda d: cache.get_or_prepare(d, params), imgs * 8))
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == 24 and stats["entries"] == 3
    assert stats["bytes"] == sum({p.digest: p.nbytes for p in out}.values())
    for k, p in enumerate(out):
        assert np.array_equal(p.pixel_values, out[k % 3].pixel_values) and p.digest == out[k % 3].digest


# ---- refused inputs ---------------------------------------------------------------------------

def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width × height 1-bit pixels but holds almost no data (a bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("url,limits,match", [
    ("http://example.com/cat.png", MediaLimits(), "remote URLs are not fetched; send a data: URL"),
    ("https://example.com/cat.png", MediaLimits(), "remote URLs are not fetched"),
    ("/abs/cat.png", MediaLimits(), "unsupported URL"),
    ("data:,", MediaLimits(), "only base64 data URLs are supported"),
    ("data:image/png;base64,iVBOR*w0KGgo=", MediaLimits(), "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", MediaLimits(), "not valid base64"),
    (data_url(b"GIF89a but not really"), MediaLimits(), "not an image that can be decoded"),
    (data_url(encoded(64, 64)[:300]), MediaLimits(), "the image data is corrupt"),
    (data_url(encoded(64, 64, fmt="TIFF")), MediaLimits(), "not an image that can be decoded"),
    (data_url(encoded(64, 64)), MediaLimits(max_bytes=1000), r"is \d+ bytes, more than the limit of 1000"),
    (data_url(_png_header_only(100_000, 100_000)), MediaLimits(), "too many pixels"),    # Pillow's own guard
    (data_url(_png_header_only(12_000, 12_000)), MediaLimits(), "12000x12000 = 144000000 pixels, more than"),
    (data_url(encoded(64, 64)), MediaLimits(max_image_pixels=4000), "4096 pixels, more than the limit of 4000"),
    ("file:///etc/hostname", MediaLimits(), "file:// URLs are not allowed"),
])
def test_refused_urls(url, limits, match):
    with pytest.raises(MediaError, match=match) as err:
        load_image(url, limits=limits, where="messages[1].content[0].image_url")
    assert str(err.value).startswith("messages[1].content[0].image_url: ")
    assert isinstance(err.value, RequestError)          # a 400 for that request alone


def test_data_urls_decode(params):
    data = encoded(40, 60, mode="RGBA")
    wrapped = "data:image/png;base64," + base64.encodebytes(data).decode()   # line breaks every 76
    raw, img = load_image(wrapped)
    assert raw == data and img.mode == "RGB" and img.size == (60, 40)
    assert read_image_url(data_url(data, "application/octet-stream"), MediaLimits()) == data  # bytes decide


def test_aspect_ratio_over_200_is_refused(params):
    with pytest.raises(MediaError, match="aspect ratio must be at most 200"):
        prepare_image(encoded(1, 201), params)


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    data = encoded(32, 32)
    (allowed / "a b.png").write_bytes(data)
    (outside / "s.png").write_bytes(data)
    (allowed / "link.png").symlink_to(outside / "s.png")
    limits = MediaLimits(allowed_local_path=str(allowed))
    assert read_image_url(f"file://{allowed}/a%20b.png", limits) == data
    assert read_image_url(f"file://localhost{allowed}/a%20b.png", limits) == data
    for url, match in [(f"file://{outside}/s.png", "outside the allowed local media path"),
                       (f"file://{allowed}/link.png", "outside the allowed local media path"),
                       (f"file://{allowed}/../private/s.png", "outside the allowed local media path"),
                       (f"file://{allowed}/missing.png", "not a regular file"),
                       (f"file://{allowed}", "not a regular file"),
                       ("file://host/share/a.png", "absolute local path")]:
        with pytest.raises(MediaError, match=match):
            read_image_url(url, limits)
    with pytest.raises(MediaError, match="more than the limit of 100"):
        read_image_url(f"file://{allowed}/a%20b.png", MediaLimits(allowed_local_path=str(allowed), max_bytes=100))


# ---- requests and the prompt ------------------------------------------------------------------

def _chat(*contents) -> list[S.Message]:
    body = {"messages": [{"role": "system", "content": "be brief"}] +
            [{"role": "user", "content": c} for c in contents]}
    return S.convert(body, S.ChatRequest).messages


def _image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data), "detail": "high"}}


def test_prepare_messages_in_template_order(params):
    a, b, c = encoded(64, 64, seed=1), encoded(128, 64, seed=2), encoded(64, 64, seed=3)
    bare = {"type": "image_url", "image_url": data_url(c)}                  # a bare string url is taken too
    msgs = _chat([{"type": "text", "text": "two:"}, _image(a), _image(b)], "plain", [bare])
    cache = MediaCache(10 ** 7)
    got = prepare_messages(msgs, cache, params)
    assert [g.digest for g in got] == [media_digest(d, params) for d in (a, b, c)]
    assert prepare_messages(msgs, cache, params)[1] is got[1] and cache.stats()["hits"] == 3
    bad = _chat("x", [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}])
    with pytest.raises(MediaError, match=r"^messages\[2\]\.content\[1\]\.image_url: remote URLs are not fetched"):
        prepare_messages(bad, cache, params)
    with pytest.raises(MediaError, match=r"^messages\[1\]\.content\[0\]\.image_url: expected an object"):
        prepare_messages(_chat([{"type": "image_url", "image_url": {"uri": "x"}}]), cache, params)


def test_tiny_vision_template_renders_one_placeholder_per_image(tiny_vision, tiny_model):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "b"}, {"type": "image", "image": "x"}]}]
    assert ChatTokenizer(tiny_vision).render(msgs) == (
        "<|im_start|>user\na<|vision_start|><|image_pad|><|vision_end|>b<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert "vision" not in ChatTokenizer(tiny_model).render(msgs)      # the text-only template drops images


@pytest.mark.hf
def test_expanded_prompt_equals_transformers_processor(tiny_vision, params, hf_image_processor):
    """The tiny template renders one placeholder per image; the expansion gives the ids
    transformers' Qwen3VLProcessor gives for the same text and images."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    images = [encoded(64, 100, seed=4), encoded(120, 200, seed=5)]
    msgs = _chat([{"type": "text", "text": "compare"}, _image(images[0]), {"type": "text", "text": "and"},
                  _image(images[1])])
    chat = ChatTokenizer(tiny_vision)
    text = chat.render([msgspec.to_builtins(m) for m in msgs])
    prepared = prepare_messages(msgs, MediaCache(10 ** 7), params)
    tokens = media_config(tiny_vision)[1]
    ids, spans = expand_image_pads(chat.encode(text), prepared, tokens)

    # the processor without its video processor (which needs torchvision): only the image path runs
    tok = AutoTokenizer.from_pretrained(tiny_vision)
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.image_processor, proc.tokenizer, proc.chat_template = hf_image_processor, tok, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = tokens.pad, tok.convert_tokens_to_ids("<|video_pad|>")
    # transformers >= 5.25 reads the vision wrapper on every call (its __init__ sets it)
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    ref = proc(text=[text], images=[Image.open(io.BytesIO(d)) for d in images])
    assert ids == list(ref["input_ids"][0])
    assert np.array_equal(np.concatenate([p.pixel_values for p in prepared]), np.asarray(ref["pixel_values"]))
    assert [list(p.grid_thw) for p in prepared] == np.asarray(ref["image_grid_thw"]).tolist()
    assert [(s.num_tokens, s.digest) for s in spans] == [(6, prepared[0].digest), (15, prepared[1].digest)]
    for s in spans:
        assert ids[s.offset - 1] == tokens.start and ids[s.offset + s.num_tokens] == tokens.end
        assert set(ids[s.offset:s.offset + s.num_tokens]) == {tokens.pad}


def test_expansion_refuses_placeholders_that_are_not_the_images(params):
    t = ImageTokens(start=1, pad=2, end=3)
    img = prepare_image(encoded(64, 64), params)
    assert expand_image_pads([9, 1, 2, 3, 9], [img], t) == ([9, 1, 2, 2, 2, 2, 3, 9], expand_image_pads(
        [9, 1, 2, 3, 9], [img], t)[1])
    with pytest.raises(MediaError, match="the prompt has 2 image placeholders for 1 images"):
        expand_image_pads([1, 2, 3, 1, 2, 3], [img], t)
    with pytest.raises(MediaError, match="prompt token 1: an image placeholder outside"):
        expand_image_pads([9, 2, 3], [img], t)
    assert expand_image_pads([9, 8], [], t) == ([9, 8], [])
