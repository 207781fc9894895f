"""Decoding step times of fast_inference GPT-2 124M (random weights): bf16 batch 1, bf16 batch 8, int8 batch 8.

step = (time of generate(ids, 1 + N) - time of generate(ids, 1)) / N, prompt 32, N = 48; ROUNDS rounds (default 5),
the cases interleaved in each; prints the median. SAVE=path: torch.save the generated tokens (to compare runs).
Set OMP_WAIT_POLICY before Python starts to pick OpenMP's wait policy.
"""

import os
import statistics
import time

import torch

from sublayer.models import GPT2, GPT2Config, fast_inference

torch.set_num_threads(2)
torch.manual_seed(0)
cfg = GPT2Config(dropout=0.0, embd_dropout=0.0, attn_dropout=0.0)
model = GPT2(cfg).eval()
P, N = 32, 48
rounds = int(os.environ.get("ROUNDS", "5"))
engines = {"bf16": fast_inference(model, dtype=torch.bfloat16), "int8": fast_inference(model, quantize="int8")}
cases = [("bf16", 1), ("bf16", 8), ("int8", 8)]
ids = {b: torch.randint(0, cfg.vocab_size - 1, (b, P), generator=torch.Generator().manual_seed(b)) for b in (1, 8)}
with torch.inference_mode():
    toks = {(e, b): engines[e].generate(ids[b], N + 1) for e, b in cases}  # warm-up
    res = {c: [] for c in cases}
    for _ in range(rounds):
        for e, b in cases:
            g = engines[e].generate
            t0 = time.perf_counter()
            g(ids[b], 1)
            t1 = time.perf_counter()
            g(ids[b], N + 1)
            t2 = time.perf_counter()
            res[(e, b)].append(((t2 - t1) - (t1 - t0)) / N * 1e3)
policy = os.environ.get("OMP_WAIT_POLICY", "default")
for e, b in cases:
    v = res[(e, b)]
    print(f"{policy:8s} {e} b{b}: step median {statistics.median(v):.2f} ms  (all {' '.join(f'{x:.2f}' for x in v)})")
if os.environ.get("SAVE"):
    torch.save(toks, os.environ["SAVE"])
