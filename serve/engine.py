"""The request-level generation engine behind the server: decode slots that requests join and leave
at any time, a prefix cache, and one background thread that owns the device.

  engine = Engine(model, EngineSpec.from_config(cfg), stop_ids=tok.stop_ids, pad_id=tok.pad_id,
                  proposer=ProposerSpec("ngram", k=4))          # or "draft" with draft=(model)
  engine.start()
  rid = engine.submit(Request(prompt=ids, max_tokens=32, emit=on_event))   # from any thread
  engine.cancel(rid)                                                       # from any thread
  engine.close()

The engine decodes through the generation core (rl/generation/host.SlotEngine, the same decode step
as RL rollouts), so every option of the core reaches the server: speculative decoding (a draft model
or n-gram prompt lookup, with the output of plain decoding token for token), per-request sampling
(temperature, top-p, seed), per-request stop ids, the int8 KV cache and int8 weights. A slot is
sample `slot` of a pool of C samples whose buffer rows hold each request's prompt and reply.

The thread loops: take new requests and cancellations from a thread-safe queue; admit waiting
requests into free slots (the longest cached prompt prefix placed into the slot's cache row, the rest
of the prompt fed by `start`); run one jitted decode chunk (serve.decode_chunk steps of every live
slot); hand each request its new tokens and their log-probs through its `emit` callback; free the
slots whose requests ended (stop id, max_tokens) or were cancelled.

Chunked prefill (rl.prefill_chunk = c > 0, the RL engine's setting; Sarathi-Serve's chunked prefills,
Agrawal et al. 2024): a prompt remainder longer than c is fed c tokens at a time, the first chunk at
admission and one more per loop iteration (`SlotEngine.feed`, before that iteration's decode chunk),
so the slots already decoding keep receiving tokens while a long prompt comes in; its slot joins
decoding once the prompt is in (the sample waits paused until then). Its new prefix blocks are saved
then; a cancellation or an error meanwhile frees the slot like any other. A request that ends leaves the
blocks of its prompt + reply in the prefix cache, so the next turn of a chat reuses them. A slot is
held only between its request's admission and its end or cancellation (`metrics()["active"]`).

Prefill lengths are rounded up to a few buckets (powers of two, and the context length), so at most
that many `start` programs compile.

Axis legend: C decode slots, S context length (cache columns), P prefix block, k proposals.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl.model.transformer import Transformer
from meshrl.rl.generation import host
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import check_draft
from meshrl.rl.generation.host import Graphs, SlotEngine
from meshrl.rl.generation.proposers import ProposerSpec
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.generation.state import Pool, new_pool
from meshrl.serve.prefix_cache import PrefixCache, block_hashes

MAX_STOP_IDS = 8  # a request's own stop ids (besides the tokenizer's)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """The numbers of one engine (from cfg.serve by `from_config`)."""
  slots: int
  max_len: int
  chunk: int = 8
  prefix_block: int = 16
  prefix_cache_bytes: int = 256 << 20
  prefill_chunk: int = 0  # rl.prefill_chunk: prompt tokens fed per loop iteration (0 = the whole prompt at once)

  def __post_init__(self):
    if self.slots < 1:
      raise ValueError(f"serve.slots={self.slots} must be at least 1.")
    if self.max_len < 2:
      raise ValueError(f"serve.max_len={self.max_len} must be at least 2 (a prompt token and a new one).")
    if self.chunk < 1:
      raise ValueError(f"serve.decode_chunk={self.chunk} must be at least 1.")
    if self.prefix_block < 1:
      raise ValueError(f"serve.prefix_block={self.prefix_block} must be at least 1.")
    if self.prefix_cache_bytes < 0:
      raise ValueError(f"serve.prefix_cache_mb={self.prefix_cache_bytes / 2**20} must be >= 0 (0 = off).")
    chunk = self.prefill_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 0:
      raise ValueError(f"rl.prefill_chunk={chunk!r} must be a whole number of tokens >= 1 (0 = the whole prompt "
                       "at once).")

  @classmethod
  def from_config(cls, cfg) -> "EngineSpec":
    s = cfg.serve
    window = cfg.rl.speculative_k if cfg.rl.speculative != "none" else 0  # room past a slot's end
    max_len = s.max_len or cfg.model.max_seq_len - window
    if max_len + window > cfg.model.max_seq_len:
      raise ValueError(f"serve.max_len={s.max_len}" + (f" + rl.speculative_k={window}" if window else "")
                       + f" exceeds model.max_seq_len={cfg.model.max_seq_len}.")
    return cls(slots=s.slots, max_len=max_len, chunk=s.decode_chunk, prefix_block=s.prefix_block,
               prefix_cache_bytes=int(s.prefix_cache_mb * 2**20), prefill_chunk=cfg.rl.prefill_chunk)

  @property
  def buckets(self) -> tuple[int, ...]:
    """Prefill lengths: powers of two from 16 below the context length, then the context length."""
    return host.buckets(self.max_len, 16)


class Event(NamedTuple):
  """What the engine tells a request: new tokens (and each one's log-prob under the distribution it
  was drawn from: temperature-scaled, before top-p), or its end (finish_reason: "stop" (a stop id),
  "length" (max_tokens), "cancelled", or "error" with `error` set)."""
  tokens: tuple[int, ...] = ()
  finish_reason: str | None = None
  error: str | None = None
  logprobs: tuple[float, ...] = ()


@dataclasses.dataclass
class Request:
  """One generation request. `emit(Event)` is called from the engine thread; it must not block."""
  prompt: Sequence[int]
  max_tokens: int
  emit: Callable[[Event], None]
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int | None = None
  stop_ids: tuple[int, ...] = ()  # ids that end this request besides the tokenizer's stop ids
  id: int = -1  # set by submit
  reused: int = 0  # prompt tokens taken from the prefix cache (set at admission)
  generated: list[int] = dataclasses.field(default_factory=list)  # tokens so far (engine thread)
  seen: int = 0  # tokens already handed to `emit` (engine thread)


class Engine:
  """Decode slots over one KV cache, run by one background thread (see the module docstring).

  proposer: speculative decoding (ProposerSpec; "draft" needs `draft`, a Transformer with the same
  vocabulary)."""

  def __init__(self, model: Transformer, spec: EngineSpec, *, stop_ids: Sequence[int], pad_id: int,
               proposer: ProposerSpec = ProposerSpec(), draft: Transformer | None = None):
    mc = model.config
    k = proposer.window
    if spec.max_len + k > mc.max_seq_len:
      raise ValueError(f"serve.max_len={spec.max_len}" + (f" + rl.speculative_k={k}" if k else "")
                       + f" exceeds model.max_seq_len={mc.max_seq_len}.")
    if len(stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"{len(stop_ids)} stop ids; at most {MAX_STOP_IDS}.")
    if proposer.method == "draft":
      if draft is None:
        raise ValueError("speculative decoding with a draft model needs the draft (rl.draft_config, rl.draft_checkpoint).")
      check_draft(mc, draft.config)
    self.spec, self.pad_id, self.stop_ids = spec, pad_id, tuple(int(i) for i in stop_ids)
    self.vocab_size, self.proposer = mc.vocab_size, proposer
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    draft_graph = draft_params = draft_rest = None
    if draft is not None and proposer.method == "draft":
      draft_graph, draft_params, draft_rest = nnx.split(draft, nnx.Param, ...)
    self._weights = (params, extra, draft_params)
    step = StepConfig(sampler=Sampler(per_row=True), stop_tokens=self.stop_ids, pad_id=pad_id, proposer=proposer)
    self._slots_engine = SlotEngine(Graphs(graphdef, None, draft_graph, draft_rest), step, slots=spec.slots,
                                    cache_len=spec.max_len + k, per_row_sampling=True, stop_ids=MAX_STOP_IDS,
                                    unrolled=False, prefill_chunk=spec.prefill_chunk)
    self._chunk_width = spec.chunk * (k + 1)  # tokens one chunk may add to a slot
    self._slot_ids = jnp.arange(spec.slots, dtype=jnp.int32)  # every slot, for the per-step token read
    self._decode = functools.partial(self._slots_engine.decode, steps=spec.chunk)
    self._reset()
    self.prefix = PrefixCache(spec.prefix_block, spec.prefix_cache_bytes)
    self._inbox: queue.Queue = queue.Queue()
    self._waiting: list[Request] = []
    self._slot_req: list[Request | None] = [None] * spec.slots
    self._prefilling: dict[int, tuple[int, list[bytes]]] = {}  # slot -> (prompt tokens in, its blocks' names)
    self._next_id = 0
    self._id_lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._rng = np.random.default_rng()
    self._stats = dict(requests=0, finished=0, cancelled=0, errors=0, prompt_tokens=0, reused_tokens=0,
                       generated_tokens=0, decode_chunks=0, prefills=0, prefill_chunks=0, target_forwards=0)

  def _reset(self) -> None:
    """Empty slots and a pool of one sample per slot (every slot free)."""
    spec = self.spec
    self._slots = self._slots_engine.empty(self._weights, spec.slots, self.vocab_size)
    blank = jnp.full((spec.slots, 1), self.pad_id, jnp.int32)
    pool = new_pool(blank, blank > 0, jax.random.split(jax.random.key(0), spec.slots), group_size=1,
                    width=spec.max_len, pad_id=self.pad_id)
    self._pool: Pool = pool.replace(done=jnp.ones_like(pool.done), count=jnp.zeros_like(pool.count))

  # --- any thread -------------------------------------------------------------------------------

  def check(self, request: Request) -> None:
    """Raises ValueError naming what is wrong with `request` (the server turns it into a 400)."""
    n = len(request.prompt)
    if n < 1:
      raise ValueError("the prompt is empty (0 tokens).")
    if any(not 0 <= int(t) < self.vocab_size for t in request.prompt):
      raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}).")
    if request.max_tokens < 1:
      raise ValueError(f"max_tokens={request.max_tokens} must be at least 1.")
    if n + request.max_tokens > self.spec.max_len:
      raise ValueError(f"the prompt ({n} tokens) plus max_tokens ({request.max_tokens}) exceeds the "
                       f"context length of {self.spec.max_len} tokens.")
    if not 0.0 <= request.temperature:
      raise ValueError(f"temperature={request.temperature} must be >= 0.")
    if not 0.0 < request.top_p <= 1.0:
      raise ValueError(f"top_p={request.top_p} must be in (0, 1].")
    if len(set(request.stop_ids)) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} extra stop ids per request.")

  def submit(self, request: Request) -> int:
    """Queues `request` (checked first: ValueError) and returns its id."""
    self.check(request)
    with self._id_lock:
      request.id = self._next_id
      self._next_id += 1
    self._inbox.put(("submit", request))
    return request.id

  def cancel(self, request_id: int, finish_reason: str = "cancelled") -> None:
    """Ends a request (waiting or decoding); its slot is free before the next decode chunk.
    finish_reason: what its last event says ("stop" when the caller found a stop string)."""
    self._inbox.put(("cancel", (request_id, finish_reason)))

  def start(self) -> "Engine":
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="meshrl-serve-engine", daemon=True)
      self._thread.start()
    return self

  def is_alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def close(self) -> None:
    self._stop.set()
    self._inbox.put(("wake", None))
    if self._thread is not None:
      self._thread.join(timeout=30)
      self._thread = None

  def metrics(self) -> dict:
    """Counters, slot occupancy (active: held; prefilling: of those, still taking their prompt in
    chunks) and the prefix cache's hit rate (reused / prompt tokens)."""
    stats = dict(self._stats)
    stats.update(slots=self.spec.slots, active=sum(r is not None for r in self._slot_req),
                 prefilling=len(self._prefilling),
                 waiting=len(self._waiting) + self._inbox.qsize(),
                 prefix_hit_rate=stats["reused_tokens"] / max(stats["prompt_tokens"], 1),
                 prefix_cache_blocks=len(self.prefix), prefix_cache_bytes=self.prefix.bytes)
    return stats

  def generate(self, prompt: Sequence[int], max_tokens: int, timeout: float = 120.0, **kw) -> tuple[
      list[int], str]:
    """Blocking convenience (tests, scripts): (generated ids, finish_reason)."""
    events: queue.Queue = queue.Queue()
    self.submit(Request(prompt=list(prompt), max_tokens=max_tokens, emit=events.put, **kw))
    tokens = []
    while True:
      event = events.get(timeout=timeout)
      tokens.extend(event.tokens)
      if event.finish_reason is not None:
        if event.error:
          raise RuntimeError(event.error)
        return tokens, event.finish_reason

  # --- engine thread ----------------------------------------------------------------------------

  def _run(self) -> None:
    while not self._stop.is_set():
      idle = not self._waiting and all(r is None for r in self._slot_req)
      self._drain(block=idle)
      self._feed_prompts()
      self._admit()
      if any(r is not None and slot not in self._prefilling for slot, r in enumerate(self._slot_req)):
        try:
          self._step()
        except Exception as e:  # pylint: disable=broad-except  (fail the requests, keep serving)
          self._fail_all(f"decode failed: {type(e).__name__}: {e}")
    self._drain(block=False)
    for request in self._waiting:  # closed: nobody waits forever
      self._finish(request, Event(finish_reason="error", error="the engine was closed."))
    self._waiting = []
    self._fail_all("the engine was closed.", reset=False)

  def _drain(self, block: bool) -> None:
    try:
      item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      kind, value = item
      if kind == "submit":
        self._stats["requests"] += 1
        self._waiting.append(value)
      elif kind == "cancel":
        self._cancel(*value)
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _cancel(self, request_id: int, finish_reason: str) -> None:
    for i, r in enumerate(self._waiting):
      if r.id == request_id:
        del self._waiting[i]
        self._finish(r, Event(finish_reason=finish_reason))
        return
    for slot, r in enumerate(self._slot_req):
      if r is not None and r.id == request_id:
        self._free(slot)
        self._finish(r, Event(finish_reason=finish_reason))
        return

  def _free(self, slot: int) -> None:
    self._slots, self._pool = self._slots_engine.finish(self._slots, self._pool, np.asarray([slot], np.int32))
    self._slot_req[slot] = None
    self._prefilling.pop(slot, None)

  def _finish(self, request: Request, event: Event) -> None:
    key = {"cancelled": "cancelled", "error": "errors"}.get(event.finish_reason, "finished")
    self._stats[key] += 1
    _emit(request, event)

  def _admit(self) -> None:
    while self._waiting and None in self._slot_req:
      request = self._waiting.pop(0)
      slot = self._slot_req.index(None)
      try:
        self._start(request, slot)
      except Exception as e:  # pylint: disable=broad-except
        self._finish(request, Event(finish_reason="error", error=f"prefill failed: {type(e).__name__}: {e}"))
        continue
      self._slot_req[slot] = request

  def _start(self, request: Request, slot: int) -> None:
    """Places the longest cached prefix into the slot's row, feeds the rest, saves the prompt's new blocks."""
    prompt = [int(t) for t in request.prompt]
    size, block = len(prompt), self.spec.prefix_block
    saved, names = self.prefix.lookup(prompt, size - 1)  # at least one token left to feed
    start = len(saved) * block
    chunked = 0 < self.spec.prefill_chunk < size - start
    if chunked:  # the first chunk now, the rest by _feed_prompts
      width = self.spec.prefill_chunk
      fed = start + width
    else:
      width = next(b for b in self.spec.buckets if b >= size - start)
      start = min(start, self.spec.max_len - width)  # the bucket must fit after the reused prefix
      fed = size
    engine, cache = self._slots_engine, self._slots.cache
    for b, entry in enumerate(saved[:-(-start // block)]):  # blocks holding columns < start
      cache = engine.place(cache, np.int32(slot), entry, np.int32(b * block))
    self._slots = self._slots.replace(cache=cache)
    row = np.full(self.spec.max_len, self.pad_id, np.int32)
    row[:size] = prompt
    rest = np.full((1, width), self.pad_id, np.int32)
    rest[0, :fed - start] = prompt[start:fed]
    seed = request.seed if request.seed is not None else int(self._rng.integers(0, 2**31 - 1))
    stops = list(dict.fromkeys(tuple(request.stop_ids)))
    details = (np.int32(request.max_tokens), np.int32(seed),
               np.float32(request.temperature), np.float32(request.top_p),
               np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32))
    self._slots, self._pool = engine.start(self._weights, self._slots, self._pool, np.int32(slot), row,
                                           np.int32(size), np.int32(start), rest, np.int32(fed),
                                           details)
    if chunked:
      self._prefilling[slot] = (fed, names)
      self._stats["prefill_chunks"] += 1
    else:
      self._save_blocks(slot, names)
    request.reused, request.generated, request.seen = start, [], 0
    self._stats["prefills"] += 1
    self._stats["prompt_tokens"] += size
    self._stats["reused_tokens"] += start

  def _feed_prompts(self) -> None:
    """One more chunk of every prompt being prefilled (`SlotEngine.feed`); a prompt now in whole
    saves its new prefix blocks (its slot decodes from the next decode step). A failed chunk ends
    its request with an error and frees the slot; the others go on."""
    chunk = self.spec.prefill_chunk
    for slot, (fed, names) in list(self._prefilling.items()):
      if slot not in self._prefilling:  # a failed chunk before this one reset every slot
        continue
      request = self._slot_req[slot]
      size = len(request.prompt)
      try:
        self._slots, self._pool = self._slots_engine.feed(self._weights, self._slots, self._pool, np.int32(slot),
                                                          np.int32(fed))
      except Exception as e:  # pylint: disable=broad-except  (fail this request, keep serving)
        self._finish(request, Event(finish_reason="error", error=f"prefill failed: {type(e).__name__}: {e}"))
        try:
          self._free(slot)
        except Exception:  # pylint: disable=broad-except  (the state was donated to the failed call)
          self._slot_req[slot] = None
          self._prefilling.pop(slot, None)
          self._fail_all(f"prefill failed: {type(e).__name__}: {e}")
        continue
      self._stats["prefill_chunks"] += 1
      fed = min(fed + chunk, size)
      if fed < size:
        self._prefilling[slot] = (fed, names)
      else:
        del self._prefilling[slot]
        self._save_blocks(slot, names)

  def _save_blocks(self, slot: int, names: list[bytes]) -> None:
    """Puts the blocks `names` (of the tokens in `slot`'s cache row) that the prefix cache lacks."""
    if not self.prefix.enabled:
      return
    block, read = self.spec.prefix_block, self._slots_engine.read_block
    self.prefix.insert_chain([(names[b], read(self._slots.cache, np.int32(slot), np.int32(b * block), block))
                              for b in range(len(names)) if not self.prefix.contains(names[b])])

  def _step(self) -> None:
    self._slots, self._pool, counters = self._decode(self._weights, self._slots, self._pool, np.int32(0))
    width, pool = self._chunk_width, self._pool
    # One transfer: the slots' state, each slot's last `width` tokens and log-probs, the forwards run.
    view = host.read(self._slots, pool, steps=counters.steps,
                     tokens=host.read_tokens(pool.tokens, self._slot_ids, pool.count, width),
                     logprobs=host.read_tokens(pool.logprobs, self._slot_ids, pool.count, width))
    tokens, logprobs = view["tokens"], view["logprobs"]
    self._stats["decode_chunks"] += 1
    self._stats["target_forwards"] += int(view["steps"])
    for slot, request in enumerate(self._slot_req):
      if request is None or slot in self._prefilling:
        continue
      fresh = int(view["generated"][slot]) - request.seen
      request.seen += fresh
      new = tuple(int(t) for t in tokens[slot][width - fresh:]) if fresh else ()
      new_logprobs = tuple(float(x) for x in logprobs[slot][width - fresh:]) if fresh else ()
      self._stats["generated_tokens"] += len(new)
      request.generated.extend(new)
      if not view["done"][slot]:
        if new:
          _emit(request, Event(tokens=new, logprobs=new_logprobs))
        continue
      # The row holds the KV of the prompt and every generated token (each is fed as it is committed):
      # the next turn of a chat, whose prompt continues with this reply, reuses its full blocks.
      self._save_blocks(slot, block_hashes(list(request.prompt) + request.generated, self.spec.prefix_block))
      self._free(slot)
      self._finish(request, Event(tokens=new, logprobs=new_logprobs,
                                  finish_reason="stop" if view["stopped"][slot] else "length"))

  def _fail_all(self, message: str, reset: bool = True) -> None:
    """Every decoding request ends with an error; with `reset` (after a failed decode, whose donated
    buffers may be gone) the slots and the cache start empty."""
    self._prefilling.clear()
    for slot, request in enumerate(self._slot_req):
      if request is not None:
        self._slot_req[slot] = None
        self._finish(request, Event(finish_reason="error", error=message))
    if reset:
      self._reset()


def _emit(request: Request, event: Event) -> None:
  try:
    request.emit(event)
  except Exception:  # pylint: disable=broad-except  (a client's callback must not stop the engine)
    pass
