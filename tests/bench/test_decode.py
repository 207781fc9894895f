"""``sublayer bench --decode`` (sublayer.bench_decode) in its quick form: rows, files, and the bytes each engine
is credited with per step."""

from __future__ import annotations

import json

import pytest
import torch

from sublayer import kernels
from sublayer.bench import decode as bench_decode


def test_bytes_read_per_engine():
    step, head = 1000, 400  # 600 bytes of layers
    assert bench_decode._bytes_read("HF generate", step, head) == 1000
    assert bench_decode._bytes_read("sublayer reference loop", step, head) == 1000
    assert bench_decode._bytes_read("sublayer GPT2.generate", step, head) == 700  # one row: int8 screening head
    assert bench_decode._bytes_read("sublayer GPT2.generate", step, head, rows=8) == 800  # 16-bit screen
    assert bench_decode._bytes_read("sublayer GPT2.generate", step, head, rows=8, int8_rows=True) == 700  # VNNI
    assert bench_decode._bytes_read("sublayer int8", step, head) == 250
    assert bench_decode._bytes_read("sublayer int8, head float", step, head) == 550
    assert bench_decode._bytes_read("CTranslate2 int8", step, head) == 250


@pytest.mark.filterwarnings("ignore")
def test_quick_run_writes_rows_with_equal_tokens(tmp_path):
    lines = []
    rows = bench_decode.run_decode_bench(
        tmp_path, quick=True, batches=(1,), reps=1, peers=False, translate=False,
        engines="sublayer GPT2.generate,sublayer reference loop,sublayer int8", log=lines.append,
    )  # fmt: skip
    gen = {r["engine"]: r for r in rows if "tok/s" in r}
    want = {"sublayer GPT2.generate", "sublayer reference loop", "sublayer int8", "sublayer int8, head float"}
    assert set(gen) == want
    assert all(r["tok/s"] > 0 and r["GB/s"] > 0 for r in gen.values())
    assert gen["sublayer reference loop"]["same as fp32"] == 1.0  # the fast path's tokens equal the reference's
    assert json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert "| 1 | sublayer GPT2.generate |" in (tmp_path / "decode.md").read_text()
    gemv = [r for r in rows if r.get("case", "").startswith("GEMV")]  # the LM head's GEMV at 1 and all threads
    if not kernels.available():  # switched off (SUBLAYER_KERNELS=0): no kernels' GEMVs to measure
        assert gemv == []
        return
    assert {r["threads"] for r in gemv} == {1, torch.get_num_threads()} and all(r["GB/s"] > 0 for r in gemv)
    assert {"torch F.linear", "sublayer skinny_linear int8", "read (torch sum)"} <= {r["engine"] for r in gemv}
    assert "| GEMV 8191x256 | 1 | 1 | read (torch sum) |" in (tmp_path / "decode.md").read_text()
