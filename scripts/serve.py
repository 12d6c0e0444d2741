"""An OpenAI-compatible HTTP server over a meshrl policy (serve/app.py, serve/engine.py).

  python scripts/serve.py --config=configs/tiny.py --checkpoint=runs/tiny/checkpoints --port=8000
  python scripts/serve.py --config=configs/hf_qwen3_moe.py:/models/qwen3 --config.serve.slots=32
  curl localhost:8000/v1/chat/completions -d '{"model": "tiny", "messages": [{"role": "user", "content": "rev abc="}]}'

The policy is `--checkpoint` (a meshrl checkpoint folder or a Hugging Face directory; default: the
config's model.init_from, random weights when that is empty too: a demo). Serving options are
cfg.serve.*: slots, max_len (context length), decode_chunk, prefix_block, prefix_cache_mb, model_name.
Routes: /v1/completions, /v1/chat/completions (stream or not), /v1/models, /health, /metrics.
"""

import os
import socket
import sys

from meshrl.configs import cli


def _flags(parser):
  parser.add_argument("--checkpoint", default=None, help="meshrl checkpoint folder or HF directory")
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
  parser.add_argument("--port", type=int, default=8000, help="port to listen on")


def build(cfg, mesh=None):
  """(engine, tokenizer, model name) for cfg: the model of model.init_from (random when empty) in the
  rollout layout with rl.kv_cache_dtype and rl.generation_weights, an engine of cfg.serve's numbers
  speculating as rl.speculative says (a draft from rl.draft_config / rl.draft_checkpoint), not started."""
  # pylint: disable=import-outside-toplevel  (jax only after --cpu_devices)
  from flax import nnx

  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.model.transformer import Transformer
  from meshrl.rl.generation.proposers import ProposerSpec
  from meshrl.rl.generation.weights import WeightsSpec, make_prepare
  from meshrl.rl.step.spec import load_draft, rollout_model_config
  from meshrl.serve.engine import Engine, EngineSpec
  from meshrl.sharding.rules import rules_from_config
  from meshrl.train.init_from import check_initial_model, initial_model
  from meshrl.train.state import split_model
  # pylint: enable=import-outside-toplevel
  spec = EngineSpec.from_config(cfg)
  check_initial_model(cfg)
  tokenizer = tokenizer_from_config(cfg)
  _, params, extra = split_model(initial_model(cfg, mesh))
  mc = rollout_model_config(cfg, mesh)  # the rollout's layout and rl.kv_cache_dtype
  graphdef, abstract, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
  # int8 weights / the gathered layout: the generation weights every generator reads
  params = make_prepare(WeightsSpec(cfg.rl.generation_weights, cfg.rl.generation_layout), abstract, mesh,
                        rules_from_config(cfg.mesh))(params)
  proposer = ProposerSpec(cfg.rl.speculative, cfg.rl.speculative_k, cfg.rl.ngram_n)
  draft = None
  if proposer.method == "draft":
    draft_mc, draft_params = load_draft(cfg, mesh)
    draft_graph, _, draft_rest = nnx.split(nnx.eval_shape(lambda: Transformer(draft_mc, rngs=nnx.Rngs(0))),
                                           nnx.Param, ...)
    draft = nnx.merge(draft_graph, draft_params, draft_rest)
  engine = Engine(nnx.merge(graphdef, params, extra), spec, stop_ids=tokenizer.stop_ids,
                  pad_id=tokenizer.pad_id, proposer=proposer, draft=draft)
  return engine, tokenizer, cfg.serve.model_name or cfg.name


def check_address(host: str, port: int) -> None:
  """ValueError in one line unless `port` is a TCP port (1..65535) that `host` can listen on now (a
  port out of range was reported as given and listened on modulo 65536; one in use failed only after
  the model had loaded)."""
  if not 1 <= port <= 65535:
    raise ValueError(f"--port={port} must lie in 1..65535.")
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, port))
  except OSError as error:
    raise ValueError(f"--host={host} --port={port}: cannot listen there ({error.strerror or error}); choose "
                     "another --port (or --host).") from None


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # pylint: disable=import-outside-toplevel
  import uvicorn

  from meshrl.configs import checks
  from meshrl.serve.app import make_app
  from meshrl.sharding import make_mesh
  # pylint: enable=import-outside-toplevel
  check_address(args.host, args.port)
  checks.check_sections(cfg, "serve")
  if args.checkpoint:
    if not os.path.exists(args.checkpoint):
      raise ValueError(f"--checkpoint={args.checkpoint!r} does not exist.")
    cfg.model.init_from = os.path.abspath(args.checkpoint)
  engine, tokenizer, name = build(cfg, make_mesh(cfg.mesh))  # bad input: one line (cli.run)
  engine.start()
  print(f"serving {name!r} ({cfg.model.init_from or 'random init'}) on http://{args.host}:{args.port}/v1 "
        f"with {engine.spec.slots} slots, context {engine.spec.max_len}", flush=True)
  try:
    uvicorn.run(make_app(engine, tokenizer, model_name=name), host=args.host, port=args.port,
                log_level="info")
  finally:
    engine.close()
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
