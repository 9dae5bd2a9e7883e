"""``python -m jaxring.bench collectives|kernels|wire|train|cluster|resnet50 [args]``."""
if __name__ == "__main__":
  import sys

  from jaxring._src.tools.cli import bench_main
  raise SystemExit(bench_main(sys.argv[1:]))
