"""``sublayer bench``: sublayer's paths timed beside the references they replace and the peers a user would pick.

* :mod:`~sublayer.bench.harness`: interleaved timing, result rows, padded batches, and the markdown report (machine,
  versions, date, command) every suite writes with ``--report``;
* :mod:`~sublayer.bench.kernels`: the sub-layers (FFN, Add & Norm, encoder block, HF sub-modules, BERT inference)
  against eager PyTorch and ``torch.compile``, under both allocator settings (``sublayer bench``);
* :mod:`~sublayer.bench.jobs`: whole jobs (decoding, translation, training steps, int8, embeddings) against
  CTranslate2 and HF (``sublayer bench --jobs``; ``benchmarks/compare_revisions.py`` runs them for two revisions);
* :mod:`~sublayer.bench.decode`: decoding in detail: every engine's tokens/s and weight bandwidth
  (``sublayer bench --decode``);
* :mod:`~sublayer.bench.loss`: the fused LM-head loss (rows of ``sublayer bench``).
"""

from .kernels import MALLOC_SETTINGS, QUICK_SHAPES, SHAPES, Row, Shape, main, run_bench

__all__ = ["MALLOC_SETTINGS", "QUICK_SHAPES", "SHAPES", "Row", "Shape", "main", "run_bench"]
