"""CTranslate2's ``Generator`` for the benchmark, in a process of its own (:class:`sublayer.bench.jobs.Ct2Generator`).

Run as ``python ct2_worker.py FOLDER COMPUTE_TYPE THREADS``; it imports ctranslate2 and json only. It answers JSON
lines on stdin, one JSON line each on stdout: first ``{"ok": true}`` once the Generator is loaded, then for
``{"tokens": [[str]], "kw": {...}}`` (``generate_batch``'s arguments) ``{"ids": [[[int]]]}``: every result's
``sequences_ids``. An error answers ``{"error": message}``; end of input ends it.
"""

import json
import sys


def main() -> None:
    out = sys.stdout
    try:
        import ctranslate2

        path, compute_type, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
        gen = ctranslate2.Generator(path, device="cpu", compute_type=compute_type, intra_threads=threads)
        out.write(json.dumps({"ok": True}) + "\n")
    except Exception as e:  # noqa: BLE001 - handed to the parent
        out.write(json.dumps({"error": repr(e)}) + "\n")
        return
    finally:
        out.flush()
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            ans = {"ids": [r.sequences_ids for r in gen.generate_batch(msg["tokens"], **msg["kw"])]}
        except Exception as e:  # noqa: BLE001 - handed to the parent
            ans = {"error": repr(e)}
        out.write(json.dumps(ans) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
