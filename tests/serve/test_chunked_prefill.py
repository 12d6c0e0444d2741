"""Chunked prefill in the server (rl.prefill_chunk, issue 34 part 4; serve/engine.py): a long prompt
comes in a chunk per engine loop iteration while the other slots keep decoding, with the output (tokens
and log-probs) of the engine that feeds the whole prompt at once; prefix reuse, cancellation and errors
during the prefill keep working; a bad chunk names the field."""

import queue
import threading
import time

import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.serve.engine import Engine, EngineSpec, Request

TOK = ByteTokenizer()
MAX_LEN, CHUNK = 64, 4  # as tests/serve/conftest.py's engine; prompt tokens per chunk
SYSTEM = "Be terse. Answer: "  # 18 tokens with BOS: two full prefix blocks of 8
LONG = "Tell me, in very few words, what sorting 9 1 5 gives? "  # 56 tokens with BOS: 14 chunks


def _long(tag: str) -> str:
  """LONG with its first character replaced: a prompt that shares no prefix block with the others."""
  return tag + LONG[1:]


@pytest.fixture(scope="module")
def chunked(tiny_served):
  """(plain engine, chunked engine): the same model and numbers, the second with prefill_chunk=4."""
  _, model, plain = tiny_served
  engine = Engine(model, EngineSpec(slots=3, max_len=MAX_LEN, chunk=4, prefix_block=8, prefix_cache_bytes=1 << 20,
                                    prefill_chunk=CHUNK), stop_ids=TOK.stop_ids, pad_id=TOK.pad_id).start()
  yield plain, engine
  engine.close()


class Collect:
  """A request's events: tokens, log-probs, the finish reason (and error), and the engine's
  prefill_chunks count when each token event came."""

  def __init__(self, engine=None):
    self.engine, self.tokens, self.logprobs, self.chunks_seen = engine, [], [], []
    self.first, self.done = threading.Event(), threading.Event()
    self.reason = self.error = None

  def __call__(self, event):
    if event.tokens:
      self.tokens.extend(event.tokens)
      self.logprobs.extend(event.logprobs)
      if self.engine is not None:  # the engine thread calls emit: its counters are current
        self.chunks_seen.append(self.engine._stats["prefill_chunks"])  # pylint: disable=protected-access
      self.first.set()
    if event.finish_reason is not None:
      self.reason, self.error = event.finish_reason, event.error
      self.done.set()

  def wait(self, timeout=120):
    assert self.done.wait(timeout), "the request did not end"
    return self


def _submit(engine, text, max_tokens, collect=None):
  collect = collect or Collect()
  rid = engine.submit(Request(prompt=TOK.encode(text), max_tokens=max_tokens, emit=collect))
  return rid, collect


def _serve_all(engine, texts, max_tokens=8):
  """Every text submitted at once -> its Collect (ended)."""
  return [c.wait() for c in [_submit(engine, t, max_tokens)[1] for t in texts]]


def test_chunked_output_equals_the_whole_prompt_engines(chunked):
  """Several requests at once on 3 slots, one of them a 56-token prompt (14 chunks), two sharing a
  system prompt the prefix cache serves to the second (its remainder then fed in chunks after the
  reused blocks): greedy tokens, finish reasons and log-probs equal the engine that feeds each prompt
  whole. Catches a chunk written at the wrong columns or positions (a re-fed last chunk, the reused
  prefix), a slot decoding before its prompt is in, the next-token logits taken from a middle chunk."""
  plain, engine = chunked
  texts = [LONG, SYSTEM + "rev abc=", "x", "1+2=", SYSTEM + "sort 9 1 5="]
  _serve_all(engine, [SYSTEM + "hi"], 2)  # the system prompt's blocks into the prefix cache
  before = engine.metrics()
  got, want = _serve_all(engine, texts), _serve_all(plain, texts)
  for text, a, b in zip(texts, got, want):
    assert (a.tokens, a.reason) == (b.tokens, b.reason) and a.error is None, text
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, err_msg=text)
  after = engine.metrics()
  assert after["reused_tokens"] - before["reused_tokens"] >= 2 * 16
  assert after["prefill_chunks"] - before["prefill_chunks"] >= len(TOK.encode(LONG)) // CHUNK
  assert after["active"] == 0 and after["prefilling"] == 0


def test_a_decoding_request_gets_tokens_between_a_long_prompts_chunks(chunked):
  """A request decoding 40 tokens, then a 56-token prompt (14 chunks) arrives: the first request's
  token events come at (at least 3) different chunk counts strictly inside the long prompt's prefill,
  and the long request still gives the plain engine's output. Catches a prompt fed whole, or its
  chunks back to back in one iteration (the decoding slot stalls behind them), and a long request
  that never joins decoding."""
  plain, engine = chunked
  long_text = _long("A")
  base = engine.metrics()["prefill_chunks"]
  _, short = _submit(engine, "x", 40, Collect(engine))
  assert short.first.wait(120)
  _, long = _submit(engine, long_text, 6)
  short.wait(), long.wait()
  chunks = -(-(len(TOK.encode(long_text)) - CHUNK) // CHUNK) + 1
  inside = {c for c in short.chunks_seen if base < c < base + chunks}
  assert len(inside) >= 3, (short.chunks_seen, base, chunks)
  assert long.tokens == _serve_all(plain, [long_text], 6)[0].tokens and long.reason in ("stop", "length")


def test_cancelling_mid_prefill_frees_the_slot(chunked, monkeypatch):
  """A long prompt cancelled after its second chunk ends "cancelled" with no tokens, before its
  prompt is in; no slot stays held or prefilling, and the same prompt then gives the plain output.
  Catches a cancelled prefill that keeps its slot (or keeps feeding chunks)."""
  plain, engine = chunked
  long_text = _long("B")
  slots_engine = engine._slots_engine  # pylint: disable=protected-access
  feed, box = slots_engine.feed, {}

  def cancelling(*args):
    box["calls"] = box.get("calls", 0) + 1
    if box["calls"] == 1:
      engine.cancel(box["rid"])  # handled at the next loop iteration, mid-prefill
    return feed(*args)
  monkeypatch.setattr(slots_engine, "feed", cancelling)
  before = engine.metrics()
  box["rid"], long = _submit(engine, long_text, 6)
  long.wait()
  monkeypatch.setattr(slots_engine, "feed", feed)
  assert long.reason == "cancelled" and not long.tokens
  after = _settled(engine)
  assert after["active"] == 0 and after["prefilling"] == 0 and after["cancelled"] == before["cancelled"] + 1
  assert after["prefill_chunks"] - before["prefill_chunks"] < len(TOK.encode(long_text)) // CHUNK
  again = _serve_all(engine, [long_text], 6)[0]
  assert again.tokens == _serve_all(plain, [long_text], 6)[0].tokens


def test_an_error_mid_prefill_ends_that_request_only(chunked, monkeypatch):
  """A chunk that fails (its program raises) ends the long request with an "error" event naming the
  prefill; a request decoding meanwhile ends normally with the plain engine's tokens, the slot is
  free and the engine serves the long prompt afterwards. Catches a failed chunk that stops the
  engine, fails every request, or leaves its slot held."""
  plain, engine = chunked
  long_text = _long("C")
  slots_engine = engine._slots_engine  # pylint: disable=protected-access
  feed = slots_engine.feed

  def failing(*args):
    raise RuntimeError("chunk program failed")
  _, short = _submit(engine, "1+2=", 30)
  assert short.first.wait(120)
  monkeypatch.setattr(slots_engine, "feed", failing)
  _, long = _submit(engine, long_text, 6)
  long.wait()
  monkeypatch.setattr(slots_engine, "feed", feed)
  short.wait()
  assert long.reason == "error" and "prefill failed: RuntimeError: chunk program failed" in long.error
  assert short.error is None and short.tokens == _serve_all(plain, ["1+2="], 30)[0].tokens
  after = _settled(engine)
  assert after["active"] == 0 and after["prefilling"] == 0
  assert _serve_all(engine, [long_text], 6)[0].tokens == _serve_all(plain, [long_text], 6)[0].tokens


def _settled(engine, timeout=10):
  """The engine's metrics once no slot is held (a freed slot shows at the next loop iteration)."""
  deadline = time.time() + timeout
  while engine.metrics()["active"] and time.time() < deadline:
    time.sleep(0.05)
  return engine.metrics()


@pytest.mark.parametrize("chunk", [-1, 2.5, "4", True])
def test_a_bad_chunk_names_the_field(chunk):
  """A negative, fractional, string or boolean prefill chunk is refused in one line naming
  rl.prefill_chunk, given to EngineSpec (a negative one read from the config too); rl.prefill_chunk=6 reaches
  the spec (the server reads the RL engine's setting)."""
  with pytest.raises(ValueError, match=r"^rl.prefill_chunk=.* must be a whole number of tokens"):
    EngineSpec(slots=1, max_len=8, prefill_chunk=chunk)
  with pytest.raises(ValueError, match=r"^rl.prefill_chunk=-2 must"):  # the config's field is an int
    EngineSpec.from_config(configs.load("configs/tiny.py", ["rl.prefill_chunk=-2"]))
  assert EngineSpec.from_config(configs.load("configs/tiny.py", ["rl.prefill_chunk=6"])).prefill_chunk == 6
