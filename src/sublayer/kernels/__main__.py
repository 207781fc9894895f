"""``python -m sublayer.kernels``: build (or load the cached) fused CPU kernels now and print their status.

Run it once after ``pip install sublayer`` (e.g. in a Dockerfile) so that no later process pays the first build.
Exit code 0 when the kernels are active, 1 when they are unavailable (the warning says why) or switched off
(``SUBLAYER_KERNELS=0``: nothing is built).
"""

import sys

from . import available, status

if __name__ == "__main__":
    ok = available()
    print(status())
    sys.exit(0 if ok else 1)
