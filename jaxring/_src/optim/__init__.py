"""Optimizers whose gradient reduction is compressed: momentum correction (DGC), compressed Adam,
and the guard that keeps a sparsifying codec away from optimizers it would break."""
