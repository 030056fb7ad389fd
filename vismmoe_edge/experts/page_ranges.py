"""Byte-range arithmetic over pages, shared by the page-cache operations and both of their backends (the C code
mirrors it)."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

PAGE_SIZE = mmap.PAGESIZE
MIB = 1 << 20

Range = tuple[int, int]  # (offset, length) in bytes within the file


def page_span(offset: int, length: int, page: int = PAGE_SIZE) -> Range:
    """(start, end) of the pages holding [offset, offset+length): start rounded down, end up; empty if length 0."""
    start = offset - offset % page
    if length == 0:
        return start, start
    end = offset + length
    return start, end + (-end) % page


def chunk_spans(offset: int, length: int, chunk: int, page: int = PAGE_SIZE) -> list[Range]:
    """The (start, length) hint calls covering a range's page span, ``chunk`` bytes (rounded up to pages) each.

    ``chunk`` 0 means one call for the whole span. madvise needs a page-aligned start (§1.3).
    """
    start, end = page_span(offset, length, page)
    step = end - start if chunk <= 0 else chunk + (-chunk) % page
    return [(s, min(step, end - s)) for s in range(start, end, max(step, 1))]


def split_range(offset: int, length: int, chunk: int) -> list[Range]:
    """Byte-exact (offset, length) pieces of a range for the pread pool; ``chunk`` 0 means no split."""
    step = length if chunk <= 0 else chunk
    return [(offset + d, min(step, length - d)) for d in range(0, length, max(step, 1))]


def span_pages(ranges: Sequence[Range], page: int = PAGE_SIZE) -> list[int]:
    """Number of pages in each range's page span."""
    return [(end - start) // page for start, end in (page_span(o, n, page) for o, n in ranges)]
