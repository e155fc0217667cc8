"""The DFlash / DFlash2 draft (native/model/dflash.py) against a dense reference.

The reference below is written from the paper's and z-lab/dflash's data flow, not from the
module: every call recomputes the context features of the whole context, concatenates the
context and block K/V, and attends with an explicit visibility mask (SDPA); the dynamic conv and
the selector are plain loops. The module's paged ``append`` + batched ``draft`` must give the
same hidden (1e-10, float64) and the same drafts for any context length, page layout, block
size, base and window. Then: config validation and strict loading.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from itertools import pairwise

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ninfer.errors import ModelLoadError
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.dflash import (
    DFlashDraft,
    DraftBlock,
    load_draft_config,
    tap_features,
)
from ninfer.native.model.dflash_config import parse_draft_config
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.tiny.build import make_tiny_model
from ninfer.tiny.dflash import (
    make_tiny_dflash,
    mask_token_id,
    random_draft_tensors,
    tiny_draft_config,
)
from tests.factories import pages_for, random_prompt


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dflash_target"), seed=0, arch="qwen3_next", fit_mtp=False)


@pytest.fixture(scope="module")
def target(target_dir) -> HybridModel:
    return HybridModel.load(target_dir, "float64")


def make_draft(target: HybridModel, target_dir, kind: str, seed: int = 0, **overrides) -> DFlashDraft:
    """A random draft; ``overrides``: top-level config keys (``dflash_config`` entries merged)."""
    raw = tiny_draft_config(target.cfg, kind, mask_token_id(target_dir))
    raw["dflash_config"].update(overrides.pop("dflash_config", {}))
    raw.update(overrides)
    cfg = parse_draft_config(raw)
    return DFlashDraft(cfg, random_draft_tensors(cfg, seed), target)


def sequence_taps(target: HybridModel, seq: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's raw taps [S, n*H] of every position of ``seq`` (one forward, fresh cache)."""
    cache = target.new_cache(len(pages_for(len(seq))), 1)
    batch = ForwardBatch.build([SeqInput(seq, 0, pages_for(len(seq)), logits="all")], target.device)
    return target.forward(batch, cache, taps=layers).taps


# ---- the dense reference ----------------------------------------------------------------------------

def norm(x, w, eps, zero_centered=False):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1 + w) if zero_centered else y * w


def rope(x, pos, theta):
    """x: [T, heads, D] at positions pos [T] (rotate-half over the full head_dim)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def conv_ref(values, source, proj, base, group, which):
    """The grouped dynamic causal conv as a loop over rows and offsets: y[t] = sum_o (base[which, o]
    + dyn[t, o]) * values[t - o], dyn being kernel ``which`` predicted from source[t]."""
    r, h = values.shape
    k = base.shape[1]
    dyn = (source @ proj.T).view(r, 2, k, h // group)[:, which]
    out = torch.zeros_like(values)
    for t in range(r):
        for o in range(k):
            if t - o >= 0:
                out[t] += (base[which, o] + dyn[t, o].repeat_interleave(group)) * values[t - o]
    return out


def reference(draft: DFlashDraft, taps: torch.Tensor, anchor: int, start: int, n: int, base: int = 0):
    """(hidden [n, H], logits [n, V], drafts) of one block: the context base .. start-1 from the
    target's raw taps [>= start, n*H], recomputed whole; the window (if any) cuts it via the mask."""
    c, tgt, w = draft.cfg, draft.target, draft.tensors
    tc, hsz = tgt.cfg, c.hidden_size
    eps = c.rms_norm_eps
    feats = []
    for j, layer in enumerate(c.target_layer_ids):
        f = taps[base:start, j * hsz:(j + 1) * hsz]
        last = layer == tc.num_hidden_layers - 1    # HF hidden_states[-1] is after the final norm
        feats.append(norm(f, tgt.final_norm, tc.rms_norm_eps, tc.zero_centered_norm) if last else f)
    ctx = norm(torch.cat(feats, -1) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ids = torch.tensor([anchor if anchor < tc.vocab_size else 0] + [c.mask_token_id] * n)
    h = tgt.embed[ids] * c.input_embedding_scale
    pos = torch.arange(base, start + n + 1, dtype=torch.float64)
    qpos, kpos = pos[-(n + 1):, None], pos[None, :]
    visible = torch.ones(n + 1, len(pos), dtype=torch.bool)
    if c.is_causal:
        visible &= kpos <= qpos
    if c.window is not None:
        visible &= qpos - kpos < c.window
        if not c.is_causal:
            visible &= kpos - qpos < c.window
    for i in range(c.num_layers):
        p = f"layers.{i}"
        attend = partial(attention, c, w, p, ctx, pos, visible)
        h = h + sublayer(c, w, p, "attention_conv", norm(h, w[f"{p}.input_layernorm.weight"], eps), attend)
        h = h + sublayer(c, w, p, "mlp_conv", norm(h, w[f"{p}.post_attention_layernorm.weight"], eps),
                         partial(mlp, w, p))
    hidden = norm(h, w["norm.weight"], eps)[1:]
    logits = (hidden @ tgt.lm_head.T) * c.output_multiplier
    if c.final_logit_softcapping > 0:
        logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
    if c.kind == "dflash":
        return hidden, logits, logits.argmax(-1).tolist()
    return hidden, logits, select_ref(w, c.selector_top_k, hidden, logits, int(ids[0]))


def sublayer(c, w, p, conv, x, fn):
    """fn(x), inside DFlash2's conv (both dynamic kernels predicted from the sublayer's input x)."""
    if c.kind != "dflash2":
        return fn(x)
    args = (w[f"{p}.{conv}.kernel_projection.weight"], w[f"{p}.{conv}.base_kernel"], c.conv_group_size)
    return conv_ref(fn(conv_ref(x, x, *args, 0)), x, *args, 1)


def attention(c, w, p, ctx, pos, visible, x):
    a, d, eps = f"{p}.self_attn", c.head_dim, c.rms_norm_eps
    r = x.shape[0]
    q = norm((x @ w[f"{a}.q_proj.weight"].T).view(r, -1, d), w[f"{a}.q_norm.weight"], eps)
    kv_in = torch.cat([ctx, x])
    k = norm((kv_in @ w[f"{a}.k_proj.weight"].T).view(len(kv_in), -1, d), w[f"{a}.k_norm.weight"], eps)
    v = (kv_in @ w[f"{a}.v_proj.weight"].T).view(len(kv_in), -1, d)
    q, k = rope(q, pos[-r:], c.rope_theta), rope(k, pos, c.rope_theta)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=d ** -0.5)
    return out.transpose(0, 1).reshape(r, -1) @ w[f"{a}.o_proj.weight"].T


def mlp(w, p, x):
    return (F.silu(x @ w[f"{p}.mlp.gate_proj.weight"].T) * (x @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[f"{p}.mlp.down_proj.weight"].T


def select_ref(w, top_k, hidden, logits, anchor):
    pred, succ = w["candidate_selector.predecessor_codebook.weight"], w["candidate_selector.successor_codebook.weight"]
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    prev, path = anchor, []
    for i in range(len(hidden)):
        vals, cand = torch.topk(logits[i], top_k)
        scores = [float(vals[m]) + float((pred[prev] * proj[i] * succ[cand[m]]).sum()) for m in range(top_k)]
        prev = int(cand[max(range(top_k), key=scores.__getitem__)])
        path.append(prev)
    return path


# ---- paged append + draft against the reference -------------------------------------------------

def fresh_cache(draft: DFlashDraft, pages: int):
    """A cache whose every slot is NaN until written: a read of an unwritten slot shows."""
    cache = draft.new_cache(pages)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    return cache


def write_context(draft, cache, taps, table, lo, hi, cuts=()):
    """``append`` positions lo .. hi-1 of one sequence, in pieces split at ``cuts``."""
    bounds = [lo, *sorted(x for x in cuts if lo < x < hi), hi]
    for a, b in pairwise(bounds):
        slots = torch.tensor([table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(a, b)])
        draft.append(cache, taps[a:b], torch.arange(a, b), slots)


def assert_matches(draft, hidden, drafts, ref, n):
    ref_hidden, ref_logits, ref_drafts = ref
    assert (hidden[:n] - ref_hidden).abs().max() <= 1e-10
    assert (draft.logits(hidden[:n]) - ref_logits).abs().max() <= 1e-10
    assert drafts == ref_drafts


@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("ctx", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_paged_draft_equals_dense_reference(target, target_dir, kind, ctx, n):
    draft = make_draft(target, target_dir, kind)
    seq = random_prompt(ctx + 1, seed=ctx)
    taps = sequence_taps(target, seq[:ctx], draft.taps)
    table = [4, 1, 3][:len(pages_for(ctx))]            # non-contiguous pages
    cache = fresh_cache(draft, 5)
    write_context(draft, cache, taps, table, 0, ctx, cuts=(ctx // 2, PAGE_SIZE))
    block = DraftBlock(anchor=seq[ctx], start=ctx, n=n, page_table=table)
    hidden = draft.forward([block], cache)[0]
    assert hidden.shape == (n, draft.cfg.hidden_size)
    assert_matches(draft, hidden, draft.draft([block], cache)[0], reference(draft, taps, seq[ctx], ctx, n), n)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_blocks_of_two_sequences_in_one_call(target, target_dir, kind):
    """Different contexts, bases and block sizes padded into one call equal each block alone."""
    draft = make_draft(target, target_dir, kind, seed=1)
    (sa, ca, ba, na), (sb, cb, bb, nb) = (random_prompt(131, 1), 130, 0, 7), (random_prompt(71, 2), 70, 20, 3)
    ta, tb = sequence_taps(target, sa[:ca], draft.taps), sequence_taps(target, sb[:cb], draft.taps)
    cache = fresh_cache(draft, 6)
    write_context(draft, cache, ta, [5, 4, 2], ba, ca)
    write_context(draft, cache, tb, [3, 1], bb, cb)      # positions below its base never written
    # page 0 is never written (NaN): the padded context slots of the shorter block read it
    blocks = [DraftBlock(sa[ca], ca, na, [5, 4, 2], ba), DraftBlock(sb[cb], cb, nb, [3, 1], bb)]
    hidden = draft.forward(blocks, cache)
    drafts = draft.draft(blocks, cache)
    assert [len(d) for d in drafts] == [na, nb]
    assert_matches(draft, hidden[0], drafts[0], reference(draft, ta, sa[ca], ca, na, ba), na)
    assert_matches(draft, hidden[1], drafts[1], reference(draft, tb, sb[cb], cb, nb, bb), nb)


@pytest.mark.parametrize("window,causal,base", [(40, False, 0), (40, True, 0), (40, False, 100), (5, False, 0),
                                                (5, True, 0)])
def test_window_cuts_the_context(target, target_dir, window, causal, base):
    """DFlash2 sliding windows: the context starts at max(base, start - W + 1); pages wholly below
    it are -1 and never read; W smaller than the block masks within the block too."""
    draft = make_draft(target, target_dir, "dflash2", seed=2, sliding_window=window, is_causal=causal)
    seq, ctx = random_prompt(131, 3), 130
    taps = sequence_taps(target, seq[:ctx], draft.taps)
    blocks = [DraftBlock(seq[ctx], ctx, 7, [-1, 2, 1], base), DraftBlock(seq[70], 70, 2, [-1, 2, 1], base)]
    lo = draft.context_start(blocks[0])
    assert lo == max(base, ctx - window + 1) >= PAGE_SIZE          # page 0 lies wholly below it
    cache = fresh_cache(draft, 3)
    write_context(draft, cache, taps, [-1, 2, 1], lo, ctx)
    hidden = draft.forward(blocks[:1], cache)[0]
    assert_matches(draft, hidden, draft.draft(blocks[:1], cache)[0], reference(draft, taps, seq[ctx], ctx, 7, lo), 7)
    if window == 5:   # a second, shorter block (its rows padded) whose context lies in page 1 only
        write_context(draft, cache, taps, [-1, 2, 1], draft.context_start(blocks[1]), 70)
        both = draft.forward(blocks, cache)
        assert (both[0] - hidden).abs().max() <= 1e-10
        ref = reference(draft, taps, seq[70], 70, 2, draft.context_start(blocks[1]))
        assert_matches(draft, both[1], draft.draft(blocks, cache)[1], ref, 2)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_last_layer_tap_scales_and_image_anchor(target, target_dir, kind):
    """A tap of the target's last layer is after its final norm (HF hidden_states[-1]); the
    embedding scale and output multiplier apply; an identity id (>= vocab) anchors as id 0."""
    draft = make_draft(target, target_dir, kind, seed=3, dflash_config={
        "target_layer_ids": [4, 1], "input_embedding_scale": 1.5, "output_multiplier": 0.7})
    seq, ctx = random_prompt(66, 4), 65
    taps = sequence_taps(target, seq[:ctx], draft.taps)
    cache = fresh_cache(draft, 2)
    write_context(draft, cache, taps, [0, 1], 0, ctx)
    block = DraftBlock(seq[ctx], ctx, 5, [0, 1])
    hidden = draft.forward([block], cache)[0]
    assert_matches(draft, hidden, draft.draft([block], cache)[0], reference(draft, taps, seq[ctx], ctx, 5), 5)
    image = DraftBlock(target.cfg.vocab_size + 5, ctx, 5, [0, 1])
    assert draft.draft([image], cache) == draft.draft([DraftBlock(0, ctx, 5, [0, 1])], cache)


def test_conv_longer_than_the_block(target, target_dir):
    """A DFlash2 kernel wider than a one-draft block (zero padding at the block's start)."""
    draft = make_draft(target, target_dir, "dflash2", seed=4, dflash_config={"conv_kernel_size": 4})
    seq, ctx = random_prompt(11, 6), 10
    taps = sequence_taps(target, seq[:ctx], draft.taps)
    cache = fresh_cache(draft, 1)
    write_context(draft, cache, taps, [0], 0, ctx)
    one, longer = DraftBlock(seq[ctx], ctx, 1, [0]), DraftBlock(seq[ctx], ctx, 4, [0])
    for blocks in ([one], [one, longer]):            # two rows alone, then padded to five
        hidden, drafts = draft.forward(blocks, cache), draft.draft(blocks, cache)
        for i, b in enumerate(blocks):
            assert_matches(draft, hidden[i], drafts[i], reference(draft, taps, seq[ctx], ctx, b.n), b.n)
    assert draft.draft([], cache) == []


def test_tap_features_of_the_last_layer_give_the_target_logits(target):
    seq = random_prompt(20, 5)
    batch = ForwardBatch.build([SeqInput(seq, 0, [0], logits="all")])
    out = target.forward(batch, target.new_cache(1, 1), taps=(4, 2))
    feats = tap_features(target, (4, 2), out.taps)
    assert (F.linear(feats[:, :128], target.lm_head) - out.logits).abs().max() <= 1e-10
    assert torch.equal(feats[:, 128:], out.taps[:, 128:])


def test_draft_rejects_bad_blocks(target, target_dir):
    draft = make_draft(target, target_dir, "dflash2", sliding_window=40)
    cache = draft.new_cache(3)
    with pytest.raises(ValueError, match="drafts 1..7 tokens"):
        draft.draft([DraftBlock(1, 10, 8, [0])], cache)
    with pytest.raises(ValueError, match="no page for a context position"):
        draft.draft([DraftBlock(1, 100, 3, [-1, -1])], cache)   # position 61.. lies in page 0
    with pytest.raises(ValueError, match="cannot hold"):
        draft.draft([DraftBlock(1, 100, 3, [0])], cache)


# ---- config and loading -------------------------------------------------------------------------

def raw_config(target, target_dir, kind="dflash2") -> dict:
    return tiny_draft_config(target.cfg, kind, mask_token_id(target_dir))


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.pop("architectures"), "name no DFlash draft"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "missing required field 'dflash_config.mask_token_id'"),
    (lambda r: r["dflash_config"].update(block_size=1), "'dflash_config.block_size' must be at least 2"),
    (lambda r: r["dflash_config"].update(block_size="8"), "'dflash_config.block_size' must be an integer"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
    (lambda r: r["dflash_config"].update(conv_group_size=48), "conv_group_size' .48. must divide hidden_size"),
    (lambda r: r["dflash_config"].pop("selector_rank"), "missing required field 'dflash_config.selector_rank'"),
    (lambda r: r.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (lambda r: r.pop("sliding_window"), "missing required field 'sliding_window'"),
    (lambda r: r.update(layer_types=["sliding_attention", "full_attention"]), "mixes full and sliding"),
    (lambda r: r.update(is_causal="no"), "'is_causal' must be true or false"),
    (lambda r: r.update(hidden_act="gelu"), "hidden_act"),
    (lambda r: r.update(rope_parameters={"rope_type": "yarn"}), "rope type 'yarn'"),
])
def test_config_errors_name_the_field(target, target_dir, edit, message):
    raw = raw_config(target, target_dir)
    edit(raw)
    with pytest.raises(ModelLoadError, match=message):
        parse_draft_config(raw)


def test_config_defaults_follow_the_reference(target, target_dir):
    """Draft parameters fall back to the top level; sliding layers are causal unless the config
    says otherwise; no softcap when the config names none."""
    raw = raw_config(target, target_dir)
    raw.update(block_size=raw["dflash_config"].pop("block_size"))
    raw.pop("is_causal")
    raw["dflash_config"]["final_logit_softcapping"] = None
    cfg = parse_draft_config(raw)
    assert (cfg.block_size, cfg.is_causal, cfg.window, cfg.final_logit_softcapping) == (8, True, 2048, 0.0)
    plain = parse_draft_config(raw_config(target, target_dir, "dflash"))
    assert (plain.kind, plain.window, plain.is_causal, plain.conv_kernel_size) == ("dflash", None, False, 0)
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=type(cfg)) == cfg


@pytest.mark.parametrize("edit,message", [
    ({"hidden_size": 64}, "hidden_size 64 differs from the target's 128"),
    ({"dflash_config": {"target_layer_ids": [1, 5]}}, "layer 5 is out of range"),
    ({"dflash_config": {"mask_token_id": 2048}}, "outside the target's vocabulary"),
    ({"vocab_size": 4096}, "vocab_size 4096"),
])
def test_draft_checks_its_target(target, target_dir, edit, message):
    with pytest.raises(ModelLoadError, match=message):
        make_draft(target, target_dir, "dflash2", **edit)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    return make_tiny_dflash(target_dir, tmp_path_factory.mktemp("dflash2_random"), "dflash2", fit=False)


def _edited_copy(draft_dir, tmp_path, edit):
    d = tmp_path / "draft"
    shutil.copytree(draft_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_loads_strictly(target, draft_dir, tmp_path):
    draft = DFlashDraft.load(draft_dir, target)
    assert draft.cfg == load_draft_config(draft_dir)
    assert all(t.dtype == torch.float64 for t in draft.tensors.values())
    assert draft.page_bytes() == 2 * 2 * PAGE_SIZE * 2 * 64 * 8          # K+V, 2 layers, 2 KV heads of 64, fp64
    name = "layers.1.mlp_conv.base_kernel"
    with pytest.raises(ModelLoadError, match=f"missing tensor '{name}'"):
        DFlashDraft.load(_edited_copy(draft_dir, tmp_path / "a", lambda t: t.pop(name)), target)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'lm_head.weight'"):
        DFlashDraft.load(_edited_copy(draft_dir, tmp_path / "b", lambda t: t.update({"lm_head.weight": t["fc.weight"].clone()})),
                         target)


def test_selector_codebooks_load_under_their_bare_names(target, draft_dir, tmp_path):
    def bare(t):
        for name in ("predecessor_codebook", "successor_codebook"):
            t[f"candidate_selector.{name}"] = t.pop(f"candidate_selector.{name}.weight")

    loaded = DFlashDraft.load(_edited_copy(draft_dir, tmp_path, bare), target)
    ref = DFlashDraft.load(draft_dir, target)
    assert loaded.tensors.keys() == ref.tensors.keys()
    assert all(torch.equal(loaded.tensors[k], ref.tensors[k]) for k in ref.tensors)


def test_config_file_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_draft_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1]))
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        load_draft_config(tmp_path)
