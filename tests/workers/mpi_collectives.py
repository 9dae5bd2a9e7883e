"""Worker for tests/test_mpi.py, run by ``mpirun -n P``: jaxring's collectives over MPI.

Every rank binds the axis "data" to MPI.COMM_WORLD (with ``--topology 2x2``: levels local=2 and
node=2 split row-major, so that hierarchical has two levels on one host), then for each algorithm
and codec jits one function computing psum of a pytree, psum_scatter and all_gather, and calls it
``--calls`` times on fresh inputs. Member ``m``'s inputs are drawn from ``default_rng((seed, call,
m))``, so each rank computes the float64 NumPy reference of all members by itself. Lossless results
must equal it exactly (integer-valued inputs) or within f32 rounding (random f32); lossy ones within
the codec's bound (tests/test_codecs.py): at most ``P + 1`` encodes of a partial sum, each
erring by at most ``u * max|partial|`` over the codec's block, ``u`` = 2**-8 (bf16), 2**-11 (fp16),
1/254 (int8). Prints ``rank R: OK <config> calls=N``; exits 3 at the first mismatch.

With ``--die-rank R --die-at CALL`` rank R calls ``os._exit(9)`` in the middle of the run; with
``--die-how stuck`` it sleeps there instead (alive, its watchdog thread heartbeating, never
launching the call).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

CODECS = ("none", "bf16", "fp16", "int8", "topk")
UNIT = {"none": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "int8": 1 / 254, "topk": 0.0}
BLOCK = {"int8": 256}
TOPK_CHUNK, TOPK_DENSITY = 64, 0.05


def codec_of(name):
  from jaxring import codecs
  return {"none": None, "bf16": codecs.bf16(), "fp16": codecs.fp16(), "int8": codecs.int8(),
          "topk": codecs.topk_chunks(TOPK_DENSITY, chunk_size=TOPK_CHUNK)}[name]


def inputs(seed: int, call: int, member: int, p: int, codec: str) -> dict:
  """One member's pytree; leaves of odd lengths, fused by dtype into one buffer each."""
  rng = np.random.default_rng((seed, call, member))
  n = 4099
  if codec == "topk":  # distinct chunk magnitudes: the f32 and float64 rankings cannot differ
    nc = -(-n // TOPK_CHUNK)
    mags = np.repeat(np.random.default_rng((seed, call, 10 ** 6)).permutation(nc) + 1.0,
                     TOPK_CHUNK)[:n]
    return {"x": (rng.standard_normal(n) * mags).astype(np.float32),
            "i": rng.integers(-1000, 1000, 13).astype(np.int32)}
  return {"x": rng.standard_normal(n).astype(np.float32),
          "y": rng.standard_normal(1).astype(np.float32),
          "k": rng.integers(-16, 17, (3, 37)).astype(np.float32),
          "h": rng.integers(-16, 17, 301).astype(np.float32),   # passed as bf16: exact values
          "i": rng.integers(-1000, 1000, 13).astype(np.int32),
          "b": rng.integers(0, 2, 5).astype(bool),
          "rs": rng.integers(-16, 17, (2 * p, 5)).astype(np.float32),   # psum_scatter operand
          "ag": rng.integers(-16, 17, 37).astype(np.float32)}           # all_gather operand


def bound(parts: np.ndarray, codec: str, p: int) -> np.ndarray:
  """Per element: (p + 1) encodes, each within u * max over its block of the sum of |x|."""
  absum = np.abs(parts).sum(0).reshape(-1)
  block = BLOCK.get(codec, 1)
  if block > 1:
    pad = np.pad(absum, (0, -absum.size % block)).reshape(-1, block).max(1)
    absum = np.repeat(pad, block)[:absum.size]
  return ((p + 1) * UNIT[codec] * absum * 1.001).reshape(parts.shape[1:])


def topk_reference(parts: np.ndarray) -> np.ndarray:
  x = parts.astype(np.float64)
  n = x.shape[1]
  nc = -(-n // TOPK_CHUNK)
  xs = np.pad(x, ((0, 0), (0, nc * TOPK_CHUNK - n))).reshape(x.shape[0], nc, TOPK_CHUNK)
  score = np.sqrt((xs ** 2).sum(2)).sum(0)
  k = max(1, int(np.ceil(TOPK_DENSITY * nc - 1e-9)))
  chosen = np.sort(np.argsort(-score, kind="stable")[:k])
  want = np.zeros((nc, TOPK_CHUNK))
  want[chosen] = xs[:, chosen].sum(0)
  return want.reshape(-1)[:n]


def say(line: str, stream=sys.stdout) -> None:
  stream.write(line + "\n")   # one write: mpirun interleaves the ranks' writes
  stream.flush()


class Mismatch(AssertionError):
  pass


def check(name: str, got, want, tol) -> None:
  got = np.asarray(got, np.float64)
  err = np.abs(got - want)
  if got.shape != want.shape or not (err <= tol).all():
    i = np.unravel_index(int(np.argmax(err - tol)), err.shape) if got.shape == want.shape else ()
    raise Mismatch(f"{name}: shape {got.shape} vs {want.shape}; worst at {i}: got "
                   f"{got[i] if i else got!r}, want {want[i] if i else want!r}")


def verify(out, every: list[dict], rank: int, p: int, codec: str) -> None:
  import jax.numpy as jnp
  tree, rs, ag = out
  parts = {k: np.stack([m[k] for m in every]).astype(np.float64) for k in every[0]}
  want = {k: v.sum(0) for k, v in parts.items()}
  if codec == "topk":
    check("psum x", tree["x"], topk_reference(parts["x"]),
          1e-6 * np.abs(parts["x"]).sum(0).max() + 1e-5)
  else:
    # the f32 leaves travel as one buffer (tree order: k, x, y), and int8 blocks span leaves
    f32 = ("k", "x", "y")
    fused = np.concatenate([parts[k].reshape(p, -1) for k in f32], axis=1)
    tol = bound(fused, codec, p)
    # random f32 (x, y): f32 partial sums, at most p roundings of at most sum |x| each
    tol = tol + p * np.finfo(np.float32).eps * np.abs(fused).sum(0)
    exact = codec in ("none", "bf16", "fp16")   # sums of small integers: exact in 16-bit floats
    offset = 0
    for k in f32:
      size = want[k].size
      t = tol[offset:offset + size].reshape(want[k].shape)
      check(f"psum {k}", tree[k], want[k], 0 if exact and k == "k" else t)
      offset += size
    check("psum h", tree["h"], want["h"], 0 if exact else bound(parts["h"], codec, p))
    assert tree["h"].dtype == jnp.bfloat16 and tree["b"].dtype == jnp.int32
    check("psum b", tree["b"], want["b"], 0)
    blocks = np.split(want["rs"], p)   # tiled: member r gets rows [2r, 2r + 2)
    check("psum_scatter", rs, blocks[rank], 0 if exact else bound(
        np.split(parts["rs"], p, axis=1)[rank], codec, p))
    check("all_gather", ag, parts["ag"], 0 if exact else bound(parts["ag"][None], codec, p))
  check("psum i", tree["i"], want["i"], 0)
  assert tree["i"].dtype == jnp.int32


def run_config(comm, algorithm: str, codec: str, args) -> float:
  import jax
  import jax.numpy as jnp
  import jaxring

  rank, p = comm.Get_rank(), comm.Get_size()
  comp = codec_of(codec)
  if algorithm == "hierarchical" and comp is not None and args.topology:
    comp = {"node": comp}   # BlueConnect's use: compress the slow level only

  def body(tree):
    kw = dict(algorithm=algorithm, compression=comp)
    if codec == "topk":   # no reduce-scatter or all-gather form
      return jaxring.psum(tree, "data", **kw), None, None
    small = {k: v for k, v in tree.items() if k not in ("rs", "ag")}
    small["h"] = small["h"].astype(jnp.bfloat16)
    return (jaxring.psum(small, "data", **kw),
            jaxring.psum_scatter(tree["rs"], "data", tiled=True, **kw),
            jaxring.all_gather(tree["ag"], "data", **kw))

  f = jax.jit(body)
  t0 = time.perf_counter()
  for call in range(args.calls):
    if call == 1:
      t1 = time.perf_counter()
    if rank == args.die_rank and call == args.die_at:
      say(f"rank {rank}: dying at call {call} of {algorithm}/{codec} at={time.time():.3f}")
      if args.die_how == "stuck":
        time.sleep(10 ** 6)
      os._exit(9)
    every = [inputs(args.seed, call, m, p, codec) for m in range(p)]
    out = jax.device_get(f(every[rank]))
    try:
      verify(out, every, rank, p, codec)
    except Mismatch as exc:
      raise Mismatch(f"{algorithm}/{codec} call {call}: {exc}") from None
  return t1 - t0, (time.perf_counter() - t1) / (args.calls - 1)


def extras(comm) -> None:
  """Eager calls, constants, pmean, jax.grad, reduce_gradients and unbinding, on "data"."""
  import jax
  import jax.numpy as jnp
  import jaxring
  import jaxring.distributed

  rank, p = comm.Get_rank(), comm.Get_size()
  x = jnp.arange(5.0) + rank
  want = sum(np.arange(5.0) + r for r in range(p))
  for algorithm in ("xla", "ring", "hierarchical"):   # eagerly, no jit
    np.testing.assert_array_equal(jaxring.psum(x, "data", algorithm=algorithm), want)
  # processes hold different constants (shard_map's members cannot): they are reduced, not folded
  assert float(jaxring.psum(float(rank), "data", algorithm="ring")) == sum(range(p))
  np.testing.assert_array_equal(jax.jit(lambda v: jaxring.pmean(v, "data"))(x), want / p)
  # jax.grad: the cotangent of the replicated sum reaches every member unchanged, as lax.psum's
  # does under shard_map (test_mpi.py checks that for lax itself)
  w = np.random.default_rng(rank).standard_normal(5).astype(np.float32)
  for algorithm in ("xla", "ring", "hierarchical"):
    g = jax.jit(jax.grad(lambda v: jnp.sum(w * jaxring.psum(v, "data", algorithm=algorithm,
                                                            compression=None))))(x)
    np.testing.assert_array_equal(g, w)
  try:
    jax.grad(lambda v: jnp.sum(jaxring.psum_scatter(v, "data", tiled=True, algorithm="ring")))(
        jnp.ones(2 * p))
    raise AssertionError("psum_scatter over MPI differentiated")
  except NotImplementedError as exc:
    assert "not differentiable" in str(exc)
  # reduce_gradients with error feedback: nothing is lost, only delayed
  tx = jaxring.reduce_gradients("data", algorithm="ring", compression=jaxring.codecs.int8())
  params = {"a": jnp.zeros(700), "b": jnp.zeros((3, 4))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  applied_sum = jax.tree.map(np.zeros_like, params)
  mean_sum = jax.tree.map(np.zeros_like, params)
  for t in range(5):
    grads = {k: np.random.default_rng((t, r, 7)).standard_normal(np.shape(v)).astype(np.float32)
             for r in [rank] for k, v in params.items()}
    everyone = [{k: np.random.default_rng((t, r, 7)).standard_normal(np.shape(v))
                 .astype(np.float32) for k, v in params.items()} for r in range(p)]
    applied, state = update(grads, state)
    for k in params:
      applied_sum[k] = applied_sum[k] + np.asarray(applied[k], np.float64)
      mean_sum[k] = mean_sum[k] + np.mean([e[k] for e in everyone], axis=0, dtype=np.float64)
  for k in params:
    residual = np.asarray(state.residual[k], np.float64)
    mean_residual = comm.allreduce(residual) / p
    np.testing.assert_allclose(applied_sum[k] + mean_residual, mean_sum[k], atol=1e-5)
    assert np.abs(mean_residual).max() > 0   # int8 did lose something this step
  jaxring.distributed.unbind_mpi_axis("data")
  try:
    jaxring.psum(x, "data")
    raise AssertionError("psum over an unbound name")
  except NameError as exc:
    assert "unbound axis name: data" in str(exc)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--algorithms", default="xla,ring,hierarchical,auto")
  ap.add_argument("--codecs", default=",".join(CODECS))
  ap.add_argument("--only", default="",
                  help="comma list of algorithm/codec pairs: of --algorithms x --codecs, these")
  ap.add_argument("--topology", action="store_true", help="levels local=2, node=2 (4 ranks)")
  ap.add_argument("--extras", action="store_true", help="eager calls, grad, reduce_gradients")
  ap.add_argument("--calibrate", action="store_true",
                  help="jaxring.calibrate over the axis first: auto then follows the profile")
  ap.add_argument("--failure-timeout", type=float, default=None)
  ap.add_argument("--die-rank", type=int, default=-1)
  ap.add_argument("--die-at", type=int, default=-1)
  ap.add_argument("--die-how", choices=("exit", "stuck"), default="exit")
  ap.add_argument("--finish-rank", type=int, default=-1,
                  help="this rank exits normally at once; the others run on for --linger s")
  ap.add_argument("--linger", type=float, default=0.0)
  args = ap.parse_args()

  from mpi4py import MPI
  import jax
  import jaxring
  import jaxring.distributed

  comm = MPI.COMM_WORLD
  rank, p = comm.Get_rank(), comm.Get_size()
  topo = None
  if args.topology:
    topo = jaxring.Topology((jaxring.Level("local", 2),
                             jaxring.Level("node", p // 2, 1.25e8, 1e-4)))
  axis = jaxring.distributed.bind_mpi_axis("data", comm, topo,
                                           failure_timeout_s=args.failure_timeout)
  if args.extras:
    extras(comm)   # ends with "data" unbound
    say(f"rank {rank}: OK extras")
    axis = jaxring.distributed.bind_mpi_axis("data", comm, topo)
  say(f"rank {rank}/{p}: pid {os.getpid()}, {jax.local_device_count()} device(s), levels {[(lv.name, lv.size) for lv in axis.topology.levels]}")
  if args.calibrate:
    from jaxring._src.calibrate import choices
    os.environ["JAXRING_CACHE_DIR"] = os.path.join(
        os.environ.get("JAXRING_CACHE_DIR", "/tmp"), f"rank{rank}")   # one cache per rank
    prof = jaxring.calibrate(axes="data", sizes=(4 << 10, 64 << 10), codecs=("none", "int8"),
                             reps=1)
    again = jaxring.calibrate(axes="data", sizes=(4 << 10, 64 << 10))   # cached everywhere
    picks = choices(prof, [4 << 10, 1 << 20])
    say(f"rank {rank}: OK calibrate fits={len(prof.fits)} transport={prof.key['transport']} "
        f"reused={again == prof} picks={picks}")
  if args.finish_rank >= 0:
    comm.Barrier()
    if rank != args.finish_rank:
      time.sleep(args.linger)   # no MPI call: only the watchdog could notice the finished rank
    say(f"rank {rank}: finished")
    return 0
  for algorithm in args.algorithms.split(","):
    for codec in args.codecs.split(","):
      if algorithm == "xla" and codec != "none":
        continue   # the native collective cannot compress (refused, as under shard_map)
      if args.only and f"{algorithm}/{codec}" not in args.only.split(","):
        continue
      try:
        first, dt = run_config(comm, algorithm, codec, args)
      except Mismatch as exc:
        say(f"rank {rank}: MISMATCH {exc}", sys.stderr)
        return 3
      say(f"rank {rank}: OK {algorithm}/{codec} calls={args.calls} first_s={first:.2f} "
          f"ms_per_call={dt * 1e3:.2f}")
  comm.Barrier()
  return 0


if __name__ == "__main__":
  sys.exit(main())
