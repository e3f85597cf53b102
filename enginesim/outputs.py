"""How long a generation runs and what text it streams.

Output length (``--output-len``, ``OutputLenModel``): where the model samples its end-of-sequence
token. vLLM stops a sequence at the first of: ``max_tokens`` generated (``finish_reason:
"length"``; without ``max_tokens`` that is the context left, ``max_model_len - prompt``), or EOS
(``"stop"``; skipped with ``ignore_eos: true``), or a ``stop`` string (``"stop"`` with
``stop_reason`` the string). The models:

- ``max``: the model never ends on its own: every sequence runs to its limit (the simulator's
  behaviour before output-length models existed, and what ``ignore_eos`` always does); a
  request that sets no ``max_tokens`` still ends after ``--no-limit-len`` tokens (the server
  applies it), so that its limit, the whole context left, is not the length by default;
- ``fixed:N``: EOS is the N-th token;
- ``geometric:MEAN``: a geometric length with that mean (each token ends the sequence with
  probability 1/MEAN);
- ``lognormal:MEAN[:SIGMA]``: a lognormal length with that mean (sigma of the log, default 1.0),
  the shape of measured chat and reasoning length distributions.

A sequence that reaches its limit before its sampled end finishes with ``"length"`` (vLLM checks
the length before EOS, so an end sampled exactly at the limit is ``"length"`` too). The EOS token
counts in ``completion_tokens`` (it is in the output token ids) but adds no text. A ``stop``
string is generated at the sampled end: its tokens are the last ones of the sequence and count
in ``completion_tokens``; its text is withheld unless ``include_stop_str_in_output``.

Lengths are drawn from a random stream per request: the request's ``seed`` when it sets one, else
the engine's stream (``--seed``), in arrival order, so one seed gives one run.

Text (``TextStream``): one vocabulary word per token (``Tokenizer.output_words``), drawn from the
same stream, so the text re-tokenizes to exactly the tokens it stands for; a word that would
complete a ``stop`` string early is redrawn. With the ``bytes4`` tokenizer the texts are
`` tok0``, `` tok1``, ... as before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OUTPUT_LEN_KINDS", "OutputLenModel", "SequenceEnd", "TextStream", "plan_end"]

OUTPUT_LEN_KINDS = ("max", "fixed", "geometric", "lognormal")


@dataclass(frozen=True)
class OutputLenModel:
    kind: str = "max"
    mean: float = 0.0
    sigma: float = 1.0

    @classmethod
    def parse(cls, text: str) -> OutputLenModel:
        """``max``, ``fixed:N``, ``geometric:MEAN`` or ``lognormal:MEAN[:SIGMA]``."""
        kind, *args = text.strip().split(":")
        if kind not in OUTPUT_LEN_KINDS:
            raise ValueError(f"output length model must be one of {OUTPUT_LEN_KINDS}, got {text!r}")
        if kind == "max":
            if args:
                raise ValueError("'max' takes no argument")
            return cls()
        if not args or len(args) > (2 if kind == "lognormal" else 1):
            raise ValueError(f"{kind!r} needs {'MEAN[:SIGMA]' if kind == 'lognormal' else 'one number'}, got {text!r}")
        try:
            values = [float(a) for a in args]
        except ValueError:
            raise ValueError(f"not a number in {text!r}") from None
        mean = values[0]
        sigma = values[1] if len(values) > 1 else 1.0
        if not (mean >= 1 and math.isfinite(mean)) or not (sigma > 0 and math.isfinite(sigma)):
            raise ValueError(f"the mean must be >= 1 and sigma > 0, got {text!r}")
        if kind == "fixed" and mean != int(mean):
            raise ValueError(f"'fixed' needs a whole number of tokens, got {text!r}")
        return cls(kind, mean, sigma)

    def __str__(self) -> str:
        if self.kind == "max":
            return "max"
        if self.kind == "lognormal":
            return f"lognormal:{self.mean:g}:{self.sigma:g}"
        return f"{self.kind}:{self.mean:g}"

    def sample(self, rng: random.Random) -> int | None:
        """Where EOS falls (1-based: the EOS is token number N), or None for never."""
        if self.kind == "max":
            return None
        if self.kind == "fixed":
            return int(self.mean)
        if self.kind == "geometric":
            if self.mean <= 1:
                return 1
            p = 1.0 / self.mean
            u = 1.0 - rng.random()  # (0, 1]
            return max(1, math.ceil(math.log(u) / math.log1p(-p)))
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True)
class SequenceEnd:
    """How one sequence ends: ``end`` tokens in all, the last ``stop_tokens`` of which are the EOS
    token or the stop string (no text, except ``stop_text`` on the very last token when
    ``include_stop_str_in_output``); ``reason`` and ``stop_reason`` as vLLM reports them."""

    end: int
    reason: str  # "length" or "stop"
    stop_reason: str | None = None
    stop_tokens: int = 0
    stop_text: str = ""

    @property
    def text_tokens(self) -> int:
        """Tokens that carry vocabulary words."""
        return self.end - self.stop_tokens


def plan_end(limit: int, eos_at: int | None, stop: Sequence[str], stop_token_counts: Sequence[int],
             include_stop_str: bool = False) -> SequenceEnd:
    """The end of a sequence whose limit is ``limit`` and whose sampled end is ``eos_at``.

    With ``stop`` strings, the first one whose tokens fit is generated at the sampled end;
    otherwise the EOS token ends it."""
    if eos_at is None or eos_at >= limit:
        return SequenceEnd(limit, "length")
    for text, count in zip(stop, stop_token_counts, strict=True):
        if 0 < count <= eos_at:
            return SequenceEnd(eos_at, "stop", text, stop_tokens=count,
                               stop_text=text if include_stop_str else "")
    return SequenceEnd(eos_at, "stop", None, stop_tokens=1)


class TextStream:
    """The text of each generated token, in order (``next``), for one sequence."""

    def __init__(self, words: Sequence[str] | None, rng: random.Random, end: SequenceEnd,
                 stop: Sequence[str] = ()) -> None:
        self._words = words
        self._rng = rng
        self._end = end
        self._stop = [s for s in stop if s]
        self._tail = ""
        self._keep = max((len(s) for s in self._stop), default=0)
        self.index = 0

    def next(self) -> str:
        i = self.index
        self.index += 1
        end = self._end
        if i >= end.text_tokens:
            return end.stop_text if (i == end.end - 1 and end.stop_text) else ""
        if self._words is None:
            return f" tok{i}"
        word = self._words[self._rng.randrange(len(self._words))]
        if self._stop:
            for _ in range(64):  # never complete a stop string before the sampled end
                joined = self._tail + word
                if not any(s in joined for s in self._stop):
                    break
                word = self._words[self._rng.randrange(len(self._words))]
            self._tail = (self._tail + word)[-self._keep:]
        return word
