"""Worker for tests/test_distributed.py: start-up only, with ``--timeout`` seconds to meet.

Settings come in ``JAXRING_*`` variables. Prints ``STARTED <id> after <s>`` once every process has
arrived; an exception from ``initialize`` is left uncaught, so the exit code and the traceback on
stderr are what a user's script would show.
"""
import argparse
import sys
import time


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--timeout", type=float, required=True)
  args = ap.parse_args()
  import jaxring.distributed
  start = time.monotonic()
  jaxring.distributed.initialize(timeout_s=args.timeout)
  import jax
  print(f"STARTED {jax.process_index()} of {jax.process_count()} after "
        f"{time.monotonic() - start:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
