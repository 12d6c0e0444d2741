"""SFT data with grain: examples -> tokens -> rows packed to [T] -> batches [B, T].

  data = make_sft_data(cfg, source=examples, batch_size=cfg.rl.sft_batch_size)
  batch = next(data)        # {"tokens", "segment_ids", "positions", "loss_mask"}: [B, T] int32
  state = data.get_state()  # JSON; data.set_state(state) resumes exactly there

An example {"prompt", "answer", ...} becomes `BOS prompt answer EOS`; its loss mask is 1 on the answer
tokens and EOS (the tokens the model must learn to produce), 0 on BOS and the prompt. Whole examples
are packed first-fit into rows of T tokens (grain's FirstFitPackIterDataset, one bin per batch row):
each packed document gets its own segment id (1, 2, ... within a row; 0 is padding) and positions
restarting at 0, so attention never crosses documents. Padding has token PAD, segment 0, mask 0.

Examples come from the caller (train/ never imports rl/): an endless random-access source
(`source[i]`, e.g. the RL task mixture) or a finite list (JSONL rows), reshuffled every epoch. A malformed example, or one longer than T, is skipped and
counted in `stats` (never cut: a truncated answer would teach a wrong one). Counts are kept in this
process: exact with num_workers=0, and they may re-count the few examples of a packing round that a
restored iterator reads again.
"""

from __future__ import annotations

from typing import Any, Mapping

import grain
import grain.experimental as grain_exp
import jax
import numpy as np

from meshrl.model.tokenizer import ByteTokenizer, Tokenizer

FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


class MalformedExample(ValueError):
  """An example that cannot be tokenised; the message says why."""


def encode_example(example: Any, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
  """{"prompt", "answer"} -> {"tokens": [n] int32, "loss_mask": [n] int32} (BOS prompt answer EOS).

  Raises:
    MalformedExample when the example is not a dict with a non-empty string prompt and a string or
    number answer.
  """
  if not isinstance(example, Mapping):
    raise MalformedExample(f"example is a {type(example).__name__}, not a dict")
  prompt, answer = example.get("prompt"), example.get("answer")
  if not isinstance(prompt, str) or not prompt:
    raise MalformedExample(f"prompt={prompt!r} is not a non-empty string")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise MalformedExample(f"answer={answer!r} is not a string or number")
  prompt_ids = tokenizer.encode(tokenizer.render_prompt(prompt), add_bos=True)  # chat template, if any
  answer_ids = tokenizer.encode(str(answer), add_bos=False, add_eos=True)
  tokens = np.asarray(prompt_ids + answer_ids, np.int32)
  loss_mask = np.concatenate([np.zeros(len(prompt_ids), np.int32), np.ones(len(answer_ids), np.int32)])
  return {"tokens": tokens, "loss_mask": loss_mask}


class _Encoder:
  """The grain map step: encodes, or returns None (filtered out) and counts why."""

  def __init__(self, tokenizer: Tokenizer, seq_len: int):
    self.tokenizer = tokenizer
    self.seq_len = seq_len
    self.counts = {"skipped_malformed": 0, "skipped_too_long": 0}

  def _skip(self, reason: str) -> None:
    self.counts[reason] += 1  # runs in the consuming thread (IterDataset.map), no lock needed

  def __call__(self, example: Any) -> dict[str, np.ndarray] | None:
    try:
      encoded = encode_example(example, self.tokenizer)
    except MalformedExample:
      self._skip("skipped_malformed")
      return None
    if len(encoded["tokens"]) > self.seq_len:
      self._skip("skipped_too_long")
      return None
    return encoded


def pack(dataset: grain.IterDataset, *, seq_len: int, num_bins: int, pad_id: int) -> grain.IterDataset:
  """Packs encoded examples ({"tokens", "loss_mask"}: [n]) first-fit into rows of `seq_len`.

  Args:
    dataset: examples no longer than `seq_len`.
    seq_len: T, the row length.
    num_bins: rows filled at once; every round emits exactly this many rows (a round ends when an
      example fits in none of them, so none is empty), except a last partial round.
    pad_id: the token of padding positions.

  Returns:
    Rows {"tokens", "segment_ids", "positions", "loss_mask"}: [T] int32.
  """
  packed = grain_exp.FirstFitPackIterDataset(
      dataset, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=num_bins,
      shuffle_bins=False, padding_struct={"tokens": pad_id, "loss_mask": 0})

  def rename(row):
    return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"],
            "positions": row["tokens_positions"], "loss_mask": row["loss_mask"]}
  return packed.map(lambda row: {k: np.asarray(v, np.int32) for k, v in rename(row).items()})


def example_source(source: Any, *, seed: int) -> grain.MapDataset:
  """An endless, random-access MapDataset of example dicts.

  Args:
    source: an endless random-access source (`source[i]` for every i >= 0, e.g. a task mixture),
      or a finite list or tuple of examples, cycled through and reshuffled every epoch.
    seed: the run seed (epoch shuffles of a finite list).
  """
  if isinstance(source, (list, tuple)):
    if not source:
      raise ValueError("the SFT example list is empty; SFT needs at least one example.")
    return grain.MapDataset.source(list(source)).shuffle(seed=seed).repeat(None)
  return grain.MapDataset.source(_Endless(source))


class _Endless:
  """A random-access source of (practically) unbounded length over `source[i]`."""

  def __init__(self, source):
    self.source = source

  def __len__(self) -> int:
    return 2 ** 62

  def __getitem__(self, index: int):
    return self.source[int(index)]


def _mark_absl_flags_parsed() -> None:
  """grain's worker processes read absl flags; scripts parse argv with argparse, so take defaults."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class SFTData:
  """Packed SFT batches from a source of examples; an iterator with checkpointable state.

  Args:
    source: MapDataset of example dicts (`example_source`).
    seq_len: T (data.seq_len).
    batch_size: B rows per batch (rl.sft_batch_size); also the number of packing bins.
    tokenizer: defaults to the byte tokenizer.
    num_workers: data.num_workers; > 0 runs the pipeline in grain worker processes, each packing
      its own slice of the examples (so the batch order depends on it: keep it across a resume).
    shard: (index, count) of this host's share of the source (jax.process_index/process_count).
    read_threads: threads reading the source in order (a source whose rows wait on I/O, such as
      multi-turn demonstrations run in sandboxes, says how many it wants as `source.read_threads`).
  """

  def __init__(self, source: grain.MapDataset, *, seq_len: int, batch_size: int,
               tokenizer: Tokenizer | None = None, num_workers: int = 0,
               shard: tuple[int, int] = (0, 1), read_threads: int = 1):
    if seq_len < 2:
      raise ValueError(f"data.seq_len={seq_len} must be at least 2.")
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be at least 1.")
    self.tokenizer = tokenizer or ByteTokenizer()
    self._encoder = _Encoder(self.tokenizer, seq_len)
    self.bad_rows = 0  # JSONL rows dropped before this pipeline (set by make_sft_data)
    index, count = shard
    examples = source[index::count].to_iter_dataset(
        grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * batch_size))
    encoded = examples.map(self._encoder).filter(lambda x: x is not None)
    rows = pack(encoded, seq_len=seq_len, num_bins=batch_size, pad_id=self.tokenizer.pad_id)
    self.dataset = rows.batch(batch_size, drop_remainder=True)
    if num_workers > 0:
      _mark_absl_flags_parsed()
      self.dataset = self.dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    self._iterator = iter(self.dataset)

  @property
  def stats(self) -> dict[str, int]:
    """{"skipped_bad_rows", "skipped_malformed", "skipped_too_long"}: examples dropped so far:
    unparsable JSONL rows when loading, then malformed and over-long examples (this process)."""
    return {"skipped_bad_rows": self.bad_rows, **self._encoder.counts}

  def __iter__(self) -> "SFTData":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """{"tokens", "segment_ids", "positions", "loss_mask"}: [B, T] int32."""
    return next(self._iterator)

  def get_state(self) -> dict:
    """JSON-serialisable state: grain's iterator state and the skip counts."""
    return {"grain": self._iterator.get_state(), **self.stats}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes at `state` (from `get_state`, possibly of another process)."""
    self._iterator.set_state(state["grain"])
    for key in self._encoder.counts:
      self._encoder.counts[key] = int(state.get(key, 0))
    self.bad_rows = int(state.get("skipped_bad_rows", self.bad_rows))


def make_sft_data(cfg, *, source: Any, batch_size: int | None = None,
                  tokenizer: Tokenizer | None = None, bad_rows: int = 0) -> SFTData:
  """This host's SFTData from a run config and the caller's examples.

  B = `batch_size` or rl.sft_batch_size rows in all, split evenly over hosts (each host yields its
  B / process_count rows); T = data.seq_len. `source` as in `example_source`; `bad_rows` counts
  rows the caller dropped while loading it (reported as "skipped_bad_rows").
  """
  batch_size = batch_size or cfg.rl.sft_batch_size
  hosts = jax.process_count()
  if batch_size % hosts:
    raise ValueError(f"rl.sft_batch_size={batch_size} does not split over {hosts} hosts.")
  data = SFTData(example_source(source, seed=cfg.seed), seq_len=cfg.data.seq_len,
                 batch_size=batch_size // hosts, tokenizer=tokenizer, num_workers=cfg.data.num_workers,
                 shard=(jax.process_index(), hosts), read_threads=getattr(source, "read_threads", 1))
  data.bad_rows = bad_rows
  return data
