"""CTranslate2's ``Generator`` for the benchmark, in a process of its own (:class:`sublayer.bench.jobs.Ct2Generator`).

Run with the python of sublayer's environment; it imports ctranslate2 and :mod:`sublayer.bench.worker_loop` only,
whose JSON lines it answers:

* ``{"op": "load", "path": FOLDER, "compute_type": C, "threads": N}`` -> ``{"ok": true}``: the Generator loaded;
* ``{"op": "generate", "tokens": [[str]], "kw": {...}}`` (``generate_batch``'s arguments) -> ``{"ids": [[[int]]]}``:
  every result's ``sequences_ids``.
"""

from worker_loop import serve


def main() -> None:
    gen = None

    def load(req: dict) -> None:
        nonlocal gen
        import ctranslate2

        gen = ctranslate2.Generator(req["path"], device="cpu", compute_type=req["compute_type"],
                                    intra_threads=req["threads"])  # fmt: skip

    serve({"load": load,
           "generate": lambda req: {"ids": [r.sequences_ids for r in gen.generate_batch(req["tokens"], **req["kw"])]}})


if __name__ == "__main__":
    main()
