"""Incremental detokenisation shared by the CLI, the Python API and the daemon.

Decoding the whole reply again for every token is quadratic in its length. As vLLM does, only a short window
is decoded per token: the tokens already emitted since the last piece (for context: byte-level BPE and
SentencePiece decode a token differently at the start of a string) plus the new ones. Text is emitted once it
can no longer change, i.e. it does not end in half a UTF-8 character.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # where the context window starts
        self.read_offset = 0  # tokens before this have been emitted as text
        self.text = ""  # everything emitted so far

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _pending(self) -> str:
        emitted = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        return self._decode(self.tokens[self.prefix_offset :])[len(emitted) :]

    def push(self, token: int) -> str:
        """Add one token; return the text that became final (often "", e.g. inside a multi-byte character)."""
        self.tokens.append(token)
        piece = self._pending()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += piece
        return piece

    def finish(self) -> str:
        """Flush what was held back (a reply may really end in an invalid byte sequence)."""
        piece = self._pending()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += piece
        return piece
