"""Attention benchmarks: CPU speed and memory, ring memory flatness, causal balance, 1M tokens on TPU.

Run:  python scripts/bench_attention.py --json runs/bench_attention.json
      (--only speed,ring_memory,balance,tpu_1m picks sections; --seq-lens 2048,4096 for a quick run)

Sections of the JSON (also printed as tables):
  speed        {impl, block, seq_len, seconds, peak_bytes, temp_bytes}: causal forward+backward,
               batch 1, 8 heads, head_dim 64, fp32, of `jax.nn.dot_product_attention(
               implementation="xla")` ("reference") and meshrl's blockwise kernel at each of
               --blocks (block_q = block_kv; 512 is the default). seconds = best of --repeats runs
               after a warm-up; peak_bytes = argument + output + temp - aliased bytes of the compiled
               program (the four 16 MiB inputs and outputs at 8192 are in both).
  ring_speed   {impl, seq_len, devices, block, seconds, peak_bytes, temp_bytes}: causal ring attention
               forward+backward on --ring-devices simulated CPU devices, B=1, 8 heads, head_dim 64,
               fp32, blocks of --ring-block: meshrl's ring on the zigzag layout ("meshrl") side by
               side with the Ring Attention authors' package (`pip install ringattention==0.1.2
               einops`; its pure-JAX `ring_attention`, contiguous layout, chunks of the same size,
               `float32_logits`, `nothing_saveable` remat as LWM runs it): "ringattention". Each
               in a fresh process; peak_bytes per device.
  ring_memory  {devices, tokens_per_device, temp_bytes}: ring attention forward+backward compiled for
               2, 4, 8 simulated CPU devices at a fixed number of tokens per device.
  balance      {contiguous, zigzag}: max/min over 8 devices of the unmasked causal (q, k) pairs.
  tpu_1m       {topology, seq_len, per_chip_bytes, hbm_bytes, fits, ...}: one block (attention +
               SwiGLU MLP + chunked loss, forward+backward) compiled with libtpu for a v5p topology,
               the 1M-token sequence on the ring. Needs libtpu (compile only, no TPU).
  splash_ring  {kernel, topology, tokens_per_chip, temp_bytes, collectives, seconds}: causal
               zigzag ring attention alone, forward+backward, at paper_3t's per-chip shape (64 query
               / 8 key-value heads x 128, bf16, packed segment ids) on --splash-topology with the
               sequence over all its chips: the jnp block kernel ("jnp") side by side with splash
               computing the block pairs ("splash", model/splash_ring.py). Compiled with libtpu;
               seconds (best of --repeats) only when the default backend is a TPU.

Targets: blockwise >= 5x faster and >= 50x less peak memory than reference at 8192; ring at 16384
tokens on 8 devices in <= 0.5x the package's time at no more memory; ring temp flat
within 5%; zigzag balance 1.00; the 1M-token block fits a v5p chip with >= 10% HBM to spare.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

from meshrl.configs import cli
from meshrl.configs.cli import simulate_cpu_devices
from meshrl.configs.hugepages import reexec_with_hugepages

reexec_with_hugepages()  # both sides' processes inherit it: configs/hugepages.py
simulate_cpu_devices(8)

import jax  # noqa: E402  (after the flags)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from meshrl.model import ring_attention as ra  # noqa: E402
from meshrl.rl.step.aot import topology_devices  # noqa: E402
from meshrl.sharding import make_mesh  # noqa: E402
from meshrl.sharding.mesh import EXPERT_AXIS, SEQUENCE_AXIS, axis_size  # noqa: E402
from meshrl.train.chunked_loss import chunked_cross_entropy  # noqa: E402

HEADS, HEAD_DIM = 8, 64
SECTIONS = ("speed", "ring_speed", "ring_memory", "balance", "tpu_1m", "splash_ring")
SPLASH_HEADS, SPLASH_KV_HEADS, SPLASH_HEAD_DIM = 64, 8, 128  # paper_3t's attention


def _peak_bytes(compiled):
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def _fwd_bwd(attention):
  """jit of (q, k, v, d_out) -> (out, dq, dk, dv)."""
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out,) + vjp(d_out)
  return jax.jit(run)


def _attention_fn(impl, block):
  if impl == "reference":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="xla")
  block_q, _, block_kv = str(block).partition("x")  # "512" or "512x256" (query x key/value rows)
  return lambda q, k, v: ra.attend(q, k, v, impl="blockwise", block_q=int(block_q),
                                   block_kv=int(block_kv or block_q))


def speed_case(impl, block, seq_len, repeats):
  """Times one configuration in this process; returns its row."""
  keys = jax.random.split(jax.random.key(0), 4)
  args = [jax.random.normal(key, (1, seq_len, HEADS, HEAD_DIM)) for key in keys]
  compiled = _fwd_bwd(_attention_fn(impl, block)).lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return dict(impl=impl, block=None if impl == "reference" else str(block), seq_len=seq_len,
              seconds=min(times),
              peak_bytes=_peak_bytes(compiled),
              temp_bytes=compiled.memory_analysis().temp_size_in_bytes)


def _run_case(flag, case):
  """Runs one timed case (`--speed-case` / `--ring-case` of this script) in a fresh process, so one
  case's memory does not pile onto the next; returns its JSON row."""
  result = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", os.devnull, flag, case],
                          capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{flag} {case} failed ({result.returncode}):\n{result.stderr[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def bench_speed(seq_lens, repeats, blocks):
  """Each configuration runs in a fresh process, so one program's memory (the reference at 8192
  holds ~13 GB resident) does not pile onto the next."""
  rows = []
  for seq_len in seq_lens:
    for impl, block in [("reference", "0")] + [("blockwise", b) for b in blocks]:
      row = _run_case("--speed-case", f"{impl},{block},{seq_len},{repeats}")
      print(f"  speed {impl:9s} block {block!s:>7} {seq_len:6d}: {row['seconds']:7.2f} s, "
            f"peak {row['peak_bytes'] / 2**20:8.1f} MiB", flush=True)
      rows.append(row)
  return rows


# ---------------------------------------------------------------------------------------------
# Ring speed, side by side with the Ring Attention authors' package.


def _authors_ring_attention():
  """The package's pure-JAX `ring_attention`, or None when it is not installed.

  Its `__init__` reads `jax.lib.xla_bridge`, gone from current JAX, so the module file is loaded
  directly (nothing of it is copied here).
  """
  spec = importlib.util.find_spec("ringattention")
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(spec.submodule_search_locations[0], "ringattention_jax.py")
  module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.ring_attention


class _HashableKwargs(dict):
  """The package passes its block settings as a dict through a custom_vjp's nondiff argnums."""

  def __hash__(self):
    return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


def _ring_fn(impl, mesh, seq_len, block):
  """(q, k, v) -> out over the mesh's `sequence` axis, and the layout's positions."""
  devices = axis_size(mesh, SEQUENCE_AXIS)
  if impl == "meshrl":
    positions = ra.zigzag(np.arange(seq_len, dtype=np.int32)[None], devices)
    return lambda q, k, v: ra.attend(q, k, v, impl="ring", mesh=mesh, q_positions=positions,
                                     kv_positions=positions, block_q=block, block_kv=block)
  ring_attention = _authors_ring_attention()
  if ring_attention is None:
    raise RuntimeError("the ringattention package is not installed")
  settings = _HashableKwargs(
      causal_block_size=1, query_chunk_size=block, key_chunk_size=block, deterministic=True,
      dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32,
      policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)
  # (q, k, v, attn_bias, segment_ids, cache_idx, axis_name, float32_logits, blockwise_kwargs)
  local = lambda q, k, v: ring_attention(q, k, v, None, None, None, SEQUENCE_AXIS, True, settings)
  spec = P(None, SEQUENCE_AXIS, None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


def ring_speed_case(impl, seq_len, devices, block, repeats):
  """Times one ring configuration in this process; returns its row."""
  mesh = make_mesh(dict(data=1, fsdp=1, expert=1, sequence=devices, tensor=1),
                   devices=jax.devices()[:devices])
  sharding = NamedSharding(mesh, P(None, SEQUENCE_AXIS))
  keys = jax.random.split(jax.random.key(0), 4)
  args = [jax.device_put(jax.random.normal(key, (1, seq_len, HEADS, HEAD_DIM)), sharding)
          for key in keys]
  compiled = _fwd_bwd(_ring_fn(impl, mesh, seq_len, block)).lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return dict(impl=impl, seq_len=seq_len, devices=devices, block=block, seconds=min(times),
              peak_bytes=_peak_bytes(compiled),
              temp_bytes=compiled.memory_analysis().temp_size_in_bytes)


def bench_ring_speed(seq_lens, devices, block, repeats):
  """meshrl and the package, each in a fresh process, alternating per sequence length."""
  rows = []
  have_package = importlib.util.find_spec("ringattention") is not None
  for seq_len in seq_lens:
    for impl in ("meshrl", "ringattention"):
      if impl == "ringattention" and not have_package:
        rows.append(dict(impl=impl, seq_len=seq_len, error="not installed: pip install "
                         "ringattention==0.1.2 einops"))
        continue
      row = _run_case("--ring-case", f"{impl},{seq_len},{devices},{block},{repeats}")
      print(f"  ring_speed {impl:13s} {seq_len:6d} tokens on {devices}: {row['seconds']:7.2f} s, "
            f"peak {row['peak_bytes'] / 2**20:7.1f} MiB", flush=True)
      rows.append(row)
  return rows


def bench_ring_memory(tokens_per_device, device_counts=(2, 4, 8)):
  rows = []
  for devices in device_counts:
    mesh = make_mesh(dict(data=1, fsdp=1, expert=1, sequence=devices, tensor=1),
                     devices=jax.devices()[:devices])
    shape = jax.ShapeDtypeStruct((1, devices * tokens_per_device, HEADS, HEAD_DIM), jnp.float32)
    attention = lambda q, k, v: ra.attend(q, k, v, impl="ring", mesh=mesh)
    compiled = _fwd_bwd(attention).lower(shape, shape, shape, shape).compile()
    rows.append(dict(devices=devices, tokens_per_device=tokens_per_device,
                     temp_bytes=compiled.memory_analysis().temp_size_in_bytes))
  return rows


def bench_balance(devices=8, tokens_per_device=4096):
  """max/min over devices of unmasked causal (q, k) pairs: a query at position p sees p + 1 keys."""
  positions = np.arange(devices * tokens_per_device)
  result = {}
  for layout, arranged in (("contiguous", positions), ("zigzag", ra.zigzag(positions, devices, 0))):
    pairs = (arranged.reshape(devices, -1) + 1).sum(axis=1)
    result[layout] = float(pairs.max() / pairs.min())
  return result


# ---------------------------------------------------------------------------------------------
# 1M tokens on a TPU topology (compile only).

# A stand-in for one block of a large MoE model (Qwen3-235B-A22B-like attention; the SwiGLU width is
# that of its 8 active experts, 8 x 1536). Swap in the real block by adding a builder to BLOCKS.
TPU_DIMS = dict(embed=4096, heads=64, kv_heads=4, head_dim=128, mlp=12288, vocab=151936,
                mlp_chunk=65536, loss_chunk=16384, dtype="bfloat16")


def _rms_norm(x):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _chunked_swiglu(x, w_gate, w_up, w_down, chunk):
  """SwiGLU over token chunks with remat, so [tokens, mlp] exists one chunk at a time."""
  b, t, d = x.shape
  xs = jnp.moveaxis(x.reshape(b, chunk, t // chunk, d), 2, 0)  # [C, B, chunk, D], interleaved

  @jax.checkpoint
  def step(_, x_chunk):
    hidden = jax.nn.silu(x_chunk @ w_gate) * (x_chunk @ w_up)
    return None, hidden @ w_down

  _, out = jax.lax.scan(step, None, xs)
  return jnp.moveaxis(out, 0, 2).reshape(b, t, d)


def attention_mlp_block(dims, mesh):
  """(param shapes, loss_fn(params, x, positions, targets)) for attention + SwiGLU + chunked loss."""
  d, n, kh, h = dims["embed"], dims["heads"], dims["kv_heads"], dims["head_dim"]
  dtype = jnp.dtype(dims["dtype"])
  params = dict(wq=(d, n * h), wk=(d, kh * h), wv=(d, kh * h), wo=(n * h, d),
                w_gate=(d, dims["mlp"]), w_up=(d, dims["mlp"]), w_down=(dims["mlp"], d),
                head=(d, dims["vocab"]))
  params = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in params.items()}

  def loss_fn(params, x, positions, targets):
    b, t, _ = x.shape
    normed = _rms_norm(x)
    q = (normed @ params["wq"]).reshape(b, t, n, h)
    k = (normed @ params["wk"]).reshape(b, t, kh, h)
    v = (normed @ params["wv"]).reshape(b, t, kh, h)
    attn = ra.attend(q, k, v, impl="ring", mesh=mesh, q_positions=positions,
                     kv_positions=positions)
    x = x + attn.reshape(b, t, n * h) @ params["wo"]
    x = x + _chunked_swiglu(_rms_norm(x), params["w_gate"], params["w_up"], params["w_down"],
                            dims["mlp_chunk"])
    loss_sum, count = chunked_cross_entropy(_rms_norm(x), params["head"], targets,
                                            jnp.ones_like(targets, bool), chunk=dims["loss_chunk"])
    return loss_sum / count

  return params, loss_fn


def moe_block(dims, mesh):
  """One real meshrl MoE block (model/transformer.py `Block`: GQA with ring attention, then a routed
  MoE with expert parallelism) + chunked loss; (param shapes, loss_fn) as attention_mlp_block."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from meshrl.model.attention import KernelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.model.layers import RopeConfig  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import Block, ModelConfig  # pylint: disable=import-outside-toplevel
  dtype = jnp.dtype(dims["dtype"])
  mc = ModelConfig(
      vocab_size=dims["vocab"], num_layers=1, embed_dim=dims["embed"], num_heads=dims["heads"],
      num_kv_heads=dims["kv_heads"], head_dim=dims["head_dim"], mlp_dim=dims["mlp"],
      max_seq_len=2**21, rope=RopeConfig(head_dim=dims["head_dim"], theta=1e6),
      kernel=KernelConfig("ring", 2048, 2048, mesh), qk_norm=True, dtype=dtype, param_dtype=dtype,
      num_experts=dims["experts"], num_experts_per_tok=dims["experts_per_tok"],
      expert_mlp_dim=dims["expert_mlp"])
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Block(mc, moe=True, rngs=nnx.Rngs(0))))
  params = {"block": abstract, "head": jax.ShapeDtypeStruct((dims["embed"], dims["vocab"]), dtype)}

  def loss_fn(params, x, positions, targets):
    block = nnx.merge(graphdef, params["block"])
    x, aux, _ = jax.checkpoint(lambda x_: block(x_, positions, jnp.ones_like(positions)))(x)
    loss_sum, count = chunked_cross_entropy(_rms_norm(x), params["head"], targets,
                                            jnp.ones_like(targets, bool), chunk=dims["loss_chunk"])
    return loss_sum / count + 0.01 * aux["aux_loss"]

  return params, loss_fn


BLOCKS = {"attention_mlp": attention_mlp_block, "moe": moe_block}
MOE_DIMS = dict(experts=64, experts_per_tok=8, expert_mlp=1536)


def _hbm_bytes(devices):
  """Per-chip HBM as libtpu reports it, read from the error of a deliberately oversized program."""
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  too_big = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32, sharding=NamedSharding(mesh, P()))
  try:
    jax.jit(lambda x: x * 2).lower(too_big).compile()
  except Exception as error:  # pylint: disable=broad-except
    found = re.search(r"available HBM \(([\d.]+)G\)", str(error))
    if found:
      return int(float(found.group(1)) * 2**30)
  raise RuntimeError("could not read the chip's HBM size from libtpu")


def nnx_variable_type():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx.Variable


def bench_tpu_1m(topology, seq_len, block):
  devices = topology_devices(topology)
  expert = 8 if block == "moe" else 1
  mesh = make_mesh(dict(data=1, fsdp=1, expert=expert, sequence=len(devices) // expert, tensor=1),
                   devices=devices)
  dims = dict(TPU_DIMS, **MOE_DIMS) if block == "moe" else TPU_DIMS
  param_shapes, loss_fn = BLOCKS[block](dims, mesh)
  replicated = NamedSharding(mesh, P())
  def placed(path, s):
    names = None
    if isinstance(s, nnx_variable_type()):
      names = tuple(s.get_metadata().get("axes", ()))
    spec = P(EXPERT_AXIS) if names and names[0] == "experts" else P()
    value = s.get_value() if names is not None else s
    placed_value = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    return s.replace(placed_value) if names is not None else placed_value
  param_shapes = jax.tree_util.tree_map_with_path(
      placed, param_shapes, is_leaf=lambda s: isinstance(s, (jax.ShapeDtypeStruct, nnx_variable_type())))
  tokens = NamedSharding(mesh, P(None, SEQUENCE_AXIS))
  x = jax.ShapeDtypeStruct((1, seq_len, TPU_DIMS["embed"]), jnp.dtype(TPU_DIMS["dtype"]),
                           sharding=NamedSharding(mesh, P(None, SEQUENCE_AXIS, None)))
  ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=tokens)
  start = time.perf_counter()
  step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
  compiled = step.lower(param_shapes, x, ids, ids).compile()
  memory = compiled.memory_analysis()
  per_chip, hbm = _peak_bytes(compiled), _hbm_bytes(devices)
  hlo = compiled.as_text()
  collectives = {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
                 for op in ("collective-permute", "all-gather", "all-reduce", "all-to-all")}
  return dict(topology=topology, chips=len(devices), seq_len=seq_len, block=block,
              tokens_per_chip=seq_len // len(devices), per_chip_bytes=per_chip,
              temp_bytes=memory.temp_size_in_bytes, argument_bytes=memory.argument_size_in_bytes,
              hbm_bytes=hbm, hbm_fraction=per_chip / hbm, fits=per_chip <= 0.9 * hbm,
              compile_seconds=time.perf_counter() - start, collectives=collectives, dims=dims,
              mesh=dict(mesh.shape))


def bench_splash_ring(topology, tokens_per_chip, repeats):
  """The jnp ring and the splash ring, causal zigzag forward+backward, compiled for `topology`."""
  from meshrl.model import splash_ring  # pylint: disable=import-outside-toplevel
  devices = jax.devices() if jax.default_backend() == "tpu" else topology_devices(topology)
  shards = len(devices)
  mesh = make_mesh(dict(data=1, fsdp=1, expert=1, sequence=shards, tensor=1), devices=devices)
  seq_len = shards * tokens_per_chip
  split = NamedSharding(mesh, P(None, SEQUENCE_AXIS, None, None))
  q = jax.ShapeDtypeStruct((1, seq_len, SPLASH_HEADS, SPLASH_HEAD_DIM), jnp.bfloat16, sharding=split)
  kv = jax.ShapeDtypeStruct((1, seq_len, SPLASH_KV_HEADS, SPLASH_HEAD_DIM), jnp.bfloat16, sharding=split)
  seg = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=NamedSharding(mesh, P(None, SEQUENCE_AXIS)))
  positions = ra.zigzag(np.arange(seq_len, dtype=np.int32)[None], shards)
  rows = []
  for kernel in ("jnp", "splash"):
    def loss(q, k, v, seg, kernel=kernel):
      if kernel == "jnp":
        out = ra.attend(q, k, v, impl="ring", mesh=mesh, q_positions=positions, kv_positions=positions,
                        segment_ids=seg, block_q=2048, block_kv=1024)
      else:
        out = splash_ring.ring_splash_attend(q, k, v, seg, mesh=mesh, zigzag=True,
                                             scale=SPLASH_HEAD_DIM ** -0.5, block_q=512, block_kv=512)
      return jnp.sum(out.astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = step.lower(q, kv, kv, seg).compile()
    hlo = compiled.as_text()
    row = dict(kernel=kernel, topology=topology if jax.default_backend() != "tpu" else "this TPU",
               chips=shards, tokens_per_chip=tokens_per_chip,
               temp_bytes=compiled.memory_analysis().temp_size_in_bytes, compile_seconds=time.perf_counter() - start,
               collectives={op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
                            for op in ("collective-permute", "all-gather", "all-reduce")})
    if jax.default_backend() == "tpu":
      key = jax.random.split(jax.random.key(0), 3)
      args = [jax.device_put(jax.random.normal(k, s.shape, s.dtype), s.sharding) for k, s in zip(key, (q, kv, kv))]
      args.append(jax.device_put(jnp.ones(seg.shape, jnp.int32), seg.sharding))
      jax.block_until_ready(compiled(*args))
      times = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
      row["seconds"] = min(times)
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------------------------


def _print_report(report):
  mib = lambda b: f"{b / 2**20:9.1f} MiB"
  if "speed" in report:
    print("\nspeed: causal fwd+bwd, B=1, 8 heads, head_dim 64, fp32 (CPU); peak = arguments + "
          "outputs + temp")
    print(f"{'seq_len':>7} {'block':>7} {'ref s':>7} {'blk s':>7} {'speedup':>7} {'ref peak':>13} "
          f"{'blk peak':>13} {'peak ratio':>10} {'ref temp':>13} {'blk temp':>13} {'temp ratio':>10}")
    rows = report["speed"]
    ref = {r["seq_len"]: r for r in rows if r["impl"] == "reference"}
    for blk in (r for r in rows if r["impl"] == "blockwise"):
      r = ref[blk["seq_len"]]
      print(f"{blk['seq_len']:7d} {blk['block']:>7} {r['seconds']:7.2f} {blk['seconds']:7.2f} "
            f"{r['seconds'] / blk['seconds']:6.1f}x {mib(r['peak_bytes'])} {mib(blk['peak_bytes'])} "
            f"{r['peak_bytes'] / blk['peak_bytes']:9.1f}x {mib(r['temp_bytes'])} "
            f"{mib(blk['temp_bytes'])} {r['temp_bytes'] / blk['temp_bytes']:9.1f}x")
  if "ring_speed" in report:
    rows = report["ring_speed"]
    print("\nring_speed: causal fwd+bwd, B=1, 8 heads, head_dim 64, fp32, simulated CPU devices; "
          "peak per device")
    print(f"{'seq_len':>7} {'devices':>7} {'block':>5} {'meshrl s':>9} {'package s':>9} "
          f"{'time ratio':>10} {'meshrl peak':>13} {'package peak':>13}")
    for ours in (r for r in rows if r["impl"] == "meshrl"):
      theirs = next((r for r in rows if r["impl"] == "ringattention"
                     and r["seq_len"] == ours["seq_len"]), {})
      if "seconds" in theirs:
        print(f"{ours['seq_len']:7d} {ours['devices']:7d} {ours['block']:5d} "
              f"{ours['seconds']:9.2f} {theirs['seconds']:9.2f} "
              f"{ours['seconds'] / theirs['seconds']:10.2f} {mib(ours['peak_bytes'])} "
              f"{mib(theirs['peak_bytes'])}")
      else:
        print(f"{ours['seq_len']:7d} {ours['devices']:7d} {ours['block']:5d} "
              f"{ours['seconds']:9.2f} {'-':>9} {'-':>10} {mib(ours['peak_bytes'])} "
              f"package: {theirs.get('error', 'missing')}")
  if "ring_memory" in report:
    rows = report["ring_memory"]
    print(f"\nring_memory: fwd+bwd temp per device at {rows[0]['tokens_per_device']} tokens/device")
    for r in rows:
      print(f"  {r['devices']} devices: {mib(r['temp_bytes'])} "
            f"({r['temp_bytes'] / rows[0]['temp_bytes']:.3f} of 2 devices)")
  if "balance" in report:
    print(f"\nbalance (max/min unmasked pairs, 8 devices): contiguous "
          f"{report['balance']['contiguous']:.2f}, zigzag {report['balance']['zigzag']:.2f}")
  if "tpu_1m" in report:
    r = report["tpu_1m"]
    if "error" in r:
      print(f"\ntpu_1m: {r['error']}")
    else:
      print(f"\ntpu_1m: {r['block']} fwd+bwd, {r['seq_len']} tokens on {r['topology']} "
            f"({r['tokens_per_chip']} per chip): {r['per_chip_bytes'] / 2**30:.2f} GiB of "
            f"{r['hbm_bytes'] / 2**30:.2f} GiB HBM ({100 * r['hbm_fraction']:.1f}%), "
            f"fits with >=10% spare: {r['fits']} (compiled in {r['compile_seconds']:.0f} s); "
            f"collectives in the program: {r['collectives']}")
  if "splash_ring" in report:
    if "error" in report["splash_ring"]:
      print(f"\nsplash_ring: {report['splash_ring']['error']}")
    else:
      _print_splash_ring(report["splash_ring"])


def _print_splash_ring(rows):
  jnp_row, splash_row = rows
  print(f"\nsplash_ring: causal zigzag ring fwd+bwd alone, {SPLASH_HEADS}/{SPLASH_KV_HEADS} heads x "
        f"{SPLASH_HEAD_DIM}, bf16, {jnp_row['tokens_per_chip']} tokens per chip on {jnp_row['topology']} "
        f"({jnp_row['chips']} chips)")
  print(f"{'kernel':>7} {'temp GiB':>9} {'seconds':>8} collectives")
  for r in rows:
    seconds = f"{r['seconds']:8.3f}" if "seconds" in r else f"{'-':>8}"
    print(f"{r['kernel']:>7} {r['temp_bytes'] / 2**30:9.2f} {seconds} {r['collectives']}")
  ratio = f"temp splash/jnp {splash_row['temp_bytes'] / jnp_row['temp_bytes']:.2f}"
  if "seconds" in jnp_row:
    ratio += f", time splash/jnp {splash_row['seconds'] / jnp_row['seconds']:.2f}"
  print(f"  {ratio}")


def main(argv=None):
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
  parser.add_argument("--seq-lens", default="2048,4096,8192")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--blocks", default="512x256,512",
                      help="blockwise block sizes to time: Q or QxKV (query rows x key rows)")
  parser.add_argument("--speed-case", default="", help=argparse.SUPPRESS)  # impl,block,len,repeats
  parser.add_argument("--ring-case", default="", help=argparse.SUPPRESS)  # impl,len,dev,block,rep
  parser.add_argument("--ring-seq-lens", default="16384")
  parser.add_argument("--ring-devices", type=int, default=8)
  parser.add_argument("--ring-block", type=int, default=512)
  parser.add_argument("--ring-tokens-per-device", type=int, default=4096)
  parser.add_argument("--tpu-topology", default="v5p:4x4x4")
  parser.add_argument("--tpu-seq-len", type=int, default=1 << 20)
  parser.add_argument("--tpu-block", default="attention_mlp", choices=sorted(BLOCKS))
  parser.add_argument("--splash-topology", default="v5p:2x2x1")
  parser.add_argument("--splash-tokens-per-chip", type=int, default=16384)
  args = parser.parse_args(argv)
  if args.speed_case:  # a child process of bench_speed
    impl, block, seq_len, repeats = args.speed_case.split(",")
    print(json.dumps(speed_case(impl, block, int(seq_len), int(repeats))))
    return
  if args.ring_case:  # a child process of bench_ring_speed
    impl, seq_len, devices, block, repeats = args.ring_case.split(",")
    print(json.dumps(ring_speed_case(impl, int(seq_len), int(devices), int(block), int(repeats))))
    return
  sections = [s for s in args.only.split(",") if s]
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
  report = {}
  # Speed first: the reference at 8192 needs ~8.4 GiB, best asked for before anything else ran.
  if "speed" in sections:
    report["speed"] = bench_speed([int(s) for s in args.seq_lens.split(",")], args.repeats,
                                  [b for b in args.blocks.split(",") if b])
  if "ring_speed" in sections:
    report["ring_speed"] = bench_ring_speed([int(s) for s in args.ring_seq_lens.split(",")],
                                            args.ring_devices, args.ring_block, args.repeats)
  if "balance" in sections:
    report["balance"] = bench_balance()
  if "ring_memory" in sections:
    report["ring_memory"] = bench_ring_memory(args.ring_tokens_per_device)
  if "tpu_1m" in sections:
    try:
      import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      report["tpu_1m"] = dict(error="libtpu is not installed; skipped")
    else:
      report["tpu_1m"] = bench_tpu_1m(args.tpu_topology, args.tpu_seq_len, args.tpu_block)
  if "splash_ring" in sections:
    try:
      import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      report["splash_ring"] = dict(error="libtpu is not installed; skipped")
    else:
      report["splash_ring"] = bench_splash_ring(args.splash_topology, args.splash_tokens_per_chip,
                                                args.repeats)
  report["versions"] = dict(jax=jax.__version__, python=sys.version.split()[0])
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2)
  _print_report(report)


if __name__ == "__main__":
  main()
