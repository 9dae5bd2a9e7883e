"""Algorithms: the planner decides, the engine executes; each algorithm is one file here,
registered on import (``base.register``)."""
from jaxring._src.algorithms import hierarchical as hierarchical
from jaxring._src.algorithms import ring as ring
