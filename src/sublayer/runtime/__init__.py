"""``sublayer.runtime``: how models execute, written once for every model.

Model-agnostic pieces that the model definitions (:mod:`sublayer.models`) use:

* :mod:`.padding_free` — when a padded batch runs as packed rows (the descriptor itself,
  :class:`sublayer.functional.packing.PackedBatch`, flows through the models' own blocks);
* :mod:`.rules` — when any fast path may replace the modules' own forwards (not sharded, no hooks);
* :mod:`.weights` — prepared weights (packed fp32 panels, the float16 greedy head, int8 with scales) and the one
  cache that derives them from a module's parameters and notices every change;
* :mod:`.decoding` — static KV caches with row tables, the decoding attention, the one-call decoder step;
* :mod:`.generation` — the generation loops (greedy, sampling, beam search, eos, left padding) over a model's step.
"""
