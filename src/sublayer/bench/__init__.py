"""``sublayer bench``: sublayer's paths timed beside the references they replace and the peers a user would pick."""

from .kernels import MALLOC_SETTINGS, QUICK_SHAPES, SHAPES, Row, Shape, main, run_bench

__all__ = ["MALLOC_SETTINGS", "QUICK_SHAPES", "SHAPES", "Row", "Shape", "main", "run_bench"]
