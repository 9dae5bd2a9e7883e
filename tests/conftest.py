"""8 emulated CPU devices for every in-process test; strict dtype promotion; the ``slow`` marker."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `auto` reads calibrated profiles from the cache: tests must not see the developer's own. The
# folder (one per pytest process) is deleted when the process ends.
_CACHE_ROOT = tempfile.mkdtemp(prefix="jaxring-test-cache-")
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
os.environ["JAXRING_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "jaxring")
os.environ.pop("JAXRING_PROFILE", None)
# the flight recorder dumps when a watchdog gives up: into a temporary folder, not the checkout
os.environ["JAXRING_FLIGHT_DIR"] = os.path.join(os.environ["JAXRING_CACHE_DIR"], "flight")
_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The in-process tests compile thousands of programs and run each a few times: without LLVM's
# optimizations (XLA:CPU's level 2 by default) the compile-bound ones take half the time on the
# 2-core machine (docs/benchmarks.md, "The test suite's time"). Same numerics: no fast-math at
# either level. Processes started through multiproc.clean_env (multi-process and MPI tests, the
# docs' blocks) compile at the default level, as users do; XLA_FLAGS naming a level overrides it.
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# `pytest -m "not slow"` (the quick loop) leaves these out; `make test` runs everything. Every
# test marked `multiprocess` or `netns` is slow too (it starts processes, MPI jobs or namespaces).
# Seconds are one run on the 2-core development machine.
SLOW_MODULES = {
    "test_convergence.py",  # trains three classifiers to convergence (~15 s)
    "test_convergence_compressed.py",  # digits with every optimizer and codec (~15 s)
    "test_nonfinite.py",    # NaN/Inf through every codec, level and optimizer transform (~15 s)
    "test_docs.py",         # each README/docs block in a fresh process, some under mpirun (~12 s)
    "test_doctor.py",       # `jaxring doctor` in fresh processes, one on a copied package (~8 s)
}
SLOW_TESTS = {
    # recipes: training twice (~14 s), training and compiling (~12 s), ResNet compiles (~8 s)
    "test_recipes.py::test_small_config_trains_on_8_devices_and_resumes",
    "test_recipes.py::test_demo_report_has_its_fields",
    "test_recipes.py::test_sgd_decays_only_kernels_with_nesterov_momentum",
    # fresh processes (~2 s each); three training runs (~4 s); 1000 steps per codec (~3 s)
    "test_train_step.py::test_a_loop_without_host_sync_does_not_deadlock_xla_cpu",
    "test_train_checkpoint.py::test_sigkill_in_the_middle_of_a_save_keeps_the_last_commit",
    "test_train_checkpoint.py::test_resume_is_bit_identical_to_an_uninterrupted_run",
    "test_error_feedback.py::test_residual_stays_bounded_over_1000_steps",
    # a short recipe run (~9 s); forward- and reverse-mode of every codec (~14 s); resumes (~8 s)
    "test_recipes.py::test_a_short_run_clips_the_warm_up_instead_of_refusing",
    "test_recipes.py::test_small_config_trains_fully_sharded_with_int8_weights",
    "test_contract.py::test_jvp_and_linearize_are_lax_psum_of_the_tangent",
    "test_train_compression.py::test_topk_momentum_step_resumes_bit_for_bit_from_a_checkpoint",
    "test_compressed_optim.py::test_state_resumes_bit_for_bit_from_an_orbax_checkpoint",
    "test_train_checkpoint.py::test_fit_skips_a_corrupt_checkpoint_and_resumes_from_the_previous",
    # compiles of whole programs (~3-5 s each); the simulator CLI in fresh processes (~2 s)
    "test_train_step.py::test_eight_replicas_match_single_device",
    "test_train_buckets.py::test_one_reduction_per_bucket_scheduled_inside_backprop",
    "test_codecs.py::test_wire_ratios_from_compiled_hlo",
    "test_ext_api.py::test_gradients_match_the_references",
    "test_simulate.py::test_cli_runs_to_1024_gpus_in_seconds_and_reproduces_baidus_400_ms",
}


def pytest_collection_modifyitems(config, items):
  for item in items:
    module = item.path.name
    name = f"{module}::{item.originalname}"
    if (module in SLOW_MODULES or name in SLOW_TESTS or item.get_closest_marker("multiprocess")
        or item.get_closest_marker("netns")):
      item.add_marker(pytest.mark.slow)
