"""Per-element cost of the raw fused kernels vs the eager ops they replace (thread CPU time, so time spent
descheduled on a shared machine is not counted). Usage: python benchmarks/kernel_ns.py [rows] [cols]"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from sublayer import kernels


def per_elem_ns(fn, n: int, reps: int = 11) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return sorted(ts)[reps // 2] * 1e9 / n


def main() -> None:
    rows, cols = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (2048, 2048)))
    torch.set_num_threads(1)
    if not kernels.available():
        raise SystemExit(f"kernels unavailable: {kernels.build_error()}")
    ops = kernels.ops()
    n = rows * cols
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, cols).to(dt)
        print(f"--- {dt}, {rows}x{cols}, ns/element, 1 thread")
        print(f"copy                      {per_elem_ns(lambda: a.clone(), n):6.2f}")
        print(f"dropout  eager / fused    {per_elem_ns(lambda: F.dropout(a, 0.1), n):6.2f} / "
              f"{per_elem_ns(lambda: ops.act_fwd(a, None, 0, 0.1, 1, False), n):6.2f}")
        for name, act, ref in (("relu", 1, F.relu), ("gelu", 2, F.gelu), ("silu", 4, F.silu)):
            e = per_elem_ns(lambda: F.dropout(ref(a), 0.1), n)
            f = per_elem_ns(lambda: ops.act_fwd(a, None, act, 0.1, 1, False), n)
            print(f"{name}+dropout eager / fused {e:6.2f} / {f:6.2f}")
        w, b = torch.ones(cols), torch.zeros(cols)
        y = torch.randn(rows, cols).to(dt)
        e = per_elem_ns(lambda: F.layer_norm(a + F.dropout(y, 0.1), (cols,)), n)
        f = per_elem_ns(lambda: ops.add_norm_fwd(a, y, w, b, 1e-5, 0.1, 1, False, False), n)
        print(f"add+LN fwd eager / fused  {e:6.2f} / {f:6.2f}")


if __name__ == "__main__":
    main()
