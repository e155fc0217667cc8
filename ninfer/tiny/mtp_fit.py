"""Fit the tiny model's MTP head to its target, so that speculative decoding sees accepted drafts.

The tiny model's weights are random, and so is its ``mtp.*`` head: its drafts would almost
never match the target and the engine's MTP path would only ever reject. ``fit_mtp`` trains the
head (only the ``mtp.*`` tensors; the target is frozen) on the target's own trajectories:

* prompts are windows of the tiny corpus (tokenized with the directory's tokenizer) and random
  token strings; the target continues each one, greedily for most and sampled for some;
* one target forward per trajectory (``logits="all"``, a fresh cache) gives every h_p and the
  target's next-token distribution at every position;
* entry p = (feature(h_p), x_{p+1}) is scored against the target's own prediction at p + 1
  (teacher forcing: every ``prev`` is a target feature). On a greedy trajectory that token is
  x_{p+2}; inside a prompt or after a sampled token it is what the target *would* produce — the
  token a draft must match. The loss is the cross-entropy to the target's full distribution
  there (distillation: more signal per position than its argmax alone);
* ``warm_start`` first makes the head a closed-form linear predictor (least squares), then Adam
  trains every head tensor from there.

What it reaches (seed 0, ~5 s on one core): ~6.6% of held-out greedy first drafts accepted
(random head: ~0.2%), ~13% acceptance probability for drafts sampled at temperature 1; chained
drafts beyond the first almost never match. Most of it is the linear warm start, which is why
Adam runs only 10 steps by default (measured, seed 0: the warm start alone 0.064 greedy / 0.125
sampled in 3.8 s; 10 steps 0.066 / 0.130 in 5.5 s; 100 steps 0.043 / 0.136 in 14.7 s — longer
training trades greedy acceptance for sampled acceptance and triples the build). The
ceiling is the target, not the fit: the tiny target is built to be context-sensitive (its
mixers matter as much as the embedding), so its next token is close to a random function of
the whole context — with the last 8 tokens fixed and the 16 before them random, its argmax
agrees with the most common one only ~24% of the time (~12-15% with the last token alone) — far
beyond what one small layer learns in seconds. Real models' heads get ~90%.

The fitted tensors replace the ``mtp.*`` tensors of model.safetensors in the dtype the file
stores; every other tensor is written back unchanged. ``mtp_acceptance`` measures the result on
held-out prompts the way the engine drafts (first draft, and k chained drafts).
"""

from __future__ import annotations

import math
import time
from dataclasses import fields, is_dataclass
from functools import wraps
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.model.moe import MoeWeights
from ninfer.native.model.mtp import MtpEntries, MtpHead
from ninfer.native.model.ops import rms_norm
from ninfer.tiny.corpus import CORPUS

HELD_OUT = 0.2          # the corpus tail that training never sees (acceptance prompts come from it)
RANDOM_SHARE = 0.25     # prompts that are random token strings rather than corpus windows


# ---- trajectories -----------------------------------------------------------------------------

def corpus_stream(model_dir: Path) -> list[int]:
    """The whole tiny corpus as one token stream (the directory's own tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [t for text in CORPUS for t in tok.encode(text).ids]


def _pages(n_tokens: int) -> int:
    return (n_tokens + PAGE_SIZE - 1) // PAGE_SIZE


@torch.no_grad()
def continue_batch(model: HybridModel, prompts: list[list[int]], new_tokens: int,
                   temperatures: list[float], gen: torch.Generator) -> list[list[int]]:
    """Prompt + ``new_tokens`` of the target's continuation for each prompt, decoded together
    (one prefill call, then one batched decode row per sequence and step). Temperature 0 is
    greedy; above it, a plain softmax sample from ``gen``."""
    n = _pages(max(map(len, prompts)) + new_tokens)
    cache = model.new_cache(n * len(prompts), len(prompts))
    tables = [list(range(i * n, (i + 1) * n)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    step = [SeqInput(list(p), 0, tables[i], state_slot=i) for i, p in enumerate(prompts)]
    for _ in range(new_tokens):
        logits = model.forward(ForwardBatch.build(step, model.device), cache).logits
        for i, row in enumerate(logits):
            t = temperatures[i]
            tok = int(row.argmax()) if t == 0 else int(torch.multinomial(torch.softmax(row / t, -1), 1, generator=gen))
            seqs[i].append(tok)
        step = [SeqInput([s[-1]], len(s) - 1, tables[i], state_slot=i) for i, s in enumerate(seqs)]
    return seqs


@torch.no_grad()
def target_rows(model: HybridModel, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over ``seq`` in a fresh cache: (hidden [n, H], logits [n, V])."""
    cache = model.new_cache(_pages(len(seq)), 1)
    out = model.forward(ForwardBatch.build([SeqInput(seq, 0, list(range(_pages(len(seq)))), logits="all")],
                                           model.device), cache)
    return out.hidden, out.logits


def make_prompts(stream: list[int], count: int, length: int, random_share: float, vocab: int,
                 gen: torch.Generator) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: windows of ``stream`` at random offsets, and a
    ``random_share`` of uniformly random token strings (contexts the corpus never shows)."""
    out = []
    for _ in range(count):
        if torch.rand((), generator=gen) < random_share:
            out.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
        else:
            at = int(torch.randint(0, len(stream) - length, (), generator=gen))
            out.append(stream[at:at + length])
    return out


# ---- the head's trainable tensors ---------------------------------------------------------------

def _tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor a weights dataclass (or tuple of them) holds, recursively."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors_of(x)]
    if is_dataclass(obj):
        return [t for f in fields(obj) for t in _tensors_of(getattr(obj, f.name))]
    return []


def head_parameters(head: MtpHead) -> list[torch.Tensor]:
    """The tensors the head computes with (the target's embedding and lm_head excluded)."""
    return [head.fc, head.norm_emb, head.norm_hidden, head.norm, *_tensors_of(head.layers)]


def checkpoint_tensors(head: MtpHead) -> dict[str, torch.Tensor]:
    """The head's weights under their checkpoint names: the loader's stacked experts split back
    into one gate/up/down per expert, every other tensor as loaded."""
    out = {k: v.detach() for k, v in head.model.mtp_tensors.items()}
    out.update({"mtp.fc.weight": head.fc.detach(), "mtp.pre_fc_norm_embedding.weight": head.norm_emb.detach(),
                "mtp.pre_fc_norm_hidden.weight": head.norm_hidden.detach(), "mtp.norm.weight": head.norm.detach()})
    for j, layer in enumerate(head.layers):
        mlp = layer.mlp
        if not isinstance(mlp, MoeWeights):
            continue
        inter = mlp.down.shape[-1]
        for e in range(mlp.gate_up.shape[0]):
            p = f"mtp.layers.{j}.mlp.experts.{e}"
            out[f"{p}.gate_proj.weight"] = mlp.gate_up[e, :inter].detach()
            out[f"{p}.up_proj.weight"] = mlp.gate_up[e, inter:].detach()
            out[f"{p}.down_proj.weight"] = mlp.down[e].detach()
    return out


# ---- training -----------------------------------------------------------------------------------

def _entries(head: MtpHead, seqs: list[list[int]], hiddens: list[torch.Tensor]) -> list[MtpEntries]:
    """Teacher-forced entries 0 .. n-2 of each sequence, on pages of their own."""
    out, page = [], 0
    for seq, h in zip(seqs, hiddens):
        n = _pages(len(seq) - 1)
        out.append(MtpEntries(tokens=seq[1:], prev=head.feature(h[:-1]), start=0,
                              page_table=list(range(page, page + n))))
        page += n
    return out


def train_examples(model: HybridModel, seqs: list[list[int]]) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(sequence, hidden [n, H], the target's distribution of x_{p+2} for entries p = 0 .. n-2
    [n-1, V]): its softmax at rows 1 .. n-1."""
    out = []
    for seq in seqs:
        hidden, logits = target_rows(model, seq)
        out.append((seq, hidden, torch.softmax(logits[1:], -1)))
    return out


def batch_loss(head: MtpHead, batch) -> torch.Tensor:
    """Mean cross-entropy of the head's entries to the target's distributions (soft labels)."""
    entries = _entries(head, [s for s, _, _ in batch], [h for _, h, _ in batch])
    cache = head.new_cache(sum(len(e.page_table) for e in entries))   # fresh: no KV of another batch
    logq = torch.log_softmax(head.logits(head.forward(entries, cache, rows="all")), -1)
    return -(torch.cat([p for _, _, p in batch]) * logq).sum(-1).mean()


@torch.no_grad()
def warm_start(head: MtpHead, examples, ridge: float = 1e-3) -> None:
    """Start the head as a linear predictor, fitted in closed form: its norms at the identity,
    the decoder layer's residual branches at zero (attention's o_proj, the MLP's down
    projections), and ``fc`` the ridge least-squares map from [norm(e), norm(h')] of each entry
    to the target's feature(h_{p+1}) — the hidden whose lm_head logits are the target's
    prediction of x_{p+2}. From the random weights Adam would spend its steps unlearning a
    confidently wrong head (cross-entropy ~15); from here it spends them on the context."""
    c, m = head.cfg, head.model
    for w in (head.norm_emb, head.norm_hidden, head.norm, *[t for layer in head.layers
                                                              for t in (layer.input_norm, layer.post_norm)]):
        w.fill_(0.0 if c.zero_centered_norm else 1.0)
    for layer in head.layers:
        layer.mixer.o_proj.zero_()
        mlp = layer.mlp
        for down in ((mlp.down, mlp.shared_down_proj) if isinstance(mlp, MoeWeights) else (mlp[2],)):
            if down is not None:
                down.zero_()
    xs, ys = [], []
    for seq, hidden, _ in examples:
        emb = rms_norm(F.embedding(torch.tensor(seq[1:], device=m.device), m.embed), head.norm_emb,
                       c.rms_norm_eps, c.zero_centered_norm)
        hid = rms_norm(head.feature(hidden[:-1]), head.norm_hidden, c.rms_norm_eps, c.zero_centered_norm)
        xs.append(torch.cat([emb, hid], -1))
        ys.append(head.feature(hidden[1:]))
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    head.fc.copy_(torch.linalg.solve(gram, x.T @ y).T)


def adam(params: list[torch.Tensor], steps: int, lr: float, loss_of_step) -> None:
    """Adam on ``params`` for ``steps`` steps of ``loss_of_step()``; the learning rate warms up
    over the first 5% of the steps and then follows a cosine to 0 (the last steps settle)."""
    if steps <= 0:
        return
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1.0 + math.cos(math.pi * s / steps)))
    try:
        for _ in range(steps):
            loss = loss_of_step()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None


def train(head: MtpHead, examples, steps: int, batch: int, lr: float, gen: torch.Generator) -> None:
    """``adam`` on the head's tensors over random batches of ``examples``."""
    def loss() -> torch.Tensor:
        idx = torch.randint(0, len(examples), (batch,), generator=gen).tolist()
        return batch_loss(head, [examples[i] for i in idx])
    adam(head_parameters(head), steps, lr, loss)


# ---- acceptance ---------------------------------------------------------------------------------

@torch.no_grad()
def draft_acceptance(head: MtpHead, seqs: list[list[int]], prompt_len: int, k: int = 3) -> dict:
    """Drafts of the head along the target's greedy trajectories ``seqs`` (all of one length,
    each a prompt of ``prompt_len`` >= 2 tokens and its continuation), made as the engine makes
    them.

    For every committed length L past the prompt (with k target tokens from x_L on): the entries
    0 .. L-2 are teacher-forced (prev = feature(h_p)); draft 1 is the argmax of entry L-2, draft
    i+1 that of the entry (prev = out of draft i, token = draft i) at L-2+i, written over the
    cache's positions past the ledger (the next L's teacher-forced entry overwrites them).
    Returns ``first``: the share of first drafts equal to x_L; ``mean_accepted``: the mean
    number of leading drafts of k equal to x_L .. x_{L+k-1}; ``first_sampled``: the mean
    acceptance probability sum(min(p, q)) of a first draft sampled at temperature 1."""
    model = head.model
    rows = [target_rows(model, s) for s in seqs]
    n = len(seqs[0])
    tables = [list(range(i * _pages(n), (i + 1) * _pages(n))) for i in range(len(seqs))]
    cache = head.new_cache(len(seqs) * _pages(n))
    feats = [head.feature(h) for h, _ in rows]

    def entries_at(p: int, count: int) -> list[MtpEntries]:
        return [MtpEntries(tokens=s[p + 1:p + 1 + count], prev=f[p:p + count], start=p, page_table=t)
                for s, f, t in zip(seqs, feats, tables)]

    if prompt_len > 2:
        head.forward(entries_at(0, prompt_len - 2), cache)
    first = accepted = sampled = 0.0
    positions = range(prompt_len, n - k + 1)
    for L in positions:
        out = head.forward(entries_at(L - 2, 1), cache)
        p = torch.softmax(torch.stack([lg[L - 1] for _, lg in rows]), -1)
        sampled += float(torch.minimum(p, torch.softmax(head.logits(out), -1)).sum())
        run = torch.ones(len(seqs), dtype=torch.bool)
        for i in range(k):
            draft = head.logits(out).argmax(-1)
            run &= draft == torch.tensor([s[L + i] for s in seqs])
            accepted += int(run.sum())
            if i == 0:
                first += int(run.sum())
            if i + 1 < k:
                out = head.forward([MtpEntries(tokens=[int(d)], prev=o[None], start=L - 1 + i, page_table=t)
                                    for d, o, t in zip(draft, out, tables)], cache, step=i + 1)
    count = len(positions) * len(seqs)
    return {"first": first / count, "mean_accepted": accepted / count, "first_sampled": sampled / count,
            "k": k, "positions": count}


def held_out_prompts(model_dir: Path, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts training never sees: windows of the corpus tail, and random strings of their own seed."""
    stream = corpus_stream(model_dir)
    return make_prompts(stream[int(len(stream) * (1 - HELD_OUT)):], count, length, RANDOM_SHARE, vocab,
                        torch.Generator().manual_seed(10_000 + seed))


def head_acceptance(head: MtpHead, model_dir: Path, prompts: int = 32, prompt_len: int = 16,
                    new_tokens: int = 40, k: int = 3, seed: int = 0) -> dict:
    """``draft_acceptance`` over the target's greedy continuations of ``held_out_prompts``."""
    model = head.model
    seqs = continue_batch(model, held_out_prompts(model_dir, prompts, prompt_len, model.cfg.vocab_size, seed),
                          new_tokens, [0.0] * prompts, torch.Generator().manual_seed(seed))
    return draft_acceptance(head, seqs, prompt_len, k)


def mtp_acceptance(model_dir: str | Path, **kwargs) -> dict:
    """The acceptance of the MTP head stored in ``model_dir`` (loaded float32; ``head_acceptance``'s
    options)."""
    path = Path(model_dir)
    return head_acceptance(MtpHead(HybridModel.load(path, "float32")), path, **kwargs)


# ---- fit and write back -------------------------------------------------------------------------

def training_set(model: HybridModel, model_dir: Path, sequences: int, prompt_len: int, new_tokens: int,
                 sampled_share: float, gen: torch.Generator):
    """``train_examples`` of the target's continuations of training prompts (corpus windows
    outside the held-out tail, and random strings); a ``sampled_share`` of them sampled at
    temperature 1, the rest greedy."""
    stream = corpus_stream(model_dir)
    prompts = make_prompts(stream[:int(len(stream) * (1 - HELD_OUT))], sequences, prompt_len, RANDOM_SHARE,
                           model.cfg.vocab_size, gen)
    temps = [1.0 if torch.rand((), generator=gen) < sampled_share else 0.0 for _ in prompts]
    return train_examples(model, continue_batch(model, prompts, new_tokens, temps, gen))


def write_mtp_tensors(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace ``tensors`` (all ``mtp.*``) in model.safetensors, each in the dtype the file
    stores it in; every other tensor is written back as read."""
    path = model_dir / "model.safetensors"
    stored = load_file(str(path))
    for name, t in tensors.items():
        if not name.startswith("mtp.") or name not in stored:
            raise ValueError(f"{path}: no MTP tensor {name!r} to replace")
        stored[name] = t.to(stored[name].dtype).contiguous()
    save_file(stored, str(path), metadata={"format": "pt"})


def one_thread(fn):
    """Run ``fn`` on one torch thread: the fit's float sums, and so the bytes it writes, must not
    depend on the caller's thread count (the CLI's default vs the tests' one); for these small
    ops one thread is also no slower on 2 cores."""
    @wraps(fn)
    def run(*args, **kwargs):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)
    return run


@one_thread
def fit_mtp(model_dir: str | Path, *, steps: int = 10, seed: int = 0, sequences: int = 128, prompt_len: int = 16,
            new_tokens: int = 48, batch: int = 8, lr: float = 1e-3, sampled_share: float = 0.25,
            measure: bool = True, write: bool = True) -> dict:
    """Fit the ``mtp.*`` head of the model in ``model_dir`` to its target (module docstring) and,
    with ``write``, store it in model.safetensors. Seeded: the same arguments give the same
    tensors. With ``measure``, ``head_acceptance`` before and after (held-out prompts).

    Returns steps, seconds (the fit: data + warm start + training, not the measurements),
    loss_before / loss_warm / loss_after (one fixed batch of training examples: the random head,
    after ``warm_start``, after Adam), acceptance_before / acceptance_after (with ``measure``)
    and ``tensors``: the fitted checkpoint tensors (float32)."""
    path = Path(model_dir)
    model = HybridModel.load(path, "float32")
    head = MtpHead(model)
    stats: dict = {"steps": steps, "seed": seed}
    if measure:
        stats["acceptance_before"] = head_acceptance(head, path, seed=seed)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    examples = training_set(model, path, sequences, prompt_len, new_tokens, sampled_share, gen)
    with torch.no_grad():
        stats["loss_before"] = float(batch_loss(head, examples[:batch]))
    warm_start(head, examples)
    with torch.no_grad():
        stats["loss_warm"] = float(batch_loss(head, examples[:batch]))
    train(head, examples, steps, batch, lr, gen)
    with torch.no_grad():
        stats["loss_after"] = float(batch_loss(head, examples[:batch]))
    stats["seconds"] = time.perf_counter() - t0
    stats["tensors"] = checkpoint_tensors(head)
    if measure:
        stats["acceptance_after"] = head_acceptance(head, path, seed=seed)
    if write:
        write_mtp_tensors(path, stats["tensors"])
    return stats
