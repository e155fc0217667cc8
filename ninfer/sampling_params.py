"""Per-request sampling parameters (plain values; travel inside protocol messages)."""

from __future__ import annotations

import math

import msgspec

from ninfer.errors import RequestError

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20        # top alternatives per token (vLLM's default max_logprobs, OpenAI's cap)


class Constraint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A grammar the output must follow (structured outputs; ``ninfer.structured`` builds them).

    ``grammar``: an llguidance grammar (its JSON form: ``{"grammars": [...]}``) — a JSON schema,
    a regex, a choice, a Lark / GBNF grammar, or the tool-call format. ``kind`` names what it came
    from (for messages and stats). ``think``: (``<think>`` id, ``</think>`` id) of a reasoning
    model: when the prompt leaves the answer inside its thinking, the grammar starts after
    ``</think>`` (the thinking is free but for EOS); otherwise from the first token."""

    grammar: str
    kind: str = "grammar"
    think: tuple[int, int] | None = None


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How one request samples and when it stops.

    temperature == 0 is greedy. top_k == 0 and top_p == 1 disable those filters. Penalties
    follow the usual OpenAI/vLLM meaning: presence/frequency act on generated tokens,
    repetition (multiplicative, 1 = off) on prompt and generated tokens. Randomness is keyed
    by (seed, logical position, purpose), so recomputing a position draws the same number.

    ``logprobs``: None returns none; k >= 0 returns, for every output token, its log-probability
    and the k most likely alternatives (0 <= k <= 20). As vLLM's default ``logprobs_mode``
    ("raw_logprobs"), these are of the model's raw distribution: log_softmax of the logits in
    float64, before penalties, temperature and top-k/top-p. They are computed only when asked
    and only read the logits: they never change which token is drawn.

    ``prompt_logprobs`` (vLLM's): None computes none; k >= 0 returns, for every prompt token
    after the first, its raw log-probability given the tokens before it, its rank in the
    vocabulary and the k most likely tokens at that position (0 <= k <= 20, vLLM's default
    ``max_logprobs``; vLLM's -1, the whole vocabulary, exceeds that bound there too). Such a
    request restores no cached prefix at admission (vLLM v1 skips prefix-cache reads for it the
    same way): every prompt position is computed by the request itself.

    What shapes the draw beyond those (vLLM's meaning and order, applied in float64 before the
    penalties: allowed ids, bad words, min_tokens, logit bias; min_p after the temperature):

    - ``allowed_token_ids``: only these ids may be drawn (empty: every id).
    - ``bad_words``: token sequences that may never be completed: the last token of a sequence is
      barred where the output so far ends with the rest of it (OpenAI's/vLLM's ``bad_words``,
      already tokenized by the frontend).
    - ``min_tokens``: the stop ids (``stop_token_ids`` and, unless ``ignore_eos``, EOS) cannot be
      drawn, nor end the request, before that many output tokens — unless nothing else is left.
    - ``logit_bias``: (id, bias) pairs added to the logits (OpenAI: -100..100).
    - ``min_p``: after the temperature, only tokens with probability >= min_p x the largest.
    - ``structured``: a ``Constraint`` (a grammar): only tokens that keep the output inside it;
      the request stops when the grammar is complete. Its state is a function of the committed
      output alone (rebuilt from it after a destructive pause), never part of a cached prefix.

    Every one of them is a function of the logits, the committed output and the keyed draw, so a
    position recomputed after a pause draws the same token (Snapshot and Replay alike).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    structured: Constraint | None = None
    prompt_logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise RequestError naming the field and its allowed range; return self."""

        def bad(field: str, value, allowed: str) -> None:
            raise RequestError(f"{field}={value!r} is out of range: allowed {allowed}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, ">= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, ">= 0")
        if not (0 < self.top_p <= 1):
            bad("top_p", self.top_p, "(0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, ">= 0 (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2 <= v <= 2:
                bad(name, v, "[-2, 2]")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            bad("seed", self.seed, f"0..{MAX_SEED}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"None or 0..{MAX_LOGPROBS} (top alternatives per token)")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs, f"None or 0..{MAX_LOGPROBS} (top alternatives per prompt "
                "token; -1, the whole vocabulary, is not offered)")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "[0, 1]")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"0..max_tokens ({self.max_tokens})")
        for t, b in self.logit_bias:
            if not math.isfinite(b) or not -100 <= b <= 100:
                bad("logit_bias", b, "biases in [-100, 100]")
        if any(not w for w in self.bad_words):
            bad("bad_words", [], "non-empty token sequences")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids),
                              ("logit_bias", [t for t, _ in self.logit_bias]),
                              ("allowed_token_ids", self.allowed_token_ids),
                              ("bad_words", [t for w in self.bad_words for t in w])):
                for t in ids:
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                        bad(name, t, f"token ids in 0..{vocab_size - 1}")
        return self
