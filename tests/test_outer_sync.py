"""``jaxring bench outer-sync``'s table arithmetic and its refusals (the runs need root and the
emulated cluster: docs/benchmarks.md)."""
import argparse

import pytest

from jaxring._src.tools.bench import common, outer_sync


def _rec(name, seconds, tx, waited=None):
  return {"contender": name, "steps": 10, "turn_seconds": seconds, "tx_per_turn": tx,
          "waited_per_turn": waited or [0.0] * len(seconds)}


def test_rows_read_utilization_against_the_step_with_no_collective_turn_by_turn():
  names = list(outer_sync.names(10, 2, 3))
  recs = [_rec(outer_sync.ALONE, [1.0, 2.0, 1.0], [0, 0, 0]),
          _rec(outer_sync.PMEAN, [4.0, 4.0, 4.0], [1000, 1000, 1000]),
          _rec(outer_sync.LOCAL, [2.0, 2.0, 2.0], [10, 10, 10]),
          _rec(names[-1], [2.0, 4.0, 2.5], [20, 50, 110], waited=[0.0, 0.2, 0.1])]
  rows = {r["contender"]: r for r in outer_sync.rows_of(recs, "10mbit")}
  host = rows[names[-1]]
  # per-turn ratios 0.5, 0.5, 0.4 -> median 0.5 (not 1.33 / 2.5 of the medians)
  assert host["utilization"] == pytest.approx(0.5)
  assert host["of_local_only"] == pytest.approx(0.8)   # 1.0, 0.5, 0.8
  assert host["ms_per_step"] == pytest.approx(250.0)
  assert host["waited_ms_per_step"] == pytest.approx(10.0)
  # bytes: all turns over all steps (a sync's bytes land in one turn), not a turn's median
  assert host["bytes_per_step"] == pytest.approx(6.0)
  assert host["fewer_bytes"] == pytest.approx(100 / 6)
  # what the sync adds to the local-only step's 1 B (the bench's own coordination) against
  # what the per-step pmean adds to it
  assert host["fewer_sync_bytes"] == pytest.approx((100 - 1) / (6 - 1))
  assert "fewer_sync_bytes" not in rows[outer_sync.LOCAL]
  assert "fewer_bytes" not in rows[outer_sync.ALONE]   # it sent nothing
  assert rows[outer_sync.ALONE]["utilization"] == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["program", "host"])
def test_every_turn_holds_each_fragments_sync_and_arrival(kind):
  every, fragments, delay = 100, 4, 20
  warm = outer_sync.warm_steps(kind, every, delay)
  for turn in range(3):   # inner steps t = count + 1 of the turn
    ts = range(warm + turn * every + 1, warm + (turn + 1) * every + 1)
    for p in range(fragments):   # diloco: fragment p sends at p * H / P + k H, k >= 1
      sends = [t for t in ts if (t - p * every // fragments) % every == 0 and
               t > p * every // fragments]
      assert len(sends) == 1, (kind, turn, p, sends)
      if kind == "host":
        assert sends[0] + delay in ts, (turn, p)   # its arrival in the same turn
  assert outer_sync.warm_steps("pmean", every, delay) == 1   # compiled, nothing to align


@pytest.mark.parametrize("delay", [0, 5])
def test_a_delay_a_turn_cannot_hold_is_refused(delay, capsys):
  assert outer_sync.main(["--every", "20", "--fragments", "4", "--delay", str(delay)]) == 2
  assert "must be >= 1 and below --every / --fragments = 5" in capsys.readouterr().err


@pytest.mark.parametrize("shapes", ["", "jax,gpu"])
def test_an_unknown_shape_is_refused(shapes, capsys):
  assert outer_sync.main(["--shapes", shapes]) == 2
  assert f"--shapes takes jax, mpi, got {shapes!r}" in capsys.readouterr().err


def test_the_ranks_get_every_option_but_the_drivers():
  args = outer_sync._parser().parse_args(["--links", "1gbit", "--every", "50", "--timeout", "9"])
  argv = outer_sync.job_argv(args, "mpi")
  assert argv[0] == "--worker" and "--links" not in argv and "--timeout" not in argv
  assert "--shapes" not in argv and argv[argv.index("--shape") + 1] == "mpi"   # one job's
  assert "--out-dir" not in argv and "--nodes" not in argv   # None, and the driver's
  # the ranks parse what they were given back to the driver's values
  again = vars(outer_sync._parser().parse_args(argv))
  assert {k: again[k] for k in ("every", "fragments", "delay", "topk", "reps", "batch")} == {
      k: vars(args)[k] for k in ("every", "fragments", "delay", "topk", "reps", "batch")}
  assert again["worker"] and again["every"] == 50
  flags = argparse.ArgumentParser()
  flags.add_argument("--full", action="store_true")
  flags.add_argument("--quick", action="store_true")
  assert common.worker_argv(flags.parse_args(["--full"])) == ["--worker", "--full"]
