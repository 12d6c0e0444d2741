"""The serving engine (serve/engine.py) and its prefix cache (serve/prefix_cache.py): greedy output
equals the RL generator's (rl/generation) whatever runs in the other slots, prefix reuse changes nothing but
the work done, cancelled requests free their slot."""

import queue
import threading
import time

import jax
import numpy as np
import pytest

from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.step.spec import make_generator
from meshrl.serve.engine import Engine, EngineSpec, Request
from meshrl.serve.prefix_cache import PrefixCache, block_hashes

TOK = ByteTokenizer()
MAX_LEN, NEW, PROMPT_LEN = 64, 12, 40  # as tests/serve/conftest.py's config
SYSTEM = "Be terse. Answer: "  # 17 bytes + BOS: two full blocks of 8 shared (prompts stay <= 32 tokens)
QUESTIONS = ["rev abc=", "1+2=", "sort 9 1 5=", "x", "what is a cat?"]


@pytest.fixture(scope="module")
def served(tiny_served):
  cfg, model, engine = tiny_served
  rollout = make_generator(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, group_size=1, temperature=0.0, multi_turn=False, complete=True)
  _, params, extra = nnx.split(model, nnx.Param, ...)

  def reference(texts):
    """Greedy `generate` output of each text or token list (tokens up to its stop id or NEW); always
    6 rows, one compile."""
    tokens, mask = np.full((6, PROMPT_LEN), TOK.pad_id, np.int32), np.zeros((6, PROMPT_LEN), bool)
    for row, text in enumerate((list(texts) + ["x"] * 6)[:6]):
      ids = TOK.encode(text) if isinstance(text, str) else list(text)
      tokens[row, PROMPT_LEN - len(ids):], mask[row, PROMPT_LEN - len(ids):] = ids, True
    out = rollout(params, extra, tokens, mask, jax.random.key(0))
    generated, lengths = np.asarray(out.tokens)[:, PROMPT_LEN:], np.asarray(out.lengths)
    return [generated[i, :lengths[i]].tolist() for i in range(len(texts))]
  return engine, reference


def _run_concurrently(engine, prompts, **kw):
  """Submits every prompt at once (plus a sampled request in another slot); returns their outputs."""
  results = [None] * len(prompts)
  box: queue.Queue = queue.Queue()
  sampled = threading.Thread(target=lambda: box.put(engine.generate(
      TOK.encode("noise"), 30, temperature=1.0, top_p=0.9, seed=1)))
  sampled.start()

  def one(i):
    results[i] = engine.generate(prompts[i], NEW, **kw)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
  for t in threads:
    t.start()
  for t in threads + [sampled]:
    t.join()
  assert len(box.get()[0]) >= 1
  return results


def test_greedy_equals_generate_under_concurrent_requests_and_prefix_reuse(served):
  """6 requests on 3 slots (queueing, refills, a sampled neighbour), 4 of them sharing a system prompt
  the prefix cache serves after the first: each greedy output is generate's, token for token; the
  reused share of prompt tokens is > 0 and no slot stays held."""
  engine, reference = served
  texts = [SYSTEM + q for q in QUESTIONS[:4]] + QUESTIONS[4:]
  want = reference(texts)
  first = engine.generate(TOK.encode(texts[0]), NEW)  # puts the system prompt's blocks in the cache
  assert first[0] == want[0]
  before = engine.metrics()
  got = _run_concurrently(engine, [TOK.encode(t) for t in texts])
  for i, (tokens, reason) in enumerate(got):
    assert tokens == want[i], (i, texts[i])
    assert reason == ("stop" if tokens[-1] in TOK.stop_ids else "length")
  after = engine.metrics()
  reused = after["reused_tokens"] - before["reused_tokens"]
  assert reused >= 4 * 16  # each of the 4 system-prompt requests reused two 8-token blocks
  assert after["prefix_hit_rate"] > 0 and after["active"] == 0 and after["prefix_cache_blocks"] > 0


def test_prefix_of_same_length_but_other_tokens_misses(served):
  """A prompt that differs from a cached one only in its first token shares no block name, reuses
  nothing, and gives generate's output (reusing the other prompt's KV would change it)."""
  engine, reference = served
  a = SYSTEM + "rev abc="
  b = "W" + a[1:]
  assert all(x != y for x, y in zip(block_hashes(TOK.encode(a), 8), block_hashes(TOK.encode(b), 8)))
  engine.generate(TOK.encode(a), 2)
  reused = engine.metrics()["reused_tokens"]
  tokens, _ = engine.generate(TOK.encode(b), NEW)
  assert engine.metrics()["reused_tokens"] == reused
  assert tokens == reference([b])[0]


def test_next_turn_reuses_the_blocks_of_the_previous_reply(served):
  """A finished request leaves its prompt + reply blocks in the prefix cache: a follow-up prompt that
  continues the reply reuses past the first prompt, and still gives generate's output."""
  engine, reference = served
  first = TOK.encode(SYSTEM + "sort 1=")  # 26 tokens: 3 full blocks
  reply, _ = engine.generate(first, NEW)
  follow_up = first + reply + TOK.encode("?", add_bos=False)
  assert len(follow_up) <= PROMPT_LEN
  before = engine.metrics()["reused_tokens"]
  tokens, _ = engine.generate(follow_up, NEW)
  assert engine.metrics()["reused_tokens"] - before == (len(first + reply) // 8) * 8 > len(first)
  assert tokens == reference([follow_up])[0]


def test_request_stop_id_and_cancel_free_the_slot(served):
  """A request stop id ends the output there ("stop"); a cancelled request ends "cancelled" and its
  slot is free again; the next request in that slot still gives generate's output."""
  engine, reference = served
  text = "sort 9 1 5="
  want = reference([text])[0]
  tokens, reason = engine.generate(TOK.encode(text), NEW, stop_ids=(want[2],))
  assert tokens == want[:want.index(want[2]) + 1] and reason == "stop"

  events: queue.Queue = queue.Queue()
  rid = engine.submit(Request(prompt=TOK.encode("long one"), max_tokens=MAX_LEN - 10, emit=events.put))
  assert events.get(timeout=60).tokens  # decoding
  engine.cancel(rid)
  while (event := events.get(timeout=60)).finish_reason is None:
    pass
  assert event.finish_reason == "cancelled"
  deadline = time.time() + 10
  while engine.metrics()["active"] and time.time() < deadline:
    time.sleep(0.05)
  assert engine.metrics()["active"] == 0 and engine.metrics()["cancelled"] >= 1
  assert engine.generate(TOK.encode(text), NEW)[0] == want


def test_seed_repeats_a_sample_and_a_tiny_top_p_is_greedy(served):
  engine, reference = served
  prompt = TOK.encode("1+2=")
  first, again, other = (engine.generate(prompt, NEW, temperature=1.0, seed=s)[0] for s in (11, 11, 12))
  assert first == again and first != other
  assert engine.generate(prompt, NEW, temperature=1.0, top_p=1e-6, seed=5)[0] == reference(["1+2="])[0]


def test_bad_requests_are_rejected_naming_the_problem(served):
  engine, _ = served
  for kw, message in [(dict(prompt=[], max_tokens=4), "empty"),
                      (dict(prompt=[1] * 60, max_tokens=8), "context length"),
                      (dict(prompt=[1], max_tokens=0), "max_tokens"),
                      (dict(prompt=[1], max_tokens=2, top_p=0.0), "top_p"),
                      (dict(prompt=[999], max_tokens=2), "token ids")]:
    with pytest.raises(ValueError, match=message):
      engine.submit(Request(emit=lambda e: None, **kw))
  with pytest.raises(ValueError, match="serve.slots"):
    EngineSpec(slots=0, max_len=8)


def test_prefix_cache_lru_evicts_chain_tails_first():
  """Budget of 3 blocks: a second 2-block chain evicts the first chain's tail, its head stays."""
  cache = PrefixCache(block=2, budget_bytes=3 * 8)
  block = lambda: {"k": np.zeros(2, np.float32)}  # noqa: E731  (8 bytes)
  a, b = block_hashes([1, 2, 3, 4], 2), block_hashes([5, 6, 7, 8], 2)
  cache.insert_chain([(a[0], block()), (a[1], block())])
  cache.insert_chain([(b[0], block()), (b[1], block())])
  assert cache.contains(a[0]) and not cache.contains(a[1]) and cache.contains(b[0]) and cache.contains(b[1])
  found, _ = cache.lookup([1, 2, 3, 4, 9], 4)
  assert len(found) == 1 and cache.evictions == 1


def test_spec_from_config_names_the_field():
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["serve.max_len=65"])
  with pytest.raises(ValueError, match=r"serve.max_len=65 exceeds model.max_seq_len=64"):
    EngineSpec.from_config(cfg)
  cfg = configs.load("configs/tiny.py", ["serve.prefix_cache_mb=-1"])
  with pytest.raises(ValueError, match="serve.prefix_cache_mb"):
    EngineSpec.from_config(cfg)
  spec = EngineSpec.from_config(configs.load("configs/tiny.py", ["serve.decode_chunk=3"]))
  assert spec.max_len == 64 and spec.chunk == 3 and spec.buckets == (16, 32, 64)


@pytest.mark.slow
def test_moe_greedy_equals_generate_with_prefix_reuse():
  """The same parity on tiny's MoE (a dense layer, then 4 experts), two prompts sharing 2 blocks."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
                                         "moe.expert_mlp_dim=32", "model.init_std=0.5",
                                         f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW}"])
  model = build_model(ModelConfig.from_config(cfg, None), None, seed=3)
  engine = Engine(model, EngineSpec(slots=2, max_len=MAX_LEN, chunk=4, prefix_block=8),
                  stop_ids=TOK.stop_ids, pad_id=TOK.pad_id).start()
  texts = [SYSTEM + "rev abc=", SYSTEM + "1+2=", "x", "sort 9 1 5="]
  rollout = make_generator(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, group_size=1, temperature=0.0, multi_turn=False, complete=True)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  tokens, mask = TOK.encode_batch(texts, length=PROMPT_LEN, padding="left")
  out = rollout(params, extra, tokens, mask, jax.random.key(0))
  generated, lengths = np.asarray(out.tokens)[:, PROMPT_LEN:], np.asarray(out.lengths)
  try:
    for i, text in enumerate(texts):
      assert engine.generate(TOK.encode(text), NEW)[0] == generated[i, :lengths[i]].tolist(), text
    assert engine.metrics()["reused_tokens"] >= 16
  finally:
    engine.close()


def test_speculative_server_gives_the_plain_servers_text(tiny_served):
  """The server speculating (n-gram prompt lookup, and a draft model) answers every request with the
  plain engine's tokens, greedy and sampled with a seed (proposals are accepted only where they are
  the target's own draws), in fewer target forwards when proposals are accepted."""
  from meshrl.rl.generation.proposers import ProposerSpec  # pylint: disable=import-outside-toplevel
  cfg, model, plain = tiny_served
  draft_cfg = configs.load("configs/tiny.py:dense", ["model.num_layers=1", "model.embed_dim=32",
                                                     "model.head_dim=16", "model.max_seq_len=64"])
  draft = build_model(ModelConfig.from_config(draft_cfg, None), None, seed=4)
  prompts = [TOK.encode(t) for t in ("abcabcabcabc", "rev abc=", "1+2=1+2=1+2=")]
  requests = [dict(), dict(temperature=0.9, top_p=0.95, seed=11)]
  want = [[plain.generate(p, NEW, **kw)[0] for p in prompts] for kw in requests]
  for proposer, draft_model in ((ProposerSpec("ngram", k=3, ngram_n=2), None), (ProposerSpec("draft", k=3), draft),
                                (ProposerSpec("draft", k=2), model)):
    spec = EngineSpec(slots=2, max_len=MAX_LEN - proposer.k, chunk=4, prefix_block=8, prefix_cache_bytes=0)
    engine = Engine(model, spec, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, proposer=proposer, draft=draft_model)
    engine.start()
    try:
      got = [[engine.generate(p, NEW, **kw)[0] for p in prompts] for kw in requests]
      forwards = engine.metrics()["target_forwards"]
    finally:
      engine.close()
    assert got == want, proposer
    if draft_model is model:  # the target as its own draft: every proposal accepted
      assert forwards < sum(len(t) for row in want for t in row) * 0.6, forwards


def test_bad_speculative_server_settings_name_them(tiny_served):
  from meshrl.rl.generation.proposers import ProposerSpec  # pylint: disable=import-outside-toplevel
  _, model, _ = tiny_served
  with pytest.raises(ValueError, match=r"serve.max_len=64 \+ rl.speculative_k=3 exceeds model.max_seq_len=64"):
    Engine(model, EngineSpec(slots=1, max_len=MAX_LEN), stop_ids=TOK.stop_ids, pad_id=TOK.pad_id,
           proposer=ProposerSpec("ngram", k=3))
  wide_cfg = configs.load("configs/tiny.py:dense", ["model.num_layers=1", "model.embed_dim=32", "model.head_dim=16",
                                                    "model.vocab_size=300"])
  wide = build_model(ModelConfig.from_config(wide_cfg, None), None)
  with pytest.raises(ValueError, match="draft model vocab_size=300 differs from the target's vocab_size=259"):
    Engine(model, EngineSpec(slots=1, max_len=32), stop_ids=TOK.stop_ids, pad_id=TOK.pad_id,
           proposer=ProposerSpec("draft", k=2), draft=wide)
