"""Bucketed cache geometry: the shapes a request compiles for.

Pool sizes, page-table widths, prompt paddings and decode lengths are shapes, so every new value
compiles the prefill or the decode loop again. They are rounded up to buckets so that a stream
of requests compiles a bounded number of times, at a bounded cost in memory:
- pool pages: at least `min_pool_pages(page_size)` (`MIN_POOL_TOKENS` tokens, and at most
  `MIN_POOL_PAGES` pages), then multiples of 1/16 of the next power of two (8 sizes per
  octave: at most 12.5% more pages than needed above the minimum, whose absolute size is
  small: the minimum is bounded in tokens, so that large pages do not make a short prompt's
  pool large);
- page-table widths: the same 8 sizes per octave above `MIN_TABLE_PAGES` (at most 12.5% wider
  than the longest head needs). A table holds one int32 per page, but what runs over its width
  (prompt compression's scores and rankings, a layer's masks) costs as many slots: with
  powers of two, room for one generated token past a 512-page prompt doubled them;
- decode steps and prompt chunk counts: powers of two (decode-step arrays hold one int32 per
  token, negligible; padded prompt chunks are never run, see `jaxkv.generation`).
"""

from __future__ import annotations

from jaxkv.pallas_kernels.common import next_power_of_two

MIN_POOL_PAGES = 256
MIN_POOL_TOKENS = 4096  # MIN_POOL_PAGES pages of the default 16 tokens
MIN_TABLE_PAGES = 32
MIN_DECODE_STEPS = 64
BUCKET_STEPS = 16  # a size is a multiple of next_power_of_two(size) / BUCKET_STEPS


def min_pool_pages(page_size: int) -> int:
    """The smallest pool: `MIN_POOL_TOKENS` tokens in pages of `page_size`, at least one page
    and at most `MIN_POOL_PAGES`."""
    return min(MIN_POOL_PAGES, max(MIN_POOL_TOKENS // page_size, 1))


def _octave_bucket(count: int) -> int:
    """`count` rounded up to a multiple of 1/`BUCKET_STEPS` of its next power of two: 8 sizes
    per octave, at most 12.5% more."""
    step = max(next_power_of_two(count) // BUCKET_STEPS, 1)
    return -(-count // step) * step


def pool_pages_bucket(pages: int, page_size: int) -> int:
    """Pool size for `pages` needed pages of `page_size` tokens: >= pages, from a bounded set
    of sizes per octave."""
    if pages <= min_pool_pages(page_size):
        return min_pool_pages(page_size)
    return _octave_bucket(pages)


def table_pages_bucket(pages: int) -> int:
    """Page-table width for heads of at most `pages` pages."""
    return max(MIN_TABLE_PAGES, _octave_bucket(pages))


def decode_steps_bucket(max_new_tokens: int) -> int:
    """Length of the decode loop's per-step arrays for `max_new_tokens` (the loop itself stops
    at the true count)."""
    return max(MIN_DECODE_STEPS, next_power_of_two(max_new_tokens))
