"""``sublayer bench --jobs --only ov-embed,ov-decode --quick``: the OpenVINO rows on tiny shapes, with and without
the OpenVINO peers environment (the timings themselves are not tested)."""

from __future__ import annotations

import pytest

from sublayer.bench import jobs, openvino_peer

pytest.importorskip("transformers")  # the HF peers of the embedding rows


@pytest.mark.filterwarnings("ignore")
def test_quick_rows_without_the_ov_env_time_ours_and_the_other_peers_and_say_how_to_build_it(tmp_path, monkeypatch):
    openvino_peer.use_ov_env(None)
    monkeypatch.chdir(tmp_path)  # no .peers-env-ov here: OpenVINO is left out, never built
    lines: list[str] = []
    rows = jobs.run_jobs(quick=True, reps=1, only="ov-embed,ov-decode", work=tmp_path / "work",
                         report=tmp_path / "ov.md", log=lines.append)  # fmt: skip
    embed, decode = rows[:4], rows[4:]
    assert [r.dtype for r in embed] == ["fp32", "bf16", "int8", "best"]
    assert [(r.case[-7:], r.dtype) for r in decode] == [(f"batch {b}", d) for b in (1, 8) for d in ("fp32", "bf16", "int8")]
    for r in rows:
        assert "no OpenVINO peers environment" in r.extra["OpenVINO"]
        assert "benchmarks/peers_env_openvino.sh" in r.extra["OpenVINO"]
        assert not any(k.startswith("OpenVINO") for k in r.times_ms)
        assert r.times_ms["sublayer"] > 0
    fp32, bf16 = embed[0], embed[1]
    assert fp32.base == "HF fp32" and fp32.extra["sublayer fp32 min token cos vs HF fp32"] > 0.9999
    assert {"HF bf16 weights", "HF bf16 autocast"} <= set(bf16.times_ms)
    best = embed[3]
    assert best.extra["sublayer setting"].startswith("sublayer ") and best.base == best.extra["best peer"]
    assert best.base.startswith("HF") and best.ratio() is not None
    assert all(r.base == "none" and r.ratio() is None for r in decode if r.dtype != "int8")
    md = (tmp_path / "ov.md").read_text()
    assert md.startswith("# sublayer vs OpenVINO and OpenVINO GenAI") and md.count("\n| MiniLM embedding") == 4
    assert any(ln.startswith("wrote ") for ln in lines)


def test_ov_env_folder_and_versions(tmp_path):
    try:
        openvino_peer.use_ov_env(tmp_path)
        assert openvino_peer.ov_env() == tmp_path
        assert openvino_peer.ov_versions() == {}
        (tmp_path / "versions.txt").write_text("openvino==2026.4.1\nopenvino-genai==2026.4.1.0\nnot a pair\n")
        assert openvino_peer.ov_versions() == {"ov env openvino": "2026.4.1", "ov env openvino-genai": "2026.4.1.0"}
    finally:
        openvino_peer.use_ov_env(None)
    assert openvino_peer.ov_env().name == ".peers-env-ov"


def test_bad_weight_format(tmp_path):
    with pytest.raises(ValueError, match="weight_format must be fp32 or int8, got 'int4'"):
        openvino_peer.export_ir(tmp_path, "feature-extraction", "int4", tmp_path)


@pytest.mark.skipif(not openvino_peer.OV_ENV.ready(openvino_peer.ov_env()),
                    reason="no OpenVINO peers env (benchmarks/peers_env_openvino.sh)")  # fmt: skip
@pytest.mark.filterwarnings("ignore")
def test_openvino_runs_the_exported_models_with_our_fp32_results(tmp_path):
    rows = jobs.run_jobs(quick=True, reps=1, only="ov-embed,ov-decode", work=tmp_path / "work")
    embed, decode = rows[:4], rows[4:]
    for r in rows:
        assert "OpenVINO" not in r.extra
    assert embed[0].base == "OpenVINO f32" and embed[0].extra["OpenVINO f32 min token cos vs HF fp32"] > 0.9999
    assert embed[1].base == "OpenVINO bf16" and "INFERENCE_PRECISION_HINT bf16" in embed[1].extra["OpenVINO bf16 compiled"]
    fp32 = [r for r in decode if r.dtype == "fp32"]
    assert all(r.base == "OpenVINO GenAI f32" and r.extra["OpenVINO GenAI f32 same as our fp32"] == 1.0 for r in fp32)
    assert all(r.base.startswith("OpenVINO GenAI int8") for r in decode if r.dtype == "int8")
