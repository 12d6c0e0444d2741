"""A prefix cache: KV entries of token prefixes already computed (prompts, and prompts with their
replies), reused by later requests.

A prompt is cut into blocks of P tokens. Block b is named by a chained hash,
h_b = sha256(h_{b-1} || tokens of block b), so a name stands for the whole prefix up to the end of
its block: two prompts share block b's entry only if their first (b + 1) * P tokens are equal. The
entry holds the block's KV entries (device arrays {stack: {entry: [L, P, ...]}}), which depend on
every earlier token through attention, as the chained name does. Entries live in an LRU map with a
byte budget; a hit refreshes the chain back to front, so a chain's tail is evicted before its head
and the head stays reachable.

The same scheme as vLLM's automatic prefix caching (hash of the block's tokens and of its prefix)
and SGLang's RadixAttention (Zheng et al., 2024, arXiv:2312.07104), host-side and per block.

Valid for one set of parameters: the engine clears it when the weights change.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any, Sequence

import jax
import numpy as np


def block_hashes(tokens: Sequence[int], block: int) -> list[bytes]:
  """The chained names of the full blocks of `tokens` (len(tokens) // block of them)."""
  ids = np.asarray(tokens, np.int64)
  names, previous = [], b""
  for b in range(len(ids) // block):
    previous = hashlib.sha256(previous + ids[b * block:(b + 1) * block].tobytes()).digest()
    names.append(previous)
  return names


class PrefixCache:
  """LRU map from block names to saved KV blocks, at most `budget_bytes` of them (0: off).

  Thread-safe (one lock); `lookup` and `insert` are the only entry points the engine uses.
  """

  def __init__(self, block: int, budget_bytes: int):
    if block < 1:
      raise ValueError(f"serve.prefix_block={block} must be at least 1.")
    if budget_bytes < 0:
      raise ValueError(f"serve.prefix_cache_mb must be >= 0 (got {budget_bytes} bytes).")
    self.block, self.budget = block, budget_bytes
    self._entries: collections.OrderedDict[bytes, tuple[Any, int]] = collections.OrderedDict()
    self._lock = threading.Lock()
    self.bytes = 0
    self.evictions = 0

  @property
  def enabled(self) -> bool:
    return self.budget > 0

  def __len__(self) -> int:
    return len(self._entries)

  def lookup(self, tokens: Sequence[int], max_tokens: int) -> tuple[list[Any], list[bytes]]:
    """(saved blocks of the longest cached prefix of at most `max_tokens` tokens, names of all the
    prompt's full blocks). The blocks are in order; their count times `block` is the reused length."""
    names = block_hashes(tokens, self.block)
    found = []
    if not self.enabled:
      return found, names
    with self._lock:
      for name in names[:max_tokens // self.block]:
        entry = self._entries.get(name)
        if entry is None:
          break
        found.append(entry[0])
      for name in reversed(names[:len(found)]):
        self._entries.move_to_end(name)
    return found, names

  def insert_chain(self, blocks: Sequence[tuple[bytes, Any]]) -> None:
    """Saves consecutive blocks [(name, pytree of device arrays), ...] of one prompt, head first,
    evicting the least recently used blocks past the budget. They are stored tail first, so the head
    ends up most recent (a later eviction cuts the chain from its tail). A block larger than the
    whole budget is not kept."""
    if not self.enabled:
      return
    with self._lock:
      for name, block in reversed(list(blocks)):
        if name in self._entries:
          self._entries.move_to_end(name)
          continue
        size = sum(int(a.nbytes) for a in jax.tree.leaves(block))
        if size > self.budget:
          continue
        self._entries[name] = (block, size)
        self.bytes += size
        while self.bytes > self.budget:
          _, (_, freed) = self._entries.popitem(last=False)
          self.bytes -= freed
          self.evictions += 1

  def contains(self, name: bytes) -> bool:
    with self._lock:
      return name in self._entries

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()
      self.bytes = 0
