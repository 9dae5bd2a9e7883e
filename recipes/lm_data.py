"""Text for the LM recipe, made on the spot: no download, nothing committed.

``"markov"`` (the default) is a seeded source with a known entropy rate: a lexicon of pseudo-words
(64 words of 2-7 letters drawn from a skewed distribution) and a word-level Markov chain in which
every word has 4 possible successors. The text is the chain's words separated by spaces, one
token per character. Inside a word every letter after the first few is determined, so the unigram
entropy (2.8 nats/char) is far above what a model that reads the previous word can reach: the
chain's entropy rate, computed exactly by :meth:`MarkovText.entropy_rate` (nats per character), is
the floor no model can beat.

``"stdlib"`` is real text shipped with Python: the source code of a few standard-library modules
(read through :mod:`inspect`), one token per byte. It differs between Python versions, so its
figures are comparable only on one installation.

Both return ``(num_sequences, context + 1)`` int32 token arrays: a model reads ``[:, :-1]`` and
predicts ``[:, 1:]``. :func:`batches` serves them through :class:`jaxring.train.BatchIterator`
(deterministic per seed, each process its slice of every global batch, checkpointable position).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import numpy as np

ALPHABET = " abcdefghijklmnopqrstuvwxyz"  # token i is ALPHABET[i]; the space is 0
MARKOV_VOCAB = 32                          # 27 symbols, padded to a multiple of 8 (FSDP splits)
STDLIB_MODULES = ("argparse", "collections", "dataclasses", "inspect", "json.decoder", "logging",
                  "pathlib", "pickle", "textwrap", "typing")


@dataclasses.dataclass(frozen=True)
class MarkovText:
  """A word-level Markov chain over a generated lexicon, rendered as characters.

  Example:
    >>> source = MarkovText(seed=0)
    >>> source.decode(source.sample(60, np.random.default_rng(1)))[:24]
    'ntf eksy nnczna tyn umss'
    >>> round(source.entropy_rate(), 3)  # nats per character; the unigram entropy is ~2.8
    0.167
  """

  seed: int = 0
  num_words: int = 64
  successors: int = 4
  min_length: int = 2
  max_length: int = 7

  @functools.cached_property
  def lexicon(self) -> tuple[np.ndarray, ...]:
    """The words, each an array of letter tokens (1..26), all distinct."""
    rng = np.random.default_rng((self.seed, 0))
    letter_p = 1.0 / np.arange(1, 27) ** 0.8   # Zipf-like letter frequencies
    letter_p = rng.permutation(letter_p / letter_p.sum())
    words, seen = [], set()
    while len(words) < self.num_words:
      n = int(rng.integers(self.min_length, self.max_length + 1))
      word = tuple(int(c) for c in rng.choice(26, n, p=letter_p) + 1)
      if word not in seen:
        seen.add(word)
        words.append(np.asarray(word, np.int32))
    return tuple(words)

  @functools.cached_property
  def transitions(self) -> np.ndarray:
    """``(num_words, num_words)`` row-stochastic: each word has ``successors`` possible next words
    (one of them the next word of the lexicon, so that the chain reaches every word)."""
    rng = np.random.default_rng((self.seed, 1))
    n, k = self.num_words, self.successors
    p = np.zeros((n, n))
    for i in range(n):
      others = rng.choice(np.delete(np.arange(n), (i + 1) % n), k - 1, replace=False)
      p[i, np.concatenate([[(i + 1) % n], others])] = rng.dirichlet(np.ones(k))
    return p

  def stationary(self) -> np.ndarray:
    """The chain's stationary distribution (power iteration of the lazy chain, which has the same
    one and is aperiodic)."""
    lazy = 0.5 * (self.transitions + np.eye(self.num_words))
    pi = np.full(self.num_words, 1.0 / self.num_words)
    for _ in range(10_000):
      nxt = pi @ lazy
      if np.abs(nxt - pi).max() < 1e-15:
        break
      pi = nxt
    return pi / pi.sum()

  def entropy_rate(self) -> float:
    """Nats per character of the stationary text: the entropy of a word given the previous one,
    over the characters a word takes (its letters and the space after it). Spaces delimit words,
    so the characters determine the words and the two rates agree (renewal-reward)."""
    p, pi = self.transitions, self.stationary()
    with np.errstate(divide="ignore", invalid="ignore"):
      h = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    chars = np.asarray([len(w) + 1 for w in self.lexicon], np.float64)
    return float(pi @ h / (pi @ chars))

  def sample(self, num_chars: int, rng: np.random.Generator) -> np.ndarray:
    """``num_chars`` tokens of the chain's text, from a word drawn from the stationary law."""
    cumulative = np.cumsum(self.transitions, axis=1)
    word = int(rng.choice(self.num_words, p=self.stationary()))
    pieces, total = [], 0
    draws = iter(rng.random(num_chars + 1))  # a word takes >= 3 characters: enough draws
    while total < num_chars:
      pieces.append(self.lexicon[word])
      pieces.append(np.zeros(1, np.int32))     # the space
      total += len(self.lexicon[word]) + 1
      word = min(int(np.searchsorted(cumulative[word], next(draws), side="right")),
                 self.num_words - 1)
    return np.concatenate(pieces)[:num_chars]

  @staticmethod
  def decode(tokens) -> str:
    return "".join(ALPHABET[int(t)] for t in tokens)


def stdlib_bytes() -> np.ndarray:
  """The source text of :data:`STDLIB_MODULES`, as byte tokens (0..255)."""
  import importlib

  text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in STDLIB_MODULES)
  return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def unigram_entropy(tokens: np.ndarray) -> float:
  """Nats per token of the tokens' own frequencies: what a model that ignores context reaches.

  Example:
    >>> unigram_entropy(np.array([0, 1, 0, 1]))  # log 2
    0.6931471805599453
  """
  counts = np.bincount(np.ravel(tokens)).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def sequences(dataset: str, split: str, num_sequences: int, context: int,
              seed: int = 0) -> np.ndarray:
  """``(num_sequences, context + 1)`` int32 tokens of ``split`` (``"train"`` or ``"val"``).

  ``markov``: train and val are two independent streams of the same chain (same lexicon and
  transitions, different draws). ``stdlib``: the bytes are cut into windows; the last tenth of them
  is val, and ``num_sequences`` larger than the text holds is refused.

  Example:
    >>> sequences("markov", "train", 4, context=8).shape
    (4, 9)
  """
  if split not in ("train", "val"):
    raise ValueError(f"split must be 'train' or 'val', got {split!r}")
  length = context + 1
  if dataset == "markov":
    rng = np.random.default_rng((seed, 2, split == "val"))
    stream = MarkovText(seed=seed).sample(num_sequences * length, rng)
    return stream.reshape(num_sequences, length).astype(np.int32)
  if dataset == "stdlib":
    stream = stdlib_bytes()
    windows = stream[:len(stream) // length * length].reshape(-1, length)
    cut = windows.shape[0] - max(1, windows.shape[0] // 10)
    part = windows[:cut] if split == "train" else windows[cut:]
    if num_sequences > part.shape[0]:
      raise ValueError(f"stdlib text holds {part.shape[0]} {split} sequences of {length} bytes, "
                       f"asked for {num_sequences}")
    return np.ascontiguousarray(part[:num_sequences])
  raise ValueError(f"dataset must be 'markov' or 'stdlib', got {dataset!r}")


def vocab_size(dataset: str) -> int:
  """Tokens the dataset uses, padded to a multiple of 8."""
  return {"markov": MARKOV_VOCAB, "stdlib": 256}[dataset]


def entropy_floor(dataset: str, seed: int = 0) -> float:
  """The source's entropy rate in nats per token where it is known (markov), else nan."""
  return MarkovText(seed=seed).entropy_rate() if dataset == "markov" else math.nan


def batches(tokens: np.ndarray, batch_size: int, seed: int = 0, **kw):
  """Endless shuffled global batches ``{"tokens": int32 [batch_size // processes, context + 1]}``
  of this process (:class:`jaxring.train.BatchIterator`)."""
  from jaxring.train import BatchIterator

  return BatchIterator({"tokens": tokens}, batch_size, seed=seed, **kw)
