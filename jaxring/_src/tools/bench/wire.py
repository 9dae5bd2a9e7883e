"""Bytes on the wire per codec, read from compiled HLO: ``python -m jaxring._src.tools.bench.wire``.

One all-reduce of an ``n_bytes`` f32 buffer per member over ``p`` members, compiled (never run) for
each codec; the bytes one member sends are summed over the program's collectives
(jaxring._src.tools.hlo_bytes) and compared with the uncompressed f32 ring's. ``predicted`` is the
codec's own ``compression_ratio`` (its ``wire_bytes``), the number the cost model uses.

Example:
  $ python -m jaxring._src.tools.bench.wire --mib 32 --devices 8 --json wire.json
"""
from __future__ import annotations

import argparse
import json
import os


def _cases():
  from jaxring import codecs
  return [
      ("xla psum (native)", "xla", None),
      ("f32 ring (none)", "ring", codecs.none()),
      ("bf16", "ring", codecs.bf16()),
      ("fp16", "ring", codecs.fp16()),
      ("int8 (256)", "ring", codecs.int8()),
      ("int8 (256, stochastic)", "ring", codecs.int8(stochastic=True)),
      ("fp4 (64)", "ring", codecs.fp4()),
      ("topk_chunks (1%, 4096)", "ring", codecs.topk_chunks(0.01)),
      ("topk_chunks (1%) + int8", "ring", codecs.topk_chunks(0.01, inner=codecs.int8())),
  ]


def _program(mesh, axis: str, algorithm: str, codec):
  import jax
  from jax.sharding import PartitionSpec as P

  import jaxring

  def body(v):
    return jaxring.psum(v, axis, algorithm=algorithm, compression=codec)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(),
                               check_vma=False))


def wire_table(n_bytes: int = 32 << 20, p: int = 8) -> list[dict]:
  """HLO wire bytes of one f32 all-reduce per codec, and their ratio to the f32 ring's.

  Args:
    n_bytes: bytes of the f32 buffer on each member.
    p: members (the first ``p`` devices; needs ``jax.device_count() >= p``).

  Returns:
    One dict per codec: ``codec``, ``algorithm``, ``wire_bytes`` (sent per member),
    ``operand_bytes`` (plain operand sum), ``ratio`` (to the f32 ring), ``predicted`` (the codec's
    ``compression_ratio``), ``wire_dtypes`` (element types seen on the collectives).

  Example:
    >>> rows = wire_table(32 << 20, 8)
    >>> {r["codec"]: round(r["ratio"], 3) for r in rows}["bf16"]
    0.5
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxring._src.tools.hlo_bytes import wire_bytes

  if jax.device_count() < p:
    raise RuntimeError(f"wire_table needs {p} devices, found {jax.device_count()}; on CPU set "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={p} before importing jax")
  n = n_bytes // 4
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:p]), ("d",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  arg = jax.ShapeDtypeStruct((p * n,), jnp.float32, sharding=NamedSharding(mesh, P("d")))
  rows = []
  for label, algorithm, codec in _cases():
    text = _program(mesh, "d", algorithm, codec).lower(arg).compile().as_text()
    wb = wire_bytes(text)
    rows.append({
        "codec": label, "algorithm": algorithm, "wire_bytes": wb.sent_bytes,
        "operand_bytes": wb.operand_bytes,
        "predicted": (codec.compression_ratio(jnp.float32, n) if codec is not None else 1.0),
        "wire_dtypes": sorted({d for c in wb.collectives for d in c.dtypes}),
        "collectives": len(wb.collectives)})
  base = next(r["wire_bytes"] for r in rows if r["codec"].startswith("f32 ring"))
  for r in rows:
    r["ratio"] = r["wire_bytes"] / base
  return rows


def format_table(rows: list[dict], n_bytes: int, p: int) -> str:
  lines = [f"one all-reduce of {n_bytes / 2**20:g} MiB f32 per member over {p} members, "
           "bytes each member sends (compiled HLO)",
           "| codec | wire MiB/member | ratio to f32 ring | predicted (wire_bytes) | wire dtypes |",
           "|---|---:|---:|---:|---|"]
  for r in rows:
    lines.append(f"| {r['codec']} | {r['wire_bytes'] / 2**20:.3f} | {r['ratio']:.4f} | "
                 f"{r['predicted']:.4f} | {','.join(r['wire_dtypes'])} |")
  return "\n".join(lines)


def _emulate_cpu_devices(p: int) -> None:
  """Asks for ``p`` CPU devices when nothing else was configured and no backend is up yet."""
  import jax
  from jax._src import xla_bridge
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_num_cpu_devices", p)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mib", type=float, default=32, help="f32 MiB per member (default 32)")
  ap.add_argument("--devices", type=int, default=8, help="members (default 8)")
  ap.add_argument("--json", default=None, help="also write the rows to this file")
  args = ap.parse_args(argv)
  _emulate_cpu_devices(args.devices)
  import jax
  if jax.default_backend() == "cpu" and jax.device_count() < args.devices:
    raise SystemExit(f"needs {args.devices} devices; run with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}")
  n_bytes = int(args.mib * 2**20)
  rows = wire_table(n_bytes, args.devices)
  print(format_table(rows, n_bytes, args.devices))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"n_bytes": n_bytes, "p": args.devices, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
