"""`sublayer bench`'s fused-loss rows on tiny sizes (the timings themselves are not tested)."""

from __future__ import annotations

from sublayer.bench.loss import bench_loss


def test_quick_rows_time_both_sides_and_report_saved_bytes():
    head, step = bench_loss(quick=True, reps=1, warmup=0)
    for r in (head, step):
        assert r.times_ms["eager"] > 0 and r.times_ms["sublayer"] > 0
    assert head.times_ms["sublayer grad_in_forward"] > 0
    assert head.extra["saved ratio"] < 0.3  # h rows and one log-sum-exp per row, no logits
    assert head.extra["saved ratio grad_in_forward"] > head.extra["saved ratio"]  # it holds dW from forward on
    assert step.extra["saved MiB sublayer"] < step.extra["saved MiB eager"]
