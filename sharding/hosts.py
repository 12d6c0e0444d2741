"""Several host processes, one program: joining the job, and moving host data between processes.

A pod runs one process per host (TPU VM worker); every process runs the same Python program and
the jitted steps span all devices of all processes. How meshrl's RL loop splits the host work:

  prompts   each host draws its own block of the step's prompts from its own shard of the data
            (rl/envs/prompts.py), and the rollout gets them as one global array built from each host's
            own rows (`global_rows`), so no host holds another's prompts (gathered in host order
            instead, `gather_rows`, when the mesh does not put each host's block on its devices);
  rollout   the per-token outputs [B, S] stay on the devices (rl/batches/rows.py: the host moves rows, and
            pulls their response columns for scoring), as do the MoE routes of routing replay
            ([B, L, S, K], rl/batches/routes.py); per-sample outputs ([B]) come to every host (`to_host`);
  scoring   each host scores only its own block of groups (`own_block`) with its own examples and
            reward workers; rewards, texts and domains are gathered (`gather_rows`,
            `gather_objects`), so every host then makes the same decisions (dynamic sampling, packing)
            on the same global batch and the update's inputs are equal everywhere; a reward model's
            or judge's calls span the mesh, each host filling its own rows of every call with its own
            samples (`calls_over_hosts`, `global_rows`) and reading back only those (`share_to_host`);
  shared    partial rollouts (rl/step/partial.PartialRollouts: the groups that end in a step are not one
            block per host), and prompts that do not split evenly over the hosts (more hosts than
            prompts; rl/step/groups.shared_prompts): every host draws the same prompts (the whole stream,
            not a shard) and holds every group's example; each scores its `share` of the groups (as
            even as their count allows), and the uneven shares are gathered (`gather_rows`);
  episodes  multi-turn (rl/step/episodes.py): each host resets and steps the environments of its own
            block of episodes (its `share`), encodes their prompts (`global_rows`, unless the
            prompts are shared) and reads only those rows' turns (`share_to_host`); the results are
            gathered after every turn (`gather_objects`) and the episodes are written on the devices;
  outputs   metrics files, evaluations and the config are written by process 0 only
            (`is_primary`); orbax checkpoints are written by all processes together.

With one process every function here is the identity (or a plain `np.asarray`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

COORDINATOR_ENV = "MESHRL_COORDINATOR"  # host:port of process 0's coordinator
NUM_PROCESSES_ENV = "MESHRL_NUM_PROCESSES"
PROCESS_ID_ENV = "MESHRL_PROCESS_ID"
TPU_POD_ENV = "MESHRL_TPU_POD"  # "1": a Cloud TPU pod slice (scripts/launch_tpu_pod.sh sets it)


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
  """Joins a multi-process job (`jax.distributed.initialize`) when one is described; returns whether
  it did. Call it before anything touches a device.

  The job is described by the arguments, else by the environment (MESHRL_COORDINATOR,
  MESHRL_NUM_PROCESSES, MESHRL_PROCESS_ID); on a Cloud TPU pod slice (MESHRL_TPU_POD=1, as
  scripts/launch_tpu_pod.sh sets) jax finds all three itself. (TPU_WORKER_HOSTNAMES is no signal:
  libtpu fills it with a warning text on machines that are not TPU VMs.) CPU processes talk through
  gloo.

  Raises:
    ValueError: a coordinator without the process count and id (or ids out of range), or a process
      count or id without a coordinator (each process would otherwise run the whole job alone).
  """
  coordinator = coordinator or os.environ.get(COORDINATOR_ENV, "")
  num_processes = num_processes or int(os.environ.get(NUM_PROCESSES_ENV, "0") or 0)
  if process_id < 0:
    process_id = int(os.environ.get(PROCESS_ID_ENV, "-1") or -1)
  if coordinator:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"a multi-process job at coordinator {coordinator!r} needs the number of "
                       f"processes (>= 1, got {num_processes}) and this process's id in "
                       f"0..{max(num_processes - 1, 0)} (got {process_id}).")
    if num_processes == 1:
      return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; TPUs use ICI/DCN
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True
  if os.environ.get(TPU_POD_ENV) == "1":
    jax.distributed.initialize()  # a TPU pod slice: coordinator and ids come from the TPU metadata
    return True
  if num_processes > 1 or process_id > 0:  # a job described without its coordinator: run alone? no
    raise ValueError(f"--num_processes={num_processes} / --process_id={process_id} describe a "
                     "multi-process job but no coordinator was given: add --coordinator=HOST:PORT (or "
                     f"{COORDINATOR_ENV}); on a Cloud TPU pod slice use scripts/launch_tpu_pod.sh.")
  return False


def is_multihost() -> bool:
  return jax.process_count() > 1


def is_primary() -> bool:
  """Whether this process writes the run's files (metrics, evaluations, config): process 0."""
  return jax.process_index() == 0


def to_host(x: Any) -> np.ndarray | None:
  """A jax array's whole value as numpy on this host (None stays None).

  An array sharded over several processes is all-gathered; one that lives on this process's devices
  (or is replicated) is read directly."""
  if x is None or isinstance(x, np.ndarray):
    return x
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.is_fully_replicated:  # every process holds all of it (np.asarray refuses a global array)
      return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def own_block(total: int) -> slice:
  """This process's block of `total` rows (equal blocks in process order).

  Raises ValueError when `total` does not split evenly over the processes."""
  count, index = jax.process_count(), jax.process_index()
  if total % count:
    raise ValueError(f"{total} rows do not split evenly over {count} host processes.")
  size = total // count
  return slice(index * size, (index + 1) * size)


def share(total: int) -> slice:
  """This process's share of `total` items that every host holds: contiguous, in process order, as
  even as the count allows (host h of n: [h * total // n, (h + 1) * total // n); some may be empty)."""
  return share_of(total, jax.process_index(), jax.process_count())


def share_of(total: int, index: int, count: int) -> slice:
  """Process `index`'s `share` of `total` items among `count` processes."""
  return slice(index * total // count, (index + 1) * total // count)


def share_to_host(x: Any) -> np.ndarray:
  """This process's `share` of the rows of a [B, ...] array, as numpy (numpy input: sliced).

  Read from this process's own shards when every process's devices hold its own share (whole
  columns; a replicated array qualifies), so no host receives another's rows; else every row is
  gathered (`to_host`, collective) and sliced. The choice is made from the sharding alone, so every
  process takes the same branch."""
  rows = share(x.shape[0])
  if isinstance(x, np.ndarray) or not is_multihost() or x.is_fully_addressable:
    return np.asarray(x[rows])
  if not all(_holds_rows(x.sharding, x.shape, process, share_of(x.shape[0], process, jax.process_count()))
             for process in range(jax.process_count())):
    return to_host(x)[rows]
  pieces = {}
  for shard in x.addressable_shards:
    start, stop = shard.index[0].indices(x.shape[0])[:2]
    if start < rows.stop and stop > rows.start:
      pieces[start] = (stop, shard.data)
  out, at = [], rows.start
  for start in sorted(pieces):
    stop, data = pieces[start]
    if stop > at:
      out.append(np.asarray(data)[max(at, start) - start:min(stop, rows.stop) - start])
      at = min(stop, rows.stop)
  return np.concatenate(out) if out else np.zeros((0,) + x.shape[1:], x.dtype)


def _holds_rows(sharding, shape: tuple[int, ...], process: int, rows: slice) -> bool:
  """Whether `process`'s devices hold every row of `rows` (contiguously, whole columns) under
  `sharding`."""
  if rows.start == rows.stop:
    return True
  ranges, columns_whole = _row_ranges(sharding, shape, process)
  at = rows.start
  for start, stop in ranges:
    if start <= at < stop:
      at = stop
  return columns_whole and at >= rows.stop


def gather_rows(local: np.ndarray) -> np.ndarray:
  """Every process's `local` rows ([n_p, ...]; the trailing shape the same on every host, the row
  count n_p may differ) concatenated in process order -> [sum_p n_p, ...]; the identity with one
  process. Collective: every process calls it at the same point."""
  return _gather_counted(np.asarray(local))[0]


def global_rows(local: np.ndarray, sharding: NamedSharding | None) -> np.ndarray | jax.Array:
  """Every process's own block of rows (`own_block`: [n, ...] on each host, in process order) as one
  global [processes * n, ...] array split by rows as `sharding` says, built from each host's own rows
  (`jax.make_array_from_process_local_data`): no host holds another's. Collective.

  With one process: `local` itself. When `sharding` (None: no mesh) does not put exactly this host's
  own block of rows on its devices (rows replicated across hosts, split in another order, or not
  divisible), every host's rows are gathered instead (`gather_rows`) and the numpy array returned is
  the same on every host."""
  local = np.asarray(local)
  if not is_multihost():
    return local
  shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  if sharding is not None and _holds_own_block(sharding, shape):
    return jax.make_array_from_process_local_data(sharding, local, shape)
  return gather_rows(local)


def calls_over_hosts(count: int, rows: int) -> tuple[int, int]:
  """Batched device calls of `rows` global rows each, every host filling its own block of each call
  with its own `count` items (the counts may differ by host) -> (rows per call from this host,
  rows // processes; the number of calls, enough for the host with the most items, the same on
  every host). Collective with several processes (the counts are gathered); ValueError when `rows`
  does not split over the processes."""
  processes = jax.process_count()
  if rows < 1 or rows % processes:
    raise ValueError(f"{rows} rows per call do not split over {processes} host processes.")
  per_host = rows // processes
  most = int(gather_rows(np.asarray([count], np.int64)).max()) if is_multihost() else count
  return per_host, -(-most // per_host)


def _holds_own_block(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
  """Whether this process's devices hold exactly rows `own_block(shape[0])`, every column, under
  `sharding` (and it divides the shape)."""
  try:
    sharding.shard_shape(shape)
  except ValueError:
    return False
  mine = own_block(shape[0])
  ranges, columns_whole = _row_ranges(sharding, shape, jax.process_index())
  contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
  return columns_whole and contiguous and ranges[0][0] == mine.start and ranges[-1][1] == mine.stop


def _row_ranges(sharding, shape: tuple[int, ...], process: int) -> tuple[list[tuple[int, int]], bool]:
  """The distinct [start, stop) row ranges `process`'s devices hold under `sharding`, sorted, and
  whether each of them holds every column."""
  here = [index for device, index in sharding.devices_indices_map(shape).items()
          if device.process_index == process]
  columns_whole = all(i.indices(n)[:2] == (0, n) for index in here for i, n in zip(index[1:], shape[1:]))
  return sorted({index[0].indices(shape[0])[:2] for index in here}), columns_whole


def _gather_counted(local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`gather_rows`'s result and every process's row count n_p ([processes] int64)."""
  if not is_multihost():
    return local, np.asarray([local.shape[0]], np.int64)
  if local.dtype == np.bool_:
    rows, sizes = _gather_counted(local.astype(np.uint8))
    return rows.astype(bool), sizes
  sizes = _allgather(np.asarray([local.shape[0]], np.int64)).reshape(-1)
  most = int(sizes.max())
  if (sizes == most).all():
    return _allgather(local), sizes
  padded = np.zeros((most,) + local.shape[1:], local.dtype)
  padded[:local.shape[0]] = local
  rows = _allgather(padded).reshape((len(sizes), most) + local.shape[1:])
  return np.concatenate([block[:int(size)] for block, size in zip(rows, sizes)]), sizes


def _allgather(local: np.ndarray) -> np.ndarray:
  """Equal-shaped [n, ...] arrays of every process -> [processes * n, ...], in process order."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def gather_objects(local: Sequence[Any]) -> list:
  """Every process's list of JSON values (texts, domains, counts), concatenated in process order."""
  if not is_multihost():
    return list(local)
  payload = np.frombuffer(json.dumps(list(local), default=_plain).encode("utf-8"), np.uint8)
  payloads, sizes = _gather_counted(payload)
  out = []
  for row in np.split(payloads, np.cumsum(sizes)[:-1]):
    out += json.loads(bytes(row).decode("utf-8"))
  return out


def _plain(value: Any):
  """JSON for numpy values (scalars and arrays) inside gathered objects."""
  if hasattr(value, "tolist"):
    return value.tolist()
  raise TypeError(f"cannot send a {type(value).__name__} between host processes (not JSON).")
