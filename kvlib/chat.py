"""Multi-turn reuse: keep a conversation's cache between turns, prefill only the new turn.

A chat model reads the whole conversation before every reply. Without reuse,
turn ``t`` prefills every token of turns ``1 .. t`` again, so a conversation of
``n`` equal turns prefills about ``n (n + 1) / 2`` turns' worth of tokens. With
the cache kept, each turn prefills its own tokens and nothing else: the keys
and values of what was said before cannot change, because attention is causal.

One detail is easy to miss. The last token of a reply was *sampled* but never
*fed*: its keys and values are not in the cache. The next turn feeds it first,
then the new turn's tokens. Forget it and the model reads the conversation with
a token missing; the tokens that follow come out at the wrong positions.

`ChatSession` does this around `kvlib.stream` for one conversation. Engines do it
for many: vLLM with automatic prefix caching (the block hash chain of the paging
chapter), SGLang with a radix tree over token ids (`kvlib.radix`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .cache import Cache, StaticCache
from .generate import stream
from .model import Transformer
from .validate import token_ids


@dataclass(frozen=True)
class Turn:
    """One exchange: what was said, what came back, and what the reply's prefill ran."""

    prompt: list[int]  # the new turn's tokens, as given to `ChatSession.say`
    reply: list[int]  # the tokens generated for it
    prefilled: int  # tokens run through the model before the reply's first token
    reused: int  # tokens whose keys and values were already in the cache


class ChatSession:
    """One conversation with ``model``, its cache kept between turns.

    ``say(tokens, max_new_tokens)`` appends a turn and returns the reply's token ids.
    ``reuse=False`` is the baseline every chat server starts from: the cache is
    cleared and the whole conversation prefilled again at every turn. Both give the
    same tokens (greedy; or sampled with the same seed); `turns` records what each
    prefilled. ``cache=None`` allocates a batch-1 `StaticCache` that doubles when full.
    """

    def __init__(self, model: Transformer, *, reuse: bool = True, cache: Cache | None = None) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"ChatSession needs a kvlib Transformer, got {type(model).__name__}")
        if not isinstance(reuse, bool):
            raise TypeError(f"reuse must be True or False, got {reuse!r}")
        if cache is None:
            cache = StaticCache.for_model(model.config, 1, 256, dtype=model.dtype, device=model.device, grow=True)
        elif not isinstance(cache, Cache):
            raise TypeError(f"cache must be a kvlib Cache, got {type(cache).__name__}")
        elif cache.tokens_seen:
            raise ValueError(f"a new conversation needs an empty cache; this one has seen {cache.tokens_seen} tokens")
        self.model, self.cache, self.reuse = model, cache, reuse
        self.history: list[int] = []  # every token of the conversation, prompts and replies, in order
        self.turns: list[Turn] = []

    @property
    def unfed(self) -> list[int]:
        """Tokens of the conversation not in the cache yet: the last reply's last token, or none."""
        # tokens *seen*, not held: a window cache holds fewer, and every token it was given is fed already
        return self.history[self.cache.tokens_seen :] if self.reuse else self.history

    def say(self, tokens: Iterable[int], max_new_tokens: int, **sampling) -> list[int]:
        """Add a turn (its token ids, chat template included) and generate the reply.

        Sampling keywords are `kvlib.stream`'s (``temperature``, ``stop``, ``seed`` ...).
        """
        tokens = token_ids("a turn", tokens, self.model.config.vocab_size)
        if not self.reuse:
            self.cache.reset()  # the baseline: forget everything, prefill it all again
        feed = self.unfed + tokens
        reused = self.cache.tokens_seen
        try:
            reply = list(stream(self.model, feed, max_new_tokens, cache=self.cache, **sampling))
        except BaseException:
            self.cache.reset()  # it may hold part of a turn the history lacks: the next turn re-prefills
            raise
        self.history += tokens + reply
        self.turns.append(Turn(tokens, reply, prefilled=len(feed), reused=reused))
        return reply

    @property
    def prefilled(self) -> int:
        """Prompt tokens run through the model over the whole conversation."""
        return sum(t.prefilled for t in self.turns)

    def __repr__(self) -> str:
        mode = "reuse" if self.reuse else "re-prefill"
        return f"ChatSession({mode}, {len(self.turns)} turns, {len(self.history)} tokens, {self.prefilled} prefilled)"
