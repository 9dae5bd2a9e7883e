"""The measured cost model `auto` reads: interpolation between measured sizes, and top-k's plans
predicted from its dense codec's timings (numbers worked out by hand)."""
import json

import jax.numpy as jnp
import pytest

import jaxring
from jaxring._src import calibrate, profiles, timing
from jaxring._src.algorithms import planner

MiB = 1 << 20
NONE = planner.codec_for(None, "", jnp.float32)
TOPK = jaxring.codecs.topk_chunks(0.01)
KEY_NONE = planner.codec_key([NONE, NONE])
KEY_TOPK = planner.codec_key([NONE, TOPK])


def _fit(algorithm, key, points):
  sizes, seconds = zip(*points)
  return profiles.Fit.from_points(algorithm, key, sizes, seconds)


def _profile(*fits):
  return profiles.Profile(profiles.profile_key(("node", "local"), (4, 2), "xla", 4, "cpu"),
                            tuple(fits))


def test_predict_interpolates_between_points_and_extends_the_end_segments():
  fit = _fit("ring", ("a",), [(4e6, 8.0), (1e6, 1.0), (2e6, 2.0)])   # any order
  assert fit.sizes == (1_000_000, 2_000_000, 4_000_000)
  assert fit.predict(2e6) == pytest.approx(2.0)
  assert fit.predict(3e6) == pytest.approx(5.0)        # halfway between 2 and 8
  assert fit.predict(8e6) == pytest.approx(20.0)       # last segment: 3 s per MB
  assert fit.predict(0.5e6) == pytest.approx(0.5)      # first segment: 1 s per MB
  assert fit.predict(0) == 0.0
  # the least-squares line stays in the profile for people: not what predict follows
  assert fit.predict(3e6) != pytest.approx(fit.alpha + fit.beta * 3e6)
  line = profiles.Fit("ring", ("a",), 1.0, 2e-6)       # no points: the line
  assert line.predict(1e6) == pytest.approx(3.0)


def test_auto_follows_the_measured_point_where_a_line_through_smaller_sizes_misleads():
  # medians measured on the emulated cluster (JAX shape, 2026-11-23): hierarchical ties gloo at
  # 16 MiB and is 8% slower at 32 MiB; the line through 1 and 16 MiB predicted a tie at 32
  xla = _fit("xla", KEY_NONE, [(MiB, 0.033), (16 * MiB, 0.2755), (32 * MiB, 0.5514)])
  hier = _fit("hierarchical", KEY_NONE, [(MiB, 0.026), (16 * MiB, 0.2768), (32 * MiB, 0.5968)])
  prof = _profile(xla, hier)
  assert planner.choose(32 * MiB, 2, [NONE, NONE], False, prof) == "xla"
  assert planner.choose(MiB, 2, [NONE, NONE], False, prof) == "hierarchical"   # 21% faster
  # the codecs may also be given as the profile names them
  assert planner.choose(MiB, 2, list(KEY_NONE), False, prof) == "hierarchical"
  assert planner.predict(prof, "xla", KEY_NONE, MiB) == planner.predict(prof, "xla", [NONE] * 2,
                                                                        MiB) is not None


def test_packed_bytes_follow_the_codecs_own_chunk_count():
  # 32 MiB of f32 = 2048 chunks of 4096 values; 1% -> ceil(20.48) = 21 chunks of 16 KiB
  assert planner._packed_bytes([NONE, TOPK], 32 * MiB, jnp.float32) == 21 * 4096 * 4
  assert planner._packed_bytes([NONE, TOPK], MiB, jnp.float32) == 4096 * 4   # at least one
  # bf16 values accumulate in f32: the packed buffer is f32
  assert planner._packed_bytes([NONE, TOPK], MiB, jnp.bfloat16) == 2 * 4096 * 4


def test_topk_plans_differ_by_their_dense_plans_at_the_packed_size():
  packed = 21 * 4096 * 4
  dense_ring = _fit("ring", KEY_NONE, [(64 << 10, 0.058), (MiB, 0.045), (32 * MiB, 0.9)])
  dense_hier = _fit("hierarchical", KEY_NONE, [(64 << 10, 0.011), (MiB, 0.026), (32 * MiB, 0.6)])
  topk_hier = _fit("hierarchical", KEY_TOPK, [(64 << 10, 0.03), (MiB, 0.033), (32 * MiB, 0.150)])
  prof = _profile(dense_ring, dense_hier, topk_hier)
  d_ring, d_hier = dense_ring.predict(packed), dense_hier.predict(packed)
  want = 0.150 - d_hier + d_ring
  got = planner.predict(prof, "ring", [NONE, TOPK], 32 * MiB)
  assert got == pytest.approx(want)
  assert planner.predict(prof, "hierarchical", [NONE, TOPK], 32 * MiB) == pytest.approx(0.150)
  assert planner.choose(32 * MiB, 2, [NONE, TOPK], True, prof) == "hierarchical"
  # the other way round: a ring whose dense all-reduce is 20 ms faster at the packed size wins
  fast_ring = _fit("ring", KEY_NONE, [(64 << 10, 0.001), (MiB, 0.002), (32 * MiB, 0.9)])
  prof = _profile(fast_ring, dense_hier, topk_hier)
  assert planner.choose(32 * MiB, 2, [NONE, TOPK], True, prof) == "ring"
  # without the dense codec's timings there is nothing to derive the ring from: the default
  assert planner.predict(_profile(topk_hier), "ring", [NONE, TOPK], 32 * MiB) is None
  assert planner.choose(32 * MiB, 2, [NONE, TOPK], True, _profile(topk_hier)) == "hierarchical"


def test_candidates_time_topk_with_every_plan_and_its_dense_codec_too():
  groups, _, _ = planner.levels_for(("local", "node"), (2, 4))
  cands = [(a, calibrate._label(c)) for a, c in calibrate._candidates(groups, ["topk"])]
  assert cands == [("ring", "topk_chunks"), ("hierarchical", "topk_chunks"), ("xla", "none"),
                   ("ring", "none"), ("hierarchical", "none")]
  cands = [(a, calibrate._label(c)) for a, c in calibrate._candidates(groups, ["none", "int8",
                                                                               "topk+int8"])]
  assert cands.count(("hierarchical", "topk_chunks")) == 1 and ("ring", "int8") in cands
  assert len(cands) == 7        # none x3, int8 x2 (also topk's dense codec), topk x2


def test_choices_report_auto_per_spelling_and_profile_json_is_readable(tmp_path):
  dense_hier = _fit("hierarchical", KEY_NONE, [(MiB, 0.02), (32 * MiB, 0.6)])
  xla = _fit("xla", KEY_NONE, [(MiB, 0.03), (32 * MiB, 0.5)])
  topk_hier = _fit("hierarchical", KEY_TOPK, [(MiB, 0.033), (32 * MiB, 0.150)])
  prof = profiles.Profile(_profile().key, (xla, dense_hier, topk_hier), "now",
                            {"codecs": ["none", "topk"], "levels": ["local", "node"]})
  assert calibrate.choices(prof, [MiB, 32 * MiB]) == {
      MiB: {"none": "hierarchical", "topk": "hierarchical"},
      32 * MiB: {"none": "xla", "topk": "hierarchical"}}
  text = prof.to_json()
  assert json.loads(text)["fits"][0]["seconds"] == [0.03, 0.5] and "\n" in text
  assert profiles.Profile.from_json(text).meta["levels"] == ["local", "node"]


@pytest.mark.slow
def test_calibrate_times_topk_with_every_plan_and_its_dense_plans(tmp_path, monkeypatch):
  import jax
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 4),
                                              jaxring.Level("node", 2, 1.25e8, 1e-4)))):
    prof = jaxring.calibrate(mesh, ("node", "local"), sizes=(16 << 10, 64 << 10),
                             codecs=("topk",), reps=1, save=False)
    picks = calibrate.choices(prof, [64 << 10])
  assert sorted((f.algorithm, f.codecs[-1][:4]) for f in prof.fits) == [
      ("hierarchical", "Code"), ("hierarchical", "TopK"), ("ring", "Code"), ("ring", "TopK"),
      ("xla", "Code")]
  assert all(f.sizes == (16 << 10, 64 << 10) and min(f.seconds) > 0 for f in prof.fits)
  assert prof.meta["codecs"] == ["topk"] and prof.meta["levels"] == ["local", "node"]
  assert set(picks[64 << 10]) == {"topk"} and picks[64 << 10]["topk"] in ("ring", "hierarchical")


@pytest.mark.slow
def test_compressed_plans_are_compiled_and_timed_only_from_their_smallest_size_up(monkeypatch):
  """Below COMPRESSED_FROM a call is latency: only the lossless plans are compiled and timed
  there, and the compressed plans' fits hold their larger points only."""
  import jax
  monkeypatch.setattr(calibrate, "COMPRESSED_FROM", 64 << 10)
  compiled = []
  real = calibrate._compiled
  monkeypatch.setattr(calibrate, "_compiled",
                      lambda program, x: compiled.append(x.size * 4 // 8) or real(program, x))
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  sizes = (16 << 10, 64 << 10, 128 << 10)
  with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 4),
                                              jaxring.Level("node", 2, 1.25e8, 1e-4)))):
    prof = jaxring.calibrate(mesh, ("node", "local"), sizes=sizes, codecs=("none", "int8"),
                             reps=1, save=False, reuse=False)
  by_plan = {(f.algorithm, "Int8" in f.codecs[-1]): f for f in prof.fits}
  assert sorted(by_plan) == [("hierarchical", False), ("hierarchical", True), ("ring", False),
                             ("ring", True), ("xla", False)]
  for (algorithm, lossy), fit in by_plan.items():
    assert fit.sizes == (sizes[1:] if lossy else sizes), (algorithm, fit)
    assert len(fit.seconds) == len(fit.sizes) and min(fit.seconds) > 0
  # 3 lossless plans at 3 sizes, 2 compressed at 2: 13 programs instead of 15
  assert sorted(compiled) == sorted([n for n in sizes for _ in range(3)] + list(sizes[1:]) * 2)
  assert calibrate._sizes_for({"node": jaxring.codecs.int8()}, (1 << 10, 1 << 20)) == (
      1 << 10, 1 << 20)    # fewer than two sizes from COMPRESSED_FROM up: every size


def test_a_contender_not_timed_at_a_size_is_not_timed_again_there():
  import numpy as np
  first = np.array([[0.010, 0.750], [np.nan, 0.180], [np.nan, 0.200]])
  asked = []
  table = timing.confirm(first, ["none", "int8", "int8"],
                         lambda rows, j: asked.append((rows, j)) or [(0.5 * first[i, j],) * 2
                                                                     for i in rows])
  assert asked == [([0], 0), ([0, 1, 2], 1)]
  np.testing.assert_array_equal(table, [[0.005, 0.375], [np.nan, 0.09], [np.nan, 0.1]])


def test_every_plan_is_timed_again_and_keeps_the_lower_median_or_alone_the_median_of_all():
  import numpy as np
  # plans: xla/none, ring/none, hierarchical/none, hierarchical/int8 (alone in its codec)
  labels = ["none", "none", "none", "int8"]
  first = np.array([[0.010, 0.750],
                    [0.014, 0.790],
                    [0.040, 1.034],    # a slow phase: 2.9x the fastest at the small size
                    [0.030, 0.180]])
  # (median of the new calls, median of the new and the first calls together)
  again = {(0, 0): (0.011, 0.0105), (0, 1): (0.700, 0.72), (1, 0): (0.012, 0.013),
           (1, 1): (0.800, 0.795), (2, 0): (0.009, 0.02), (2, 1): (0.553, 0.8),
           (3, 0): (0.025, 0.027), (3, 1): (0.200, 0.190)}
  asked = []

  def retime(plans, j):               # the plans of one size, timed side by side
    asked.append((list(plans), j))
    return [again[(i, j)] for i in plans]
  table = timing.confirm(first, labels, retime)
  # every plan, even one far from the fastest: a slow phase can push the fastest out of any
  # window (one JAX-shape calibration: the hierarchical plan 39.5 ms at 1 MiB, 14.1-14.8 in four
  # others, gloo's psum 18.1; auto ran gloo's at 1.40x)
  assert asked == [([0, 1, 2, 3], 0), ([0, 1, 2, 3], 1)]
  # a plan with rivals keeps the lower of its two medians; one alone (int8), the median of all
  # its calls: the lower of two medians sits below the median its calls are drawn from
  np.testing.assert_array_equal(table, [[0.010, 0.700], [0.012, 0.790], [0.009, 0.553],
                                        [0.027, 0.190]])
  assert first[2, 1] == 1.034   # the first timings are left as they were


def test_plans_with_as_many_calls_do_not_always_follow_the_same_plan():
  """Calibration's uncompressed plans have 3 calls each at 32 MiB and tie at every slot; in
  index order the MPI shape's ring always followed MPICH's all-reduce and the hierarchical plan
  the ring. Each group of ties gets its own order, the same on every process."""
  made = timing.spread([3] * 4)
  assert made == timing.spread([3] * 4)         # pure arithmetic: every process alike
  groups = [made[k:k + 4] for k in range(0, 12, 4)]
  assert all(sorted(g) == [0, 1, 2, 3] for g in groups)      # every plan once a slot
  assert any(g != groups[0] for g in groups)                  # not one order thrice
  assert timing.spread([2, 2], order=[1, 0]) == [1, 0, 1, 0]   # an order given is kept


def test_a_pooled_group_keeps_the_median_of_all_its_calls_even_with_rivals():
  """Top-k's two plans differ by less than their medians scatter from one timing to the next
  (MPI shape, 32 MiB: 26-41 ms, then 25-32, rows 27-35): the lower of two would set the group's
  level low, so calibration pools a sparsifying codec's calls."""
  import numpy as np
  first = np.array([[0.500], [0.036], [0.040]])
  again = {0: (0.450, 0.480), 1: (0.025, 0.030), 2: (0.026, 0.031)}
  retime = lambda rows, j: [again[i] for i in rows]   # noqa: E731
  np.testing.assert_array_equal(
      timing.confirm(first, ["none", "topk", "topk"], retime, pooled={"topk"})[:, 0],
      [0.480, 0.030, 0.031])   # "none" alone: pooled too
  np.testing.assert_array_equal(   # without: the lower median
      timing.confirm(first, ["none", "topk", "topk"], retime)[:, 0], [0.480, 0.025, 0.026])


def test_every_process_times_the_plans_again_in_the_same_order():
  # the calls are collective: the order may depend on the plans' order only, never on string
  # hashing (salted per process, so a set of codec names iterates differently in each)
  import numpy as np
  labels = ["none", "bf16", "int8", "topk", "fp16", "none", "bf16", "int8", "topk", "fp16"]
  first = np.ones((len(labels), 2))
  asked = []
  timing.confirm(first, labels,
                 lambda plans, j: asked.append((plans, j)) or [(1.0, 1.0)] * len(plans))
  assert asked == [(list(range(10)), 0), (list(range(10)), 1)]


def test_plans_of_a_size_are_timed_side_by_side_each_spread_evenly():
  """A quick plan's calls are spread evenly among the others', not made in a row; the count of a large
  point follows its slowest process's warm-up time within the budget."""
  made = []
  times = timing.side_by_side([lambda: made.append("slow"), lambda: made.append("quick"),
                               lambda: made.append("topk")], [1, 2, 4])
  # each plan's calls evenly over the span (k-th of c at (k + 1/2)/c), ties in the plans' order
  assert made == ["topk", "quick", "topk", "slow", "topk", "quick", "topk"]
  assert [len(t) for t in times] == [1, 2, 4] and all(s >= 0 for t in times for s in t)
  assert calibrate._large_reps(3, 0.6) == 3 and calibrate._large_reps(3, 0.1) == 5
  # a quick call (under QUICK_S) gets QUICK_BUDGET_S: 1.0 s / 0.05 s
  assert calibrate._large_reps(3, 0.05) == 20
  assert calibrate._large_reps(3, 1e-4) == 3 * calibrate.QUICK_REPS_FACTOR
  made.clear()   # a barrier of the processes (untimed) before every call, as bench cluster has
  timing.side_by_side([lambda: made.append("a"), lambda: made.append("b")], [1, 2],
                      before=lambda: made.append("|"))
  assert made == ["|", "b", "|", "a", "|", "b"]


def test_calls_during_which_a_process_paged_in_fresh_memory_are_left_out_where_clean_ones_remain():
  """Calibration's timings (timing.unpaged): a call during which any process faulted more than
  FRESH_PAGES pages is left out of its plan's seconds, if a third of the plan's calls (one at
  least) stay; where (nearly) every call faults, that is the steady state and all are kept."""
  import time
  other = {0: [45, 30, 20, 0, 1], 1: [900, 900, 900], 2: [40, 9, 3], 3: [50, 50, 50, 50, 50, 0]}
  made = {i: 0 for i in other}

  def call(i):
    def run():
      k, made[i] = made[i], made[i] + 1
      time.sleep(0.03 if other[i][k] > timing.FRESH_PAGES else 0.0)  # a faulting call is slow
    return run

  def most(mine):   # the other process's counts, as an allgather's maximum would give them
    theirs = [f for i in sorted(other) for f in other[i]]
    assert len(mine) == len(theirs) and all(f >= 0 for f in mine)
    return [max(a, b) for a, b in zip(mine, theirs)]
  times = timing.unpaged([call(i) for i in sorted(other)], [5, 3, 3, 6], lambda: None, most)
  assert [len(t) for t in times] == [2, 3, 1, 6]
  assert max(times[0]) < 0.02 and times[2][0] < 0.02   # the clean calls, not the faulting ones
  assert sum(t > 0.02 for t in times[3]) == 5           # one clean call of six is too few


def test_a_quick_plans_count_at_a_large_size_follows_its_second_warm_up_call():
  """The first call of a program is slow: a 40 ms plan whose first call took 0.3 s is called
  once more and counted by that call (as many calls as fit the budget); a plan whose first call
  exceeds the budget is not called again; below 4 MiB nothing is called again."""
  import time

  class Target:
    def most(self, values):   # the slowest process decides (the other took half as long)
      return [max(v, v // 2) for v in values]

  def plan(first, later):
    made = []
    def call():
      time.sleep(first if not made else later)
      made.append(1)
    return call, made

  quick, quick_made = plan(0.3, 0.04)
  slow, slow_made = plan(0.6, 0.6)
  counts = calibrate._counts(Target(), 32 << 20, 3, [quick, slow], 1)
  assert (len(quick_made), len(slow_made)) == (2, 1)
  # counted by the 40 ms call (up to 25 calls; sleep may overshoot), not the 0.3 s one (3)
  assert 3 < counts[0] <= calibrate._large_reps(3, 0.04) and counts[1] == 3
  small, small_made = plan(0.0, 0.0)
  assert calibrate._counts(Target(), 1 << 20, 3, [small], 1) == [9] and len(small_made) == 1


def test_the_second_timing_counts_a_quick_plan_by_its_first_median_not_its_warm_up():
  """MPI shape, 32 MiB: top-k's first two calls paged in fresh memory (0.97 and 0.54 s, later
  ones 36-46 ms), so its first timing had 3 calls; the second gets what its median fits in the
  budget. Slow plans and small sizes keep their counts; a count never shrinks."""
  assert calibrate._again(32 << 20, 3, 3, 0.046) == calibrate._large_reps(3, 0.046) == 21
  assert calibrate._again(32 << 20, 3, 3, 0.8) == 3
  assert calibrate._again(32 << 20, 3, 25, 0.046) == 25
  assert calibrate._again(1 << 20, 3, 4, 0.001) == 9
  assert calibrate._again(32 << 20, 3, 2, float("nan")) == 3


def _timed_counting_barriers(codecs, sizes):
  """``calibrate._time_candidates`` on 2 x 4 emulated devices, one call each timed: ``(plans,
  first medians, raw seconds, norms profile, the barriers waited at)``."""
  import jax
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 4),
                                              jaxring.Level("node", 2, 1.25e8, 1e-4)))):
    target = calibrate.targets.target(mesh, ("node", "local"))
    waits = []
    target.barrier = lambda: waits.append(1)
    key = profiles.profile_key(target.axes, target.sizes, target.transport, 1, "cpu")
    inputs = {n: target.input(n // 4) for n in sizes}
    plans, _, first, raw, norms = calibrate._time_candidates(target, key, codecs, sizes, inputs,
                                                             1, 1, None)
  return plans, first, raw, norms, waits


def test_calibration_waits_at_a_barrier_before_every_timed_call():
  """Without one, a call's time on process 0 holds the skew the previous call left between the
  processes: on the emulated cluster's MPI shape, timed beside the calibration's other plans at
  32 MiB, top-k took 23.0 ms a call on rank 0 without a barrier, 19.7 with one
  (benchmarks/scripts/calibration_barrier.py)."""
  plans, _, raw, _, waits = _timed_counting_barriers(("none",), (1 << 10, 64 << 10))
  assert len(plans) == 3 and len(waits) == 3 * 2 * 3   # 3 plans x 2 sizes x 3 calls, each waited
  # calls that paged in fresh memory are timed but may be left out of raw (timing.unpaged keeps
  # at least a third of each plan's calls at a size): a fresh-clone CI run left out one
  assert len(waits) // 3 <= sum(len(t) for row in raw for t in row) <= len(waits)


@pytest.mark.slow   # a calibration that times every plan (~6 s)
def test_the_lossless_plans_timed_for_the_chunk_norms_are_the_first_timing_at_those_sizes():
  """Top-k's chunk norms need the lossless plans' small points before its programs are traced;
  the first timing at those sizes (lossless plans only) reuses those calls, not times them
  twice: in one trace each, the repeat took 0.6 s (MPI shape) and 1.7 s (JAX shape)."""
  # top-k timed from 1 MiB, its chunk norms under 1 KiB
  plans, first, raw, norms, waits = _timed_counting_barriers(
      ("none", "topk"), (1 << 10, 64 << 10, 1 << 20, 2 << 20))
  assert len(plans) == 5 and norms is not None
  # 3 calls a point (below 4 MiB): the norms' 3 plans x 2 sizes, then 5 plans x 2 sizes (some
  # calls may be left out of raw for paging in fresh memory: timing.unpaged)
  assert len(waits) == 3 * (3 * 2 + 5 * 2) >= sum(len(t) for row in raw for t in row)
  by_norms = {f.algorithm: f.seconds for f in norms.fits}
  for (algorithm, comp), row in zip(plans, first):
    if comp is None:     # the norms profile's points are the first timing's, at both sizes
      assert tuple(row[:2]) == pytest.approx(by_norms[algorithm], abs=1e-6)   # stored in µs


@pytest.mark.slow   # a calibration that times every plan (~7 s)
def test_topk_is_timed_with_the_chunk_norms_plan_this_calibration_chooses_not_a_cached_one():
  """Top-k sums its chunk norms by the lossless plan ``auto`` picks from a profile; calibrating
  must not time it with an earlier (stale) profile's pick, nor with none on a fresh machine."""
  import jax
  import numpy as np

  from jaxring._src.algorithms import planner
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 4),
                                              jaxring.Level("node", 2, 1.25e8, 1e-4)))):
    target = calibrate.targets.target(mesh, ("node", "local"))
    key = profiles.profile_key(target.axes, target.sizes, target.transport, 1, "cpu")
    sizes = (1 << 10, 64 << 10)
    inputs = {n: target.input(n // 4) for n in sizes}
    none = planner.codec_key([planner.codec_for(None, g.name, np.float32) for g in target.groups])
    # a stale profile in which the ring is 10,000x faster than anything at every size
    stale = profiles.Profile(key, tuple(
        profiles.Fit.from_points(a, none, sizes, [t, t])
        for a, t in (("xla", 1.0), ("ring", 1e-4), ("hierarchical", 1.0))),
        meta={"levels": ["local", "node"]})
    with profiles.use_profile(stale):
      plans, compiled, _, _, norms = calibrate._time_candidates(target, key, ("topk",), sizes,
                                                               inputs, 1, 1, None)
      topk = next(i for i, (_, c) in enumerate(plans) if calibrate._sparsifying(c))
      as_stale = target.program(*plans[topk]).lower(inputs[sizes[1]]).compile().as_text()
  picked = calibrate.choices(norms, [16], ["none"])[16]["none"]   # 4 chunks' norms at 64 KiB
  assert calibrate.choices(stale, [16], ["none"])[16]["none"] == "ring"
  assert sorted(f.algorithm for f in norms.fits) == ["hierarchical", "ring", "xla"]
  assert all(f.sizes == sizes for f in norms.fits)
  # the program calibration calls: traced under the norms profile (jit's cache keeps that trace)
  timed = compiled[topk][1].lower(inputs[sizes[1]]).compile().as_text()
  if picked == "xla":   # on one host the native psum: one all-reduce, where the ring has none
    assert "all-reduce(" in timed and "all-reduce(" not in as_stale
  else:
    assert timed != as_stale
