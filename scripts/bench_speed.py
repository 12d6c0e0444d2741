"""Generation speed: plain greedy decoding against speculative decoding (a distilled draft, and n-gram
prompt lookup), side by side in one run, through the generation engine (rl/generation) in an RL
generator and in the server, plus the int8 quality figures (rl/generation/quality.py).

  python scripts/bench_speed.py --json /tmp/speed.json
  python scripts/bench_speed.py --only=ngram --new_tokens=64

Sections are functions in SECTIONS (name -> fn(args) -> dict of figures); --only picks some. Each
returns flat JSON-ready figures; the table prints them all, ratios beside the absolute numbers.

speculative: a configs/tiny.py-like dense target made larger (--target_layers x --target_width),
  trained for --target_steps on the task (text of a random Markov chain: one likely successor per
  token), and a 1-layer narrow draft distilled on the target's own greedy completions of other prompts
  of the task (rl/algo/distill.py); both then decode held-out prompts: decode tokens/s, time to first
  token, identical output, acceptance rate, tokens per target forward. The task is easy on purpose
  (the target's greedy text follows the chain's likeliest successors), so acceptance is near 1: the
  figure shows what verification and the loop cost, not how good a real draft is.
ngram: a copy-heavy task: each prompt is the target's own greedy text (its seed and first
  --copy_context tokens), so the answer continues text the prompt already holds; prompt lookup
  (--ngram_k proposals) vs plain.
int8: rl/generation/quality.int8_quality on the tiny model (greedy agreement, max logit error, cache bytes).
server_speculative: the server (serve/engine.py) with the same target, one request at a time (batch 1):
  plain, the distilled draft and n-gram lookup, tokens/s of whole requests and whether the speculative
  server's greedy text is the plain server's (`server_plain_tps`, `server_speculative_tps`,
  `server_ngram_tps`, `server_speculative_identical`).
server: added by scripts/bench_server.py's section (p50/p99 latency, throughput, errors).

Timings are wall-clock on whatever machine runs this (a shared CPU is noisy: rerun before trusting a
ratio); every timed call is compiled and warmed first, and the best of --repeats is kept.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshrl.configs import cli
from meshrl.model.layers import RopeConfig
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.algo.distill import DistillConfig, distill
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.proposers import ProposerSpec
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.generation.spec import GenerationSpec

VOCAB = 259  # the byte tokenizer's


def _config(layers: int, width: int, max_len: int, init_std: float) -> ModelConfig:
  heads = max(2, width // 64)
  return ModelConfig(vocab_size=VOCAB, num_layers=layers, embed_dim=width, num_heads=heads,
                     num_kv_heads=max(1, heads // 2), head_dim=width // heads, mlp_dim=2 * width,
                     max_seq_len=max_len, rope=RopeConfig(head_dim=width // heads), init_std=init_std)


def _best_time(fn, repeats: int):
  """(best wall seconds, last output) of fn() after one warm-up call (compilation)."""
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best, out


def _random_prompts(seed: int, rows: int, length: int) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (rows, length), 3, VOCAB, jnp.int32)


class _Decoders:
  """Plain and speculative greedy decoding of one target through rl/generation Generators (the static
  scheduler, no stop token), one per (method, length)."""

  def __init__(self, target: Transformer, draft: Transformer | None, k: int, ngram_n: int):
    self.target, self.k, self.ngram_n = target, k, ngram_n
    self.graphdef, self.params, self.rest = nnx.split(target, nnx.Param, ...)
    self.draft = draft

  def _generator(self, prompts, new_tokens: int, proposer: ProposerSpec) -> Generator:
    step = StepConfig(sampler=Sampler(0.0), stop_tokens=(), pad_id=0, proposer=proposer)
    spec = GenerationSpec(step=step, group_size=1, prompt_len=prompts.shape[1], max_new_tokens=new_tokens)
    draft = None
    if proposer.method == "draft":
      draft = (self.draft.config, nnx.split(self.draft, nnx.Param, ...)[1])
    return Generator(spec, self.target.config, draft=draft)

  def _run(self, prompts, new_tokens: int, proposer: ProposerSpec):
    gen = self._generator(prompts, new_tokens, proposer)
    mask = jnp.ones_like(prompts, bool)

    def run():
      out = gen(self.params, self.rest, prompts, mask, jax.random.key(0))
      return out, gen.metrics
    return run

  def plain(self, prompts, new_tokens: int):
    run = self._run(prompts, new_tokens, ProposerSpec())
    return lambda: run()[0]

  def speculative(self, prompts, new_tokens: int, method: str):
    k = self.k
    return self._run(prompts, new_tokens, ProposerSpec(method, k=k, ngram_n=self.ngram_n))


def _compare(args, decoders: _Decoders, prompts, method: str, prefix: str) -> dict:
  """Plain vs speculative on prompts: tokens/s, time to first token, identity, acceptance."""
  new = args.new_tokens
  plain_s, plain = _best_time(decoders.plain(prompts, new), args.repeats)
  spec_s, (out, metrics) = _best_time(decoders.speculative(prompts, new, method), args.repeats)
  ttft_plain, _ = _best_time(decoders.plain(prompts, 1), args.repeats)
  ttft_spec, _ = _best_time(decoders.speculative(prompts, 1, method), args.repeats)
  tokens = int(jnp.sum(plain.lengths))
  identical = bool(jnp.all(out.tokens == plain.tokens) & jnp.all(out.lengths == plain.lengths))
  return {
      "plain_tps": tokens / plain_s, f"{prefix}_tps": int(jnp.sum(out.lengths)) / spec_s,
      f"{prefix}_speedup": plain_s / spec_s, f"{prefix}_identical": identical,
      f"{prefix}_acceptance_rate": float(metrics["acceptance_rate"]),
      f"{prefix}_tokens_per_forward": float(metrics["tokens_per_forward"]),
      "plain_ttft_s": ttft_plain, f"{prefix}_ttft_s": ttft_spec}


def _markov_text(chain_seed: int, sample_seed: int, rows: int, length: int) -> np.ndarray:
  """Rows of a random first-order Markov chain over the vocab: each token has one likely successor
  (p 0.7) and two others (0.15 each): a stand-in for text with structure a small model can learn."""
  successors = np.random.default_rng(chain_seed).integers(3, VOCAB, size=(VOCAB, 3))
  rng = np.random.default_rng(sample_seed)
  text = np.empty((rows, length), np.int64)
  text[:, 0] = rng.integers(3, VOCAB, size=rows)
  for t in range(1, length):
    choice = rng.choice(3, size=rows, p=[0.7, 0.15, 0.15])
    text[:, t] = successors[text[:, t - 1], choice]
  return text


def _target(args) -> Transformer:
  """The target: a dense model trained for --target_steps on Markov-chain text (a random-init model's
  greedy text is noise that no draft can learn; a trained one has structure, as a real LM has).
  Trained once per run; the sections share it."""
  if getattr(_target, "cached", None) is not None:
    return _target.cached
  mc = _config(args.target_layers, args.target_width, args.max_len, args.init_std)
  target = Transformer(mc, rngs=nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(target, nnx.Param, ...)
  optimizer = optax.adam(args.target_lr)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1]).logits
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  text = _markov_text(args.seed, 1, args.target_steps * 16, 65)
  for i in range(args.target_steps):
    params, opt_state, loss = step(params, opt_state, jnp.asarray(text[16 * i:16 * (i + 1)], jnp.int32))
  nnx.update(target, params)
  _target.final_loss = float(loss)
  _target.cached = target
  return target


def _task_prompts(args, sample_seed: int, rows: int) -> jax.Array:
  """Prompts of the task: fresh text of the chain the target learned."""
  return jnp.asarray(_markov_text(args.seed, sample_seed, rows, args.prompt_len), jnp.int32)


def bench_speculative(args) -> dict:
  target = _target(args)
  draft = Transformer(_config(1, args.draft_width, args.max_len, args.init_std), rngs=nnx.Rngs(args.seed + 1))
  # Distil on the target's greedy completions of training prompts; measure on held-out prompts.
  train_prompts = _task_prompts(args, 100, args.distill_prompts)
  start = time.perf_counter()
  batch = _Decoders(target, None, args.k, args.ngram_n).plain(train_prompts, args.new_tokens)()
  history = distill(target, draft, batch, jax.random.key(1),
                    DistillConfig(steps=args.distill_steps, learning_rate=args.distill_lr,
                                  batch_size=args.distill_batch))
  distill_s = time.perf_counter() - start
  decoders = _Decoders(target, draft, args.k, args.ngram_n)
  figures = _compare(args, decoders, _task_prompts(args, 7, args.batch), "draft", "speculative")
  figures["acceptance_rate"] = figures.pop("speculative_acceptance_rate")
  _draft.cached = draft
  figures.update(distill_s=distill_s, distill_final_loss=history[-1]["loss"],
                 distill_greedy_agreement=history[-1]["greedy_agreement"],
                 target_train_loss=_target.final_loss)
  return figures


def bench_ngram(args) -> dict:
  target = _target(args)
  decoders = _Decoders(target, None, args.ngram_k, args.ngram_n)
  seeds = _task_prompts(args, 11, args.batch)
  context = decoders.plain(seeds, args.copy_context)().tokens  # [B, Lp + C]: seed + the target's own text
  figures = _compare(args, decoders, context, "ngram", "ngram")
  figures.pop("plain_ttft_s")
  return {("ngram_plain_tps" if k == "plain_tps" else k): v for k, v in figures.items()}


def _draft(args) -> Transformer:
  """The distilled draft of bench_speculative (run first when absent)."""
  if getattr(_draft, "cached", None) is None:
    bench_speculative(args)
  return _draft.cached


def bench_int8(args) -> dict:
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.rl.generation.quality import int8_quality  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import model_config  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [f"model.max_seq_len={args.prompt_len + 256}"])
  mc = model_config(cfg)
  _, params, extra = nnx.split(build_model(mc, seed=args.seed), nnx.Param, ...)
  return int8_quality(mc, params, extra, _random_prompts(args.seed + 3, 4, args.prompt_len),
                      new_tokens=256)


def bench_server_speculative(args) -> dict:
  """The server (serve/engine.py) at batch 1: plain, the distilled draft (k = --k) and n-gram lookup
  (k = --ngram_k) on the same held-out prompts; tokens/s over whole requests, the best of --repeats."""
  from meshrl.serve.engine import Engine, EngineSpec  # pylint: disable=import-outside-toplevel
  target, draft = _target(args), _draft(args)
  prompts = [list(map(int, row)) for row in np.asarray(_task_prompts(args, 7, args.server_requests))]
  texts, figures = {}, {}
  for name, proposer in (("plain", ProposerSpec()), ("speculative", ProposerSpec("draft", k=args.k)),
                         ("ngram", ProposerSpec("ngram", k=args.ngram_k, ngram_n=args.ngram_n))):
    spec = EngineSpec(slots=1, max_len=args.max_len - proposer.window, chunk=args.server_chunk, prefix_cache_bytes=0)
    engine = Engine(target, spec, stop_ids=(), pad_id=0, proposer=proposer,
                    draft=draft if proposer.method == "draft" else None).start()
    try:
      engine.generate(prompts[0], args.new_tokens)  # compile
      best = float("inf")
      for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = [engine.generate(p, args.new_tokens)[0] for p in prompts]
        best = min(best, time.perf_counter() - start)
      texts[name] = outputs
      figures[f"server_{name}_tps"] = sum(len(o) for o in outputs) / best
      figures[f"server_{name}_target_forwards"] = engine.metrics()["target_forwards"]
    finally:
      engine.close()
  for name in ("speculative", "ngram"):
    figures[f"server_{name}_speedup"] = figures[f"server_{name}_tps"] / figures["server_plain_tps"]
  figures["server_speculative_identical"] = texts["speculative"] == texts["plain"]
  figures["server_ngram_identical"] = texts["ngram"] == texts["plain"]
  return figures


def bench_server(args) -> dict:
  """scripts/bench_server.py's load test (1, 8, 32 clients) of the server on configs/tiny.py, 32 slots."""
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from bench_server import section_server  # pylint: disable=import-outside-toplevel
  figures = section_server(args, configs.load("configs/tiny.py", ["serve.slots=32"]))
  figures.pop("server_detail")
  return figures


# name -> fn(args) -> {figure: value}. The server section (scripts/bench_server.py) is added here.
SECTIONS = {"speculative": bench_speculative, "ngram": bench_ngram, "server_speculative": bench_server_speculative,
            "int8": bench_int8, "server": bench_server}


def parse_args(argv=None):
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--json", default="", help="write the figures here")
  parser.add_argument("--only", default="", help=f"comma-separated sections of {sorted(SECTIONS)}")
  parser.add_argument("--batch", type=int, default=1, help="rows decoded together (latency: 1)")
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--copy_context", type=int, default=192, help="ngram: target text in each prompt")
  parser.add_argument("--k", type=int, default=4, help="tokens proposed per target forward")
  parser.add_argument("--ngram_n", type=int, default=3)
  parser.add_argument("--ngram_k", type=int, default=8, help="ngram: tokens proposed per forward (copies run long)")
  parser.add_argument("--target_layers", type=int, default=4)
  parser.add_argument("--target_width", type=int, default=256)
  parser.add_argument("--draft_width", type=int, default=64)
  parser.add_argument("--init_std", type=float, default=0.02, help="random-init scale of both models")
  parser.add_argument("--target_steps", type=int, default=150, help="target training steps (16 x 64 tokens)")
  parser.add_argument("--target_lr", type=float, default=3e-3)
  parser.add_argument("--max_len", type=int, default=512)
  parser.add_argument("--distill_prompts", type=int, default=64)
  parser.add_argument("--distill_steps", type=int, default=150)
  parser.add_argument("--distill_batch", type=int, default=16)
  parser.add_argument("--distill_lr", type=float, default=3e-3)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--server_requests", type=int, default=4, help="server_speculative: requests timed")
  parser.add_argument("--server_chunk", type=int, default=16, help="server_speculative: decode steps per chunk")
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SECTIONS)
  unknown = [n for n in names if n not in SECTIONS]
  if unknown:
    raise SystemExit(f"--only: unknown sections {unknown}; choose from {sorted(SECTIONS)}.")
  figures: dict = {"backend": jax.default_backend()}
  for name in names:
    start = time.perf_counter()
    figures.update(SECTIONS[name](args))
    print(f"[{name}] done in {time.perf_counter() - start:.1f} s", flush=True)
  print(f"{'figure':<36}{'value':>14}")
  for key, value in figures.items():
    shown = f"{value:.4g}" if isinstance(value, float) else str(value)
    print(f"{key:<36}{shown:>14}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(figures, f, indent=2)
  return figures


if __name__ == "__main__":
  main()
