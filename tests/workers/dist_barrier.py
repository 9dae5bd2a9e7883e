"""Worker for tests/test_distributed.py: process ``--skip`` never reaches the barrier.

The others call ``jaxring.distributed.barrier("sync", timeout_s)`` and print the process ids
the BarrierTimeoutError names (``MISSING [..]``), or ``PASSED`` if it returned.
"""
import argparse
import sys
import time


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--skip", type=int, default=-1)
  ap.add_argument("--timeout", type=float, default=2.0)
  args = ap.parse_args()
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  jaxring.distributed.barrier("warmup", timeout_s=60)
  if jax.process_index() == args.skip:
    time.sleep(args.timeout + 3)   # stays alive (heartbeating) but never arrives
    return 0
  try:
    jaxring.distributed.barrier("sync", timeout_s=args.timeout)
  except jaxring.distributed.BarrierTimeoutError as exc:
    print(f"MISSING {list(exc.missing)}: {exc}", flush=True)
    return 0
  print("PASSED", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
