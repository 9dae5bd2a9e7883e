"""Optional dependencies: the one place that imports an extra's module and names what to install.

The core (collectives, codecs, ``train_step``, checkpoints) needs none of them. The extras of
``pyproject.toml``: ``mpi`` (mpich, mpi4py, mpi4jax: the MPI transport), ``data`` (Pillow,
simplejpeg, OpenCV: ``jaxring.data``'s decoders), ``plot`` (matplotlib: the benchmarks' PNGs),
``dali`` (NVIDIA DALI), ``test``, and ``all`` (mpi, data and plot).

Standard library only: the input pipeline's worker processes import this module without JAX.
"""
from __future__ import annotations

import importlib
import types


class MissingExtraError(ImportError):
  """An optional dependency is missing; the message names the extra that installs it."""


def install_hint(extra: str) -> str:
  """The command that installs ``extra``.

  Example:
    >>> install_hint("mpi")
    "pip install 'jaxring[mpi]'"
  """
  return f"pip install 'jaxring[{extra}]'"


def require(module: str, extra: str, needs: str, hint: str = "") -> types.ModuleType:
  """Imports ``module`` (dotted), or raises :class:`MissingExtraError` naming ``extra``.

  Args:
    module: what to import, e.g. ``"mpi4py.MPI"``.
    extra: the extra of ``pyproject.toml`` that installs it.
    needs: what needs it, e.g. ``"jaxring's MPI transport needs mpi4py and mpi4jax"``.
    hint: more to say after the install command (how to build an sdist, ...).

  Example:
    >>> cv2 = require("cv2", "data", "jaxring.data's JPEG decoder needs simplejpeg and OpenCV")
    >>> require("nothing", "plot", "plots need matplotlib")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    MissingExtraError: plots need matplotlib: pip install 'jaxring[plot]' (No module named ...)
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    more = f"; {hint}" if hint else ""
    raise MissingExtraError(f"{needs}: {install_hint(extra)}{more} ({e})",
                            name=getattr(e, "name", None) or module) from e
