"""The loop of the benchmark's worker processes (:class:`sublayer.bench.harness.Worker`), which run with another
environment's python and import this file from their own folder: json and sys only, never sublayer or torch.
Each request, a JSON line ``{"op": name, ...}`` on stdin, gets one JSON line on stdout: the answer of the worker's
function for that op (``{"ok": true}`` where it gives no dict), or ``{"error": message}`` for an op the worker does
not know or any exception. End of input ends it.
"""

import json
import sys


def serve(ops: dict) -> None:
    """Answer every request on stdin with ``ops[request["op"]](request)``."""
    for line in sys.stdin:
        try:
            req = json.loads(line)
            ans = ops[req["op"]](req) if req["op"] in ops else {"error": f"unknown op {req['op']!r}"}
            ans = ans if isinstance(ans, dict) else {"ok": True}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the benchmark as its answer
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), flush=True)
