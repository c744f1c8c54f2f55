"""Host-side page allocator of the paged KV cache (:mod:`rlflow.models.paged_kv_cache`).

Pure bookkeeping, no JAX: a free list of the pool's ``N`` pages with a reference count per
page (a group's shared prompt pages are referenced by each of its samples' page tables, the
copy-on-write scheme of vLLM, Kwon et al. 2023, sec. 4.4), and each slot's page table
``[slots, M]`` int32 (entry ``N`` = no page) that the engine uploads before a device call.

A slot holding ``t`` cache positions needs ``ceil(t / P)`` pages (:func:`pages_for`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` positions: ``ceil(tokens / page_size)``."""
    return -(-int(tokens) // int(page_size))


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens for ``slots`` slots of at most
    ``pages_per_slot`` pages each.

    Attributes:
      table: int32 ``[slots, pages_per_slot]``, each slot's physical pages in logical order,
        ``num_pages`` where none; changed only by this object's methods (``version`` counts
        the changes, so a caller uploads it only when it moved).

    Raises:
      ValueError: a size is not positive.
    """

    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_slot: int):
        if min(num_pages, page_size, slots, pages_per_slot) <= 0:
            raise ValueError(f"PagePool: num_pages, page_size, slots, pages_per_slot must be "
                             f"> 0, got {num_pages}, {page_size}, {slots}, {pages_per_slot}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.pages_per_slot = int(pages_per_slot)
        self._free = list(range(self.num_pages - 1, -1, -1))     # pop() gives page 0 first
        self._refs = np.zeros((self.num_pages,), np.int32)
        self.table = np.full((slots, self.pages_per_slot), self.num_pages, np.int32)
        self._held = [0] * slots                                  # pages in each slot's row
        self.version = 0

    # ------------------------------------------------------------------ pages
    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages, each with one reference.

        Raises:
          MemoryError: fewer than ``n`` pages are free (nothing is taken).
        """
        if n > len(self._free):
            raise MemoryError(f"PagePool: {n} pages asked, {len(self._free)} free of "
                              f"{self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages`` (held pages only).

        Raises:
          ValueError: a page is free.
        """
        pages = list(pages)
        if pages and (self._refs[pages] <= 0).any():
            raise ValueError(f"PagePool.share: free page(s) among {pages}")
        np.add.at(self._refs, pages, 1)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each of ``pages``; a page with none left is free again.

        Raises:
          ValueError: a page is already free.
        """
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"PagePool.release: page {p} is already free")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(int(p))

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    # ------------------------------------------------------------------ slots
    def held(self, slot: int) -> int:
        """Pages in ``slot``'s row of the table."""
        return self._held[slot]

    def assign(self, slot: int, shared: Sequence[int], own: int) -> bool:
        """Give an empty ``slot`` the pages ``shared`` (one more reference each) followed by
        ``own`` fresh pages. Returns False (nothing changed) when too few pages are free.

        Raises:
          ValueError: the slot holds pages, or the row would pass ``pages_per_slot``.
        """
        if self._held[slot]:
            raise ValueError(f"PagePool.assign: slot {slot} holds {self._held[slot]} pages")
        if len(shared) + own > self.pages_per_slot:
            raise ValueError(f"PagePool.assign: {len(shared)} + {own} pages pass the "
                             f"{self.pages_per_slot} pages of a slot")
        if own > len(self._free):
            return False
        self.share(shared)
        pages = list(shared) + self.take(own)
        self.table[slot, :len(pages)] = pages
        self._held[slot] = len(pages)
        self.version += 1
        return True

    def grow(self, slot: int, tokens: int) -> bool:
        """Make ``slot`` hold pages for ``tokens`` positions (at most ``pages_per_slot``
        pages). Returns False (nothing changed) when too few pages are free."""
        need = min(pages_for(tokens, self.page_size), self.pages_per_slot) - self._held[slot]
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        h = self._held[slot]
        self.table[slot, h:h + need] = self.take(need)
        self._held[slot] = h + need
        self.version += 1
        return True

    def free_slot(self, slot: int) -> None:
        """Release ``slot``'s pages and clear its row (so no device write reaches them)."""
        h = self._held[slot]
        if h:
            self.release(self.table[slot, :h].tolist())
            self.table[slot, :] = self.num_pages
            self._held[slot] = 0
            self.version += 1
