"""SFT data: tokenisation, first-fit packing (segments, positions, loss mask), skips, resumable state."""

import json
import threading
import time

import grain
import numpy as np
import pytest

from meshrl.configs import load
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.envs import TaskMixture, load_jsonl
from meshrl.train.data import SFTData, encode_example, example_source, make_sft_data, pack

TOK = ByteTokenizer()
BOS, EOS, PAD = TOK.bos_id, TOK.eos_id, TOK.pad_id


def _packed_rows(examples, seq_len, num_bins):
  encoded = [encode_example(e, TOK) for e in examples]
  rows = pack(grain.MapDataset.source(encoded).to_iter_dataset(), seq_len=seq_len, num_bins=num_bins,
              pad_id=PAD)
  return list(rows)


def test_encode_masks_answer_and_eos():
  out = encode_example({"prompt": "1+2=", "answer": 3}, TOK)
  assert out["tokens"].tolist() == [BOS, ord("1"), ord("+"), ord("2"), ord("="), ord("3"), EOS]
  assert out["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_packing_hand_made_example():
  examples = [{"prompt": "ab", "answer": "c"},   # BOS a b | c EOS  -> 5 tokens
              {"prompt": "d", "answer": "ef"},   # BOS d | e f EOS  -> 5 tokens
              {"prompt": "g", "answer": "h"}]    # BOS g | h EOS    -> 4 tokens
  rows = _packed_rows(examples, seq_len=10, num_bins=1)
  assert len(rows) == 2
  first, second = rows
  a, b, c, d, e, f, g, h = (ord(ch) for ch in "abcdefgh")
  assert first["tokens"].tolist() == [BOS, a, b, c, EOS, BOS, d, e, f, EOS]
  assert first["segment_ids"].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]
  assert first["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
  assert first["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
  assert second["tokens"].tolist() == [BOS, g, h, EOS] + [PAD] * 6
  assert second["segment_ids"].tolist() == [1, 1, 1, 1] + [0] * 6
  assert second["positions"].tolist() == [0, 1, 2, 3] + [0] * 6
  assert second["loss_mask"].tolist() == [0, 0, 1, 1] + [0] * 6
  for row in rows:
    assert all(v.dtype == np.int32 and v.shape == (10,) for v in row.values())


def test_packing_loses_nothing():
  rng = np.random.default_rng(0)
  examples = [{"prompt": f"q{i}:" + "x" * int(rng.integers(0, 8)),
               "answer": f"a{i}" + "y" * int(rng.integers(0, 6))} for i in range(60)]
  rows = _packed_rows(examples, seq_len=32, num_bins=4)
  answers = []
  for row in rows:
    for segment in set(row["segment_ids"].tolist()) - {0}:
      in_segment = row["segment_ids"] == segment
      assert row["positions"][in_segment].tolist() == list(range(in_segment.sum()))
      targets = row["tokens"][in_segment & (row["loss_mask"] == 1)]
      assert targets[-1] == EOS
      answers.append(TOK.decode(targets))
    assert not row["loss_mask"][row["segment_ids"] == 0].any()
  assert sorted(answers) == sorted(e["answer"] for e in examples)


def test_malformed_and_too_long_are_skipped_and_counted():
  examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "x"}, "not a dict",
              {"prompt": "q", "answer": None}, {"prompt": "long" * 20, "answer": "z"}]
  data = SFTData(grain.MapDataset.source(examples).repeat(None), seq_len=16, batch_size=2)
  batch = next(data)
  assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
  assert batch["tokens"].shape == (2, 16)
  assert data.stats["skipped_malformed"] >= 3 and data.stats["skipped_too_long"] >= 1


def test_jsonl_bad_rows_counted(tmp_path):
  path = tmp_path / "tasks.jsonl"
  path.write_text('{"prompt": "2+2=", "answer": 4}\nnot json\n{"answer": "x"}\n'
                  '{"prompt": "3+1=", "answer": "4"}\n')
  cfg = load("configs/tiny.py", [f"data.jsonl={path}", "data.seq_len=32"])
  loaded = load_jsonl(cfg.data.jsonl, skip_bad=True)  # the caller (rl/ or a script) loads the rows
  data = make_sft_data(cfg, source=loaded.examples, batch_size=2, bad_rows=loaded.num_bad)
  batch = next(data)
  assert batch["tokens"].shape == (2, 32)
  assert data.stats["skipped_bad_rows"] == 2
  with pytest.raises(ValueError, match="tasks.jsonl:2"):
    load_jsonl(str(path), skip_bad=False)


def test_state_round_trip_resumes_exactly():
  cfg = load("configs/tiny.py", ["data.seq_len=64", "data.tasks=arithmetic:1.0,reverse:1.0"])
  source = TaskMixture(cfg.data.tasks, seed=cfg.seed)
  data = make_sft_data(cfg, source=source, batch_size=4)
  for _ in range(3):
    next(data)
  state = json.loads(json.dumps(data.get_state()))  # survives JSON (the checkpoint's format)
  expected = [next(data) for _ in range(2)]
  resumed = make_sft_data(cfg, source=source, batch_size=4)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_mixture_source_is_deterministic():
  cfg = load("configs/tiny.py")
  a = example_source(TaskMixture(cfg.data.tasks, seed=3), seed=3)
  b = example_source(TaskMixture(cfg.data.tasks, seed=3), seed=3)
  assert [a[i] for i in range(5)] == [b[i] for i in range(5)]


class _SlowSource:
  """Rows that wait (as demonstrations wait on their sandboxes); records how many are read at once."""

  def __init__(self, read_threads=None):
    if read_threads is not None:
      self.read_threads = read_threads
    self.lock, self.now, self.most = threading.Lock(), 0, 0

  def __getitem__(self, index):
    with self.lock:
      self.now += 1
      self.most = max(self.most, self.now)
    time.sleep(0.01)
    with self.lock:
      self.now -= 1
    return {"prompt": f"q{index}", "answer": f"a{index}"}


def test_a_source_that_waits_on_io_is_read_by_its_threads_in_order():
  """A source's `read_threads` (multi-turn demonstrations: 8) reaches the pipeline: rows are read
  several at once, and the batches are the same as one thread's. Bug: the attribute dropped, so every
  row of a sandboxed warm start waits for the one before it (the demo's warm start took 7 min 51 s)."""
  cfg = load("configs/tiny.py")
  one, many = _SlowSource(), _SlowSource(read_threads=4)
  batches_one = [next(make_sft_data(cfg, source=one, batch_size=8)) for _ in range(1)]
  data = make_sft_data(cfg, source=many, batch_size=8)
  batches_many = [next(data)]
  assert one.most == 1 and many.most > 1, (one.most, many.most)
  for want, got in zip(batches_one, batches_many):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
