"""The loop of the benchmark's worker processes (:class:`sublayer.bench.harness.Worker`), which run with another
environment's python and import this file from their own folder: json and sys only, never sublayer or torch.
Each request, a JSON line ``{"op": name, ...}`` on stdin, gets one JSON line on stdout: the worker's answer, or
``{"error": message}`` for an op the worker does not know or any exception. End of input ends it.
"""

import json
import sys


def serve(handle) -> None:
    """Answer every request on stdin with ``handle(request)``, a dict (None: an op it does not know)."""
    for line in sys.stdin:
        try:
            req = json.loads(line)
            ans = handle(req) or {"error": f"unknown op {req['op']!r}"}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the benchmark as its answer
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), flush=True)
