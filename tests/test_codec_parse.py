"""jaxring.codecs.parse: the one string spelling of codecs (CLI, cluster worker, recipes, demo)."""
import jax.numpy as jnp
import pytest

from jaxring import codecs


@pytest.mark.parametrize("spec,expected", [
    ("none", None),
    (None, None),
    ("bf16", codecs.bf16()),
    ("fp16", codecs.fp16()),
    ("fp16:128", codecs.fp16(128)),
    ("int8", codecs.int8()),
    ("int8:256", codecs.int8(256)),
    ("int8:64:stochastic", codecs.int8(64, stochastic=True)),
    ("topk", codecs.topk_chunks(0.01)),
    ("topk_chunks", codecs.topk_chunks(0.01)),
    ("topk:0.05", codecs.topk_chunks(0.05)),
    ("topk:0.05:1024", codecs.topk_chunks(0.05, 1024)),
    ("topk:0.01:16:per_tensor", codecs.topk_chunks(0.01, 16, per_tensor=True)),
    ("topk:0.01:16:global", codecs.topk_chunks(0.01, 16, per_tensor=False)),
    ("topk:0.01+int8:128", codecs.topk_chunks(0.01, inner=codecs.int8(128))),
    (" int8 ", codecs.int8()),
])
def test_parse_builds_the_named_codec(spec, expected):
  assert codecs.parse(spec) == expected


def test_parse_passes_a_codec_through():
  c = codecs.int8(32)
  assert codecs.parse(c) is c


@pytest.mark.parametrize("spec", ["int4", "bf16:8", "int8:x", "int8:256:round", "int8:0",
                                  "fp16:1:2", "topk:2.0", "topk:0.1:8:9", "topk:0.1:8:per_tensor:1",
                                  "topk:0.1:8:global:1",
                                  "int8+bf16",
                                  "none:1", "", "topk+int4"])
def test_parse_refuses_what_it_cannot_read_and_lists_the_spellings(spec):
  with pytest.raises(ValueError, match="spellings"):
    codecs.parse(spec)


def test_bench_cluster_wire_ratio_is_the_codecs_own_arithmetic():
  from jaxring._src.tools.bench import cluster
  n = 1 << 23
  assert cluster._wire_ratio("none") == 1.0
  assert cluster._wire_ratio("bf16") == 0.5
  # int8: one byte per value plus one f32 scale per 256-value block
  assert cluster._wire_ratio("int8") == pytest.approx((n + 4 * n / 256) / (4 * n))
  assert cluster._wire_ratio("topk") == codecs.topk_chunks(0.01).compression_ratio(jnp.float32, n)


def test_the_registry_lists_the_spellings_and_the_default_sweep():
  from jaxring._src.codecs import base
  assert base.sweep() == ("none", "bf16", "int8", "topk")    # fp16 and fp4 are not swept
  assert base.sweep(per_hop=True) == ("none", "bf16", "int8")  # top-k wraps the all-reduce
  assert base.spellings() == ("none", "bf16", "fp16", "int8", "fp4", "topk", "topk_chunks")
  assert [base.name_of(codecs.parse(s)) for s in base.spellings()] == [
      "none", "bf16", "fp16", "int8", "fp4", "topk", "topk"]


@pytest.mark.parametrize("codec", [codecs.none(), codecs.bf16(), codecs.fp16(32),
                                   codecs.int8(64, True),
                                   codecs.topk_chunks(0.05, 1024, codecs.int8(128))])
def test_a_profiles_codec_string_reads_back_into_the_codec(codec):
  from jaxring._src.codecs import base
  assert base.from_repr(repr(codec)) == codec


@pytest.mark.parametrize("text", ["Nope()", "Int8(256)", "Int8(block_size=len('x'))", "Int8(",
                                  "os.system('x')"])
def test_from_repr_refuses_what_is_no_codecs_repr(text):
  from jaxring._src.codecs import base
  with pytest.raises(ValueError, match="not a codec's repr"):
    base.from_repr(text)


def test_a_registered_codec_is_parsed_swept_and_read_back(toy):
  from jaxring._src.codecs import base
  assert codecs.parse("toy:2") == toy(2)
  assert base.sweep() == ("none", "bf16", "int8", "topk", "toy")
  assert base.sweep(per_hop=True)[-1] == "toy" and "toy" in base.spellings()
  assert "toy[:bits]" in base.grammar()
  assert base.from_repr(repr(toy(2))) == toy(2) and base.name_of(toy(2)) == "toy"


def _codecs_option(main, argv, capsys, monkeypatch):
  """The ``--codecs`` (or ``--compression``) entry of a command's ``--help``, unwrapped."""
  monkeypatch.setenv("COLUMNS", "2000")
  with pytest.raises(SystemExit):
    main([*argv, "--help"])
  out = capsys.readouterr().out
  start = max(out.find("\n  --codecs "), out.find("\n  --compression "))
  return out[start:].split("\n  -")[1].replace("\n", " ")


@pytest.mark.parametrize("command", ["calibrate", "simulate", "bench cluster", "cluster_worker",
                                     "fsdp", "fsdp_worker", "convergence", "collectives"])
def test_a_registered_codec_appears_in_every_commands_defaults_and_help(command, toy, capsys,
                                                                         monkeypatch):
  import importlib
  module = {"calibrate": "calibrate", "simulate": "simulate.cli", "bench cluster": "bench.cluster"
            }.get(command, f"bench.{command}")
  mod = importlib.import_module(f"jaxring._src.tools.{module}")
  main = (lambda argv: mod._parser().parse_args(argv)) if hasattr(mod, "_parser") else mod.main
  argv = {"cluster_worker": ["--mode", "jax"], "fsdp_worker": ["--part", "train"]}.get(command, [])
  line = _codecs_option(main, argv, capsys, monkeypatch)
  assert "toy[:bits]" in line, line                     # the help names the registered spellings
  if command != "collectives":                          # its default is none, not a sweep
    assert "toy)" in line or "toy;" in line, line       # ... and the default sweep has it
