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
