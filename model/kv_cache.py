"""The key/value cache for generation: prefill a whole prompt, then decode one token at a time.

Layout (one cache for the whole model; each layer stack's entries are stacked on a leading L axis so
the scanned blocks read and write their slice):
  layers[stack][name]   [L, B, S, ...]  per-token entries ("k"/"v" for GQA [.., K, H]; "latent" [.., R]
                        and "k_rope" [.., H_rope] for MLA), logical axes
                        (layers, batch, cache_length, kv_heads, head_dim)
  layers[stack][name + "_scale"]  [L, B, S, ...]  only in an int8 cache (`init_cache(dtype="int8")`):
                        the entry is int8 and this its bfloat16 scale per token and kv head ([.., K]
                        for "k"/"v"; one per token, [L, B, S], for MLA's entries): value ~= int8 * scale
                        (model/quant.py). `write_layer` quantises, `read_entry` dequantises; copying,
                        repeating and re-indexing rows treat scales as entries.
  positions             [B, S] int32    position of each slot; EMPTY_POSITION where nothing was written,
                        so the causal test q_pos >= kv_pos masks empty slots out
  segment_ids           [B, S] int32    segment of each slot (-1 where empty)
  index                 []     int32    next slot to write, the same for every row (left-padded prompts,
                        static batch), or
                        [B]    int32    each row's own next slot (continuous batching: rows are decode
                        slots at different steps; `with_row_index` switches a cache to it)

Per-layer form (`unstack`, the decode loops' CPU path): layers[stack] is a tuple with one dict per
layer, and the entries with a kv-heads axis are stored in the layouts the attention's batched dots
read (PER_LAYER_ORDER): keys [B, K, H, S], values [B, K, S, H], their int8 scales [B, K, S]. Stored
token-major, every decode step copied each layer's keys and values into those layouts (the test
tests/model/test_transformer.py::test_decode_step_reads_the_per_layer_cache_without_copying_it
finds the copies in the compiled step; scripts/bench_rollout.py --sections cache_layout times the
rollout both ways). `read_entry` gives them back token-major as a transposed view, which XLA folds
into the dots, so the kernels see one layout. MLA's entries have no heads axis and keep theirs.

Axis legend: L layers, B batch, S cache length, K kv heads, H head dim, R latent rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.model import quant

EMPTY_POSITION = 2 ** 30
EMPTY_SEGMENT = -1

CACHE_AXES = {
    "k": ("layers", "batch", "cache_length", "kv_heads", "head_dim"),
    "v": ("layers", "batch", "cache_length", "kv_heads", "head_dim"),
    "latent": ("layers", "batch", "cache_length", None),
    "k_rope": ("layers", "batch", "cache_length", None),
    "k_scale": ("layers", "batch", "cache_length", "kv_heads"),
    "v_scale": ("layers", "batch", "cache_length", "kv_heads"),
    "latent_scale": ("layers", "batch", "cache_length"),
    "k_rope_scale": ("layers", "batch", "cache_length"),
}
# Per-layer form: each entry's axes, as a permutation of its token-major [B, S, K, ...] axes.
PER_LAYER_ORDER = {"k": (0, 2, 3, 1), "v": (0, 2, 1, 3), "k_scale": (0, 2, 1), "v_scale": (0, 2, 1)}
SCALE_SUFFIX = "_scale"
SCALE_DTYPE = jnp.bfloat16


@struct.dataclass
class KVCache:
  layers: dict  # {stack: {entry: [L, B, S, ...]}}
  positions: jax.Array  # [B, S] int32
  segment_ids: jax.Array  # [B, S] int32
  index: jax.Array  # [] or [B] int32

  @property
  def max_len(self) -> int:
    return self.positions.shape[1]


@struct.dataclass
class CacheMeta:
  """What one layer call needs besides its own entries: slot index, every slot's position/segment,
  and whether the layer's entries are in the per-layer form (their layouts: PER_LAYER_ORDER)."""
  index: jax.Array  # [] or [B] int32
  positions: jax.Array  # [B, S]
  segment_ids: jax.Array  # [B, S]
  per_layer: bool = struct.field(pytree_node=False, default=False)

  @property
  def length(self) -> int:
    """S, the cache's slots."""
    return self.positions.shape[1]


def init_cache(entry_shapes: dict[str, dict[str, tuple[int, ...]]], batch: int, max_len: int,
               dtype=jnp.float32) -> KVCache:
  """An empty cache. entry_shapes: {stack: {entry: (num_layers, *per-token feature shape)}}.

  dtype: the entries' dtype, or "int8": int8 entries with a SCALE_DTYPE scale per token over the
  last feature axis (per kv head for "k"/"v"), stored as entry name + SCALE_SUFFIX.
  """
  int8 = isinstance(dtype, str) and dtype == "int8"
  layers = {}
  for stack, entries in entry_shapes.items():
    layers[stack] = {}
    for name, shape in entries.items():
      full = (shape[0], batch, max_len) + tuple(shape[1:])
      layers[stack][name] = jnp.zeros(full, jnp.int8 if int8 else dtype)
      if int8:
        layers[stack][name + SCALE_SUFFIX] = jnp.zeros(full[:-1], SCALE_DTYPE)
  return KVCache(layers=layers,
                 positions=jnp.full((batch, max_len), EMPTY_POSITION, jnp.int32),
                 segment_ids=jnp.full((batch, max_len), EMPTY_SEGMENT, jnp.int32),
                 index=jnp.zeros((), jnp.int32))


def begin_write(cache: KVCache, positions: jax.Array, segment_ids: jax.Array):
  """Records the positions/segments of T new tokens [B, T]; returns (cache, meta for the layers)."""
  length = positions.shape[1]
  if length > cache.max_len:
    raise ValueError(f"writing {length} tokens into a KV cache of {cache.max_len} slots.")
  new_positions = _write_rows(cache.positions, positions.astype(jnp.int32), cache.index)
  new_segments = _write_rows(cache.segment_ids, segment_ids.astype(jnp.int32), cache.index)
  meta = CacheMeta(index=cache.index, positions=new_positions, segment_ids=new_segments,
                   per_layer=is_unstacked(cache))
  return cache.replace(positions=new_positions, segment_ids=new_segments), meta


def end_write(cache: KVCache, layers: dict, length: int) -> KVCache:
  """Stores the layers' updated entries and advances the write index by `length` tokens."""
  return cache.replace(layers=layers, index=cache.index + length)


def _write_rows(target: jax.Array, value: jax.Array, index: jax.Array, axis: int = 1) -> jax.Array:
  """target [B, ..., S, ...] (S at `axis`) with value [B, ..., T, ...] written at slot `index` ([] for
  all rows, or [B]).

  A write that would run past the end is moved back to end at S (dynamic_update_slice's clamping);
  the engine only lets that happen to rows whose contents are dead (a finished slot awaiting refill).
  Per-row indices write by a scatter (vmapped dynamic_update_slice) that updates `target` in place,
  decode steps (T = 1) included: a select over the S columns read and wrote the whole cache per step,
  and XLA:CPU recomputed a key's RoPE for each of its columns; 0.90-0.92x the decode forward's time
  (docs/benchmarks.md "The multi-turn agent demo"). The scatter keeps the cache's sharding (the same
  collectives as the select over data, fsdp, tensor, expert and sequence axes).
  """
  value = value.astype(target.dtype)
  at = lambda i, ndim, where: tuple(i if d == where else 0 for d in range(ndim))  # noqa: E731
  if index.ndim == 0:
    return jax.lax.dynamic_update_slice(target, value, at(index, target.ndim, axis))
  row = lambda t, v, i: jax.lax.dynamic_update_slice(t, v, at(i, t.ndim, axis - 1))  # noqa: E731
  return jax.vmap(row)(target, value, index)


def _order(name: str, per_layer: bool) -> tuple | None:
  """The per-layer form's permutation of entry `name`'s token-major axes, or None: stored as is."""
  return PER_LAYER_ORDER.get(name) if per_layer else None


def _inverse(order: tuple) -> tuple:
  return tuple(sorted(range(len(order)), key=order.__getitem__))


def entry_axes(name: str, per_layer: bool = False) -> tuple:
  """The logical axes of one layer's entry `name` (kv_cache.CACHE_AXES without the layers axis,
  permuted to the per-layer form's layout when `per_layer`)."""
  axes, order = CACHE_AXES[name][1:], _order(name, per_layer)
  return axes if order is None else tuple(axes[i] for i in order)


def write_layer(layer_cache: dict, new_entries: dict, index: jax.Array, per_layer: bool = False) -> dict:
  """Writes new entries {name: [B, T, ...]} at slot `index` ([] or per-row [B]) of one layer's cache
  {name: [B, S, ...]}; an int8 entry (one with a scale) is quantised per token over its last axis.
  per_layer: the layer's entries are in the per-layer form (PER_LAYER_ORDER; CacheMeta.per_layer)."""
  def write(name, value):
    order = _order(name, per_layer)
    if order is None:
      return _write_rows(layer_cache[name], value, index)
    return _write_rows(layer_cache[name], value.transpose(order), index, axis=order.index(1))

  updated = dict(layer_cache)
  for name, value in new_entries.items():
    scale_name = name + SCALE_SUFFIX
    if scale_name in layer_cache:
      q = quant.absmax_quantize(value, axis=-1, scale_dtype=layer_cache[scale_name].dtype)
      updated[scale_name] = write(scale_name, q.scale[..., 0])
      value = q.values
    updated[name] = write(name, value)
  return updated


def read_entry(layer_cache: dict, name: str, dtype, per_layer: bool = False) -> jax.Array:
  """One layer's entry [B, S, ...] in `dtype`, dequantised when the cache is int8. An entry in the
  per-layer form's layout (`per_layer`) comes back token-major as a transposed view, which XLA folds
  into the attention's dots."""
  def token_major(entry_name):
    order = _order(entry_name, per_layer)
    entry = layer_cache[entry_name]
    return entry if order is None else entry.transpose(_inverse(order))
  scale_name = name + SCALE_SUFFIX
  if scale_name not in layer_cache:
    return token_major(name).astype(dtype)
  return quant.dequantize(quant.QuantizedArray(token_major(name), token_major(scale_name)[..., None]), dtype)


def unstack(cache: KVCache) -> KVCache:
  """The same cache in the per-layer form: layers {stack: ({entry: [B, S, ...]}, one dict per layer)}
  with the kv-heads entries laid out by PER_LAYER_ORDER, for a model called with `layer_weights=`
  (unrolled layers). A copy of the entries; `stack` undoes it."""
  def layers(entries):
    num = next(iter(entries.values())).shape[0]
    return tuple({name: a[i] if _order(name, True) is None else a[i].transpose(_order(name, True))
                  for name, a in entries.items()} for i in range(num))
  return cache.replace(layers={name: layers(entries) for name, entries in cache.layers.items()})


def stack(cache: KVCache) -> KVCache:
  """The inverse of `unstack`: entries [L, B, S, ...] again."""
  def stacked(name, per_layer):
    order = _order(name, True)
    return jnp.stack([a if order is None else a.transpose(_inverse(order)) for a in per_layer])
  return cache.replace(layers={stack_name: {name: stacked(name, [layer[name] for layer in layers])
                                            for name in layers[0]}
                               for stack_name, layers in cache.layers.items()})


def is_unstacked(cache: KVCache) -> bool:
  """Whether `cache` holds per-layer entries (`unstack`)."""
  return any(isinstance(layers, tuple) for layers in cache.layers.values())


def with_row_index(cache: KVCache) -> KVCache:
  """The same cache with a per-row write index [B] (each row may then advance on its own)."""
  batch = cache.positions.shape[0]
  return cache.replace(index=jnp.broadcast_to(cache.index, (batch,)).astype(jnp.int32))


def copy_rows(dst: KVCache, src: KVCache, src_rows: jax.Array, take: jax.Array) -> KVCache:
  """dst with each row j where take[j] replaced, whole, by src row src_rows[j] (entries, positions,
  segments and write index), so nothing of the row's previous occupant survives.

  dst has a per-row index [B_dst] and the same length as src (both stacked, or both `unstack`ed);
  src_rows/take are [B_dst].
  """
  if src.max_len != dst.max_len:
    raise ValueError(f"copy_rows: source cache of {src.max_len} slots, destination {dst.max_len}.")
  per_layer = is_unstacked(dst)
  if is_unstacked(src) != per_layer:
    raise ValueError("copy_rows: one cache is per layer (kv_cache.unstack) and the other is not.")
  batch_axis = 0 if per_layer else 1
  rows = jnp.clip(src_rows, 0, src.positions.shape[0] - 1)

  def pick(d, s, axis):
    chosen = jnp.take(s, rows, axis=axis)
    mask = take.reshape((1,) * axis + (-1,) + (1,) * (d.ndim - axis - 1))
    return jnp.where(mask, chosen.astype(d.dtype), d)
  src_index = jnp.broadcast_to(src.index, (src.positions.shape[0],))
  return dst.replace(layers=jax.tree.map(lambda d, s: pick(d, s, batch_axis), dst.layers, src.layers),
                     positions=pick(dst.positions, src.positions, 0),
                     segment_ids=pick(dst.segment_ids, src.segment_ids, 0),
                     index=pick(dst.index, src_index, 0))


def repeat_rows(cache: KVCache, times: int) -> KVCache:
  """Each batch row repeated `times` times (row b -> rows b*times .. b*times+times-1).

  Used to share one prefilled prompt across a GRPO group of samples.
  """
  layers = jax.tree.map(lambda a: jnp.repeat(a, times, axis=1), cache.layers)
  return cache.replace(layers=layers, positions=jnp.repeat(cache.positions, times, axis=0),
                       segment_ids=jnp.repeat(cache.segment_ids, times, axis=0))


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
  """Rows `rows` [R] (in range) of a cache with a per-row index, as a cache of R rows (a copy)."""
  batch_axis = 0 if is_unstacked(cache) else 1
  return cache.replace(layers=jax.tree.map(lambda a: jnp.take(a, rows, axis=batch_axis), cache.layers),
                       positions=cache.positions[rows], segment_ids=cache.segment_ids[rows],
                       index=cache.index[rows])


def put_rows(cache: KVCache, rows: jax.Array, sub: KVCache) -> KVCache:
  """`cache` with rows `rows` [R] replaced by the R rows of `sub` (same form and length); a row
  index out of range (>= B) is dropped."""
  batch_axis = 0 if is_unstacked(cache) else 1

  def put(a, b):
    index = (slice(None),) * batch_axis + (rows,)
    return a.at[index].set(b.astype(a.dtype), mode="drop")
  return cache.replace(layers=jax.tree.map(put, cache.layers, sub.layers),
                       positions=cache.positions.at[rows].set(sub.positions, mode="drop"),
                       segment_ids=cache.segment_ids.at[rows].set(sub.segment_ids, mode="drop"),
                       index=cache.index.at[rows].set(sub.index, mode="drop"))
