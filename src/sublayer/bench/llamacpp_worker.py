"""llama.cpp's greedy decoding for the Llama benchmark, in a process of its own.

Run by :mod:`sublayer.bench.llama` with the python of the peers environment (``benchmarks/peers_env.sh``: a venv
with ``llama-cpp-python`` built from source); it imports ``llama_cpp``, numpy and
:mod:`sublayer.bench.worker_loop` only, never sublayer or torch. It answers that loop's JSON lines:

* ``{"op": "versions"}`` -> ``{"llama-cpp-python": ..., "system_info": ...}``;
* ``{"op": "load", "key": K, "path": GGUF, "n_seq": S, "n_ctx": C, "threads": N}`` -> ``{"ok": true}``: a model
  and a context holding ``S`` sequences of ``C`` positions each, ``N`` threads;
* ``{"op": "generate", "key": K, "prompts": [[ids]] (S rows, same length), "new": M}`` -> ``{"tokens": [[ids]]}``:
  greedy decoding of all rows at once, llama.cpp's batched decoding (one ``llama_decode`` a step over every
  sequence, each its own ``seq_id``, as llama.cpp's ``batched`` example): the prompts in one batch, then M - 1
  steps; the argmax of each row's logits is its next token (no end token: M tokens a row).
"""

import ctypes

import llama_cpp as L
import numpy as np
from worker_loop import serve

_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda level, text, data: None)


class _Model:
    def __init__(self, path: str, n_seq: int, n_ctx: int, threads: int):
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_seq_max, cp.n_ctx = n_seq, n_seq * n_ctx
        cp.n_batch = cp.n_ubatch = n_seq * n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_seq * n_ctx, 0, n_seq)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        n = len(prompts[0])
        self._decode([(t, j, s, j == n - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])
        rows = [[self._argmax(s * n + n - 1)] for s in range(len(prompts))]
        for step in range(1, new):
            self._decode([(r[-1], n + step - 1, s, True) for s, r in enumerate(rows)])
            for s, r in enumerate(rows):
                r.append(self._argmax(s))
        return rows


def main() -> None:
    L.llama_log_set(_LOG, None)
    L.llama_backend_init()
    models: dict[str, _Model] = {}

    def load(req: dict) -> None:
        models[req["key"]] = _Model(req["path"], req["n_seq"], req["n_ctx"], req["threads"])

    serve({
        "versions": lambda req: {"llama-cpp-python": L.__version__,
                                 "system_info": L.llama_print_system_info().decode().strip()},
        "load": load,
        "generate": lambda req: {"tokens": models[req["key"]].generate(req["prompts"], req["new"])},
    })  # fmt: skip


if __name__ == "__main__":
    main()
