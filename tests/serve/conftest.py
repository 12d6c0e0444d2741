"""One tiny dense model and one started engine for all serving tests (its programs compile once)."""

import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.serve.engine import Engine, EngineSpec

MAX_LEN = 64
SMALL = ["model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64", f"model.max_seq_len={MAX_LEN}",
         "model.init_std=0.5"]


@pytest.fixture(scope="session")
def tiny_served():
  """(cfg, model, engine): 3 slots, chunks of 4 tokens, a prefix cache of 8-token blocks."""
  cfg = configs.load("configs/tiny.py:dense", SMALL + ["rl.max_prompt_len=40", "rl.max_new_tokens=12"])
  model = build_model(ModelConfig.from_config(cfg, None), None, seed=3)
  tok = ByteTokenizer()
  engine = Engine(model, EngineSpec(slots=3, max_len=MAX_LEN, chunk=4, prefix_block=8,
                                    prefix_cache_bytes=1 << 20), stop_ids=tok.stop_ids, pad_id=tok.pad_id)
  engine.start()
  yield cfg, model, engine
  engine.close()
