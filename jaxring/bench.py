"""Benchmarking helpers shared by jaxring's benchmarks and the recipes' (re-exported from
``jaxring._src.tools``), and ``python -m jaxring.bench collectives|kernels|wire|train|cluster|resnet50
[args]``.

Example:
  >>> from jaxring import bench
  >>> bench.fmt_bytes(3 << 20)
  '3MiB'
"""
from jaxring._src.tools.allocator import allocator_in_use as allocator_in_use
from jaxring._src.tools.allocator import (
  maybe_reexec_with_fast_allocator as maybe_reexec_with_fast_allocator,
)
from jaxring._src.tools.bench.common import fmt_bytes as fmt_bytes
from jaxring._src.tools.bench.common import machine as machine
from jaxring._src.tools.bench.common import print_table as print_table
from jaxring._src.tools.bench.common import set_cpu_devices as set_cpu_devices
from jaxring._src.tools.bench.common import time_interleaved as time_interleaved
from jaxring._src.tools.bench.common import warm_up as warm_up
from jaxring._src.tools.bench.common import warm_up_contenders as warm_up_contenders
from jaxring._src.tools.bench.common import write_json as write_json
from jaxring._src.tools.hlo_bytes import wire_bytes as wire_bytes

if __name__ == "__main__":
  import sys

  from jaxring._src.tools.cli import bench_main
  raise SystemExit(bench_main(sys.argv[1:]))
