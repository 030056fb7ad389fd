"""Exact-match scoring of short VQA answers, per question family."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_PUNCT = re.compile(r"[^\w\s]")
_ARTICLES = {"a", "an", "the"}


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse spaces: "The Red." and "red" match."""
    words = _PUNCT.sub(" ", text.lower()).split()
    return " ".join(w for w in words if w not in _ARTICLES)


@dataclass
class Scoreboard:
    """Exact-match accuracy per family and overall."""

    hits: dict[str, list[bool]] = field(default_factory=lambda: defaultdict(list))

    def add(self, family: str, prediction: str, answer: str) -> bool:
        ok = normalize_answer(prediction) == normalize_answer(answer)
        self.hits[family].append(ok)
        return ok

    def accuracy(self) -> dict[str, float]:
        scores = {f: sum(v) / len(v) for f, v in sorted(self.hits.items())}
        total = sum(len(v) for v in self.hits.values())
        scores["overall"] = sum(sum(v) for v in self.hits.values()) / total if total else 0.0
        return scores

    def counts(self) -> dict[str, int]:
        counts = {f: len(v) for f, v in sorted(self.hits.items())}
        counts["overall"] = sum(counts.values())
        return counts
