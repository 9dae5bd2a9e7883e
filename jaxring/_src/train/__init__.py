"""Data-parallel training: the train-step decorator, reduced ``value_and_grad``, ``TrainState``,
the loop, checkpoints and metrics. Public as :mod:`jaxring.train` (re-exports only)."""
