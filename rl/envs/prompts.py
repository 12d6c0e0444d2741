"""RL prompts through grain: file sources (JSONL, ArrayRecord), the task mixture as a grain
MapDataset, and a deterministic, checkpointable, per-host prompt stream.

  source = JsonlSource("tasks.jsonl")                 # random access over the valid rows
  mixture = TaskMixture("reverse:1.0,jsonl:1.0", pools={"jsonl": source}, ...)
  prompts = PromptStream(mixture, shard=(jax.process_index(), jax.process_count()))
  example = next(prompts)                              # {"prompt", "answer", "domain", ...}
  state = prompts.get_state()                          # JSON, saved with the checkpoint
  PromptStream(mixture).set_state(state)               # continues at exactly the next example

Example i of a TaskMixture depends only on (spec, difficulty, seed, i) (rl/envs/mixture.py), so the
mixture is a map-style grain source. Host h of n reads it in blocks of `block` examples (the prompts
it draws per step): examples [h*block, (h+1)*block), then [(n+h)*block, ...), and so on, so when
every host draws `block` prompts a step, the hosts' blocks side by side are the batch one process
would draw (block 1 is grain's `dataset[h::n]`). The iterator's state is the index of its next
example. With one host the stream is the mixture in index order, the sequence the demo has always
trained on.

File sources are scanned once when opened: each row is parsed and checked like rl/envs/jsonl.py's
`load_jsonl`; malformed rows are skipped and listed in `bad` as (file, line or record, reason), and
only the byte offsets (JSONL) or record numbers (ArrayRecord) of the valid ones are kept, so a large
file is never held in memory. A missing file or one without a valid row is a ValueError naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, NamedTuple, Sequence

import grain
import numpy as np

from meshrl.rl.envs.jsonl import check_row


class BadRow(NamedTuple):
  file: str
  line: int  # 1-based line (JSONL) or 0-based record number (ArrayRecord)
  reason: str


def _no_valid_rows(field: str, path: str, bad: list[BadRow]) -> ValueError:
  first = f"; the first malformed: {bad[0].file}:{bad[0].line}: {bad[0].reason}" if bad else ""
  return ValueError(f"{field}={path!r} holds no valid rows ({len(bad)} malformed{first}).")


class JsonlSource:
  """Random access over the valid rows of one JSONL file (grain's RandomAccessDataSource protocol).

  Args:
    path: the file; one {"prompt", "answer", "domain"?, ...} object per line.
    skip_bad: skip malformed rows and list them in `bad` (True), or raise on the first.
    field: the config field named in errors (data.jsonl).
  """

  def __init__(self, path: str, *, skip_bad: bool = True, field: str = "data.jsonl"):
    if not os.path.isfile(path):
      raise ValueError(f"{field}={path!r}: no such file.")
    self.path = path
    self.bad: list[BadRow] = []
    offsets, lengths = [], []
    with open(path, "rb") as file:
      offset = 0
      for number, line in enumerate(file, start=1):
        if line.strip():
          try:
            check_row(json.loads(line))
            offsets.append(offset)
            lengths.append(len(line))
          except (ValueError, UnicodeDecodeError) as error:
            if not skip_bad:
              raise ValueError(f"{path}:{number}: malformed task row: {error}") from None
            self.bad.append(BadRow(path, number, str(error)[:200]))
        offset += len(line)
    if not offsets:
      raise _no_valid_rows(field, path, self.bad)
    self._offsets = np.asarray(offsets, np.int64)
    self._lengths = np.asarray(lengths, np.int64)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < len(self):
      raise IndexError(f"row {index} of {len(self)}")
    fd = os.open(self.path, os.O_RDONLY)  # pread: safe from grain's reader threads
    try:
      raw = os.pread(fd, int(self._lengths[index]), int(self._offsets[index]))
    finally:
      os.close(fd)
    return check_row(json.loads(raw))

  def __iter__(self) -> Iterator[dict]:
    return (self[i] for i in range(len(self)))


class ArrayRecordSource:
  """Random access over the valid records of ArrayRecord files whose records are JSON rows (UTF-8
  bytes of the same objects as a JSONL line), read with grain's ArrayRecordDataSource.

  Args:
    paths: one file or several (concatenated in order).
    skip_bad: as for JsonlSource; a record's "line" is its 0-based number within its file.
    field: the config field named in errors (data.array_record).
  """

  def __init__(self, paths: str | Sequence[str], *, skip_bad: bool = True,
               field: str = "data.array_record"):
    paths = [p for p in ([paths] if isinstance(paths, str) else list(paths)) if p]
    for path in paths:
      if not os.path.isfile(path):
        raise ValueError(f"{field}={path!r}: no such file.")
    if not paths:
      raise ValueError(f"{field} names no file.")
    self.paths = paths
    counts = []
    for path in paths:  # the reader raises RuntimeError (and more) on a file that is not ArrayRecord
      try:
        counts.append(len(grain.sources.ArrayRecordDataSource([path])))
      except Exception as error:  # pylint: disable=broad-except
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ValueError(f"{field}={path!r} is not a readable ArrayRecord file ({first}).") from None
    self._source = grain.sources.ArrayRecordDataSource(paths)
    self.bad: list[BadRow] = []
    valid, base = [], 0
    for path, count in zip(paths, counts):
      for number in range(count):
        try:
          check_row(json.loads(self._source[base + number]))
          valid.append(base + number)
        except (ValueError, UnicodeDecodeError) as error:
          if not skip_bad:
            raise ValueError(f"{path}:record {number}: malformed task row: {error}") from None
          self.bad.append(BadRow(path, number, str(error)[:200]))
      base += count
    if not valid:
      raise _no_valid_rows(field, ",".join(paths), self.bad)
    self._valid = np.asarray(valid, np.int64)

  def __len__(self) -> int:
    return len(self._valid)

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} of {len(self)}")
    return check_row(json.loads(self._source[int(self._valid[index])]))

  def __iter__(self) -> Iterator[dict]:
    return (self[i] for i in range(len(self)))


class _HostBlocks:
  """Host `index` of `count`'s share of an endless `source[i]`, in blocks of `block` examples:
  item k is source[(k // block) * count * block + index * block + k % block]."""

  def __init__(self, source, index: int, count: int, block: int):
    self.source, self.index, self.count, self.block = source, index, count, block

  def __len__(self) -> int:
    return 2 ** 60

  def __getitem__(self, k: int):
    k = int(k)
    return self.source[(k // self.block) * self.count * self.block + self.index * self.block
                       + k % self.block]


class PromptStream:
  """This host's training examples, in order, from an endless random-access source (a TaskMixture)
  through grain; an iterator whose `get_state()` is saved with checkpoints.

  Args:
    source: `source[i]` for every i >= 0 (deterministic in i).
    position: index (within this host's shard) of the first example to yield.
    shard: (index, count) of this host among the hosts (jax.process_index(), jax.process_count()).
    block: examples per host block (the prompts this host draws per step; see the module docstring).
    prefetch: examples read ahead by a grain reader thread (0: read on demand).
  """

  def __init__(self, source: Any, position: int = 0, *, shard: tuple[int, int] = (0, 1), block: int = 1,
               prefetch: int = 64):
    index, count = (int(x) for x in shard)
    if not 0 <= index < count:
      raise ValueError(f"shard={shard}: the host index must lie in 0..count-1.")
    if block < 1:
      raise ValueError(f"block={block} must be at least 1.")
    self.source, self.shard, self.block = source, (index, count), int(block)
    dataset = grain.MapDataset.source(_HostBlocks(source, index, count, self.block))
    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=max(prefetch, 1))
    self._iterator = iter(dataset.to_iter_dataset(options))
    if position:
      self._iterator.set_state({"next_index": int(position)})

  @property
  def position(self) -> int:
    """The index (within this host's shard) of the next example."""
    return int(self._iterator.get_state()["next_index"])

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    return next(self._iterator)

  def get_state(self) -> dict:
    """JSON: {"next_example": this host's next index, "next_example_by_host": [every host's next
    index], "shard": [i, n]}.

    A checkpoint's JSON items are written by process 0, so every host's position is gathered into
    them (one tiny all-gather, collective: every host calls this at the same save): a resume puts
    each host back at its own position, even when the hosts drew different numbers of examples
    (prompt rejection, dynamic sampling rounds)."""
    by_host = _gather_positions(self.position, self.shard[1])
    return {"next_example": self.position, "next_example_by_host": by_host, "shard": list(self.shard),
            "block": self.block}

  def set_state(self, state: dict) -> None:
    """Continues at `state` (from `get_state`, or a checkpoint's data state); ValueError when it
    was saved by another number of hosts (the shards differ, so the sequence could not continue)."""
    shard = tuple(state.get("shard", self.shard))
    if shard[1] != self.shard[1]:
      raise ValueError(f"the prompt stream was saved by {shard[1]} hosts and this run has "
                       f"{self.shard[1]}; an exact resume needs the same number of hosts.")
    if shard[1] > 1 and int(state.get("block", self.block)) != self.block:
      raise ValueError(f"the prompt stream was saved with blocks of {state['block']} prompts per host "
                       f"and this run draws {self.block}; an exact resume needs the same "
                       "rl.prompts_per_step per host.")
    by_host = state.get("next_example_by_host")
    if by_host is not None:
      self._iterator.set_state({"next_index": int(by_host[self.shard[0]])})
      return
    self._iterator.set_state({"next_index": int(state.get("next_example", 0))})


def _gather_positions(position: int, hosts: int) -> list[int] | None:
  """Every host's `position`, in host order (an all-gather over processes when there are several);
  None when the shard count is not the process count (a simulated shard in one process)."""
  if hosts == 1:
    return [int(position)]
  from meshrl.sharding import hosts as processes  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_count() != hosts:
    return None
  return [int(x) for x in processes.gather_rows(np.asarray([position], np.int64))]
