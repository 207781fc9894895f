"""``sublayer bench --jobs --only llama,llama-train --quick``: the Llama rows on tiny shapes, with and without the
llama.cpp peers environment (the timings themselves are not tested)."""

from __future__ import annotations

import json

import pytest

from sublayer.bench import jobs, llama

pytest.importorskip("transformers")  # the HF peer of every row


@pytest.mark.filterwarnings("ignore")
def test_quick_llama_rows_without_the_peers_env_time_ours_and_hf_and_say_how_to_build_llama_cpp(tmp_path, monkeypatch):
    llama.use_peers_env(None)
    monkeypatch.chdir(tmp_path)  # no .peers-env here: llama.cpp is left out, never built
    lines: list[str] = []
    rows = jobs.run_jobs(quick=True, reps=1, only="llama,llama-train", work=tmp_path / "work", report=tmp_path,
                         log=lines.append)  # fmt: skip
    decode, (train,) = rows[:-1], rows[-1:]
    assert len(decode) == 2 * 4  # batch 1 and 8 x (Llama.generate, fast_inference fp32 / bf16 / int8)
    for r in decode:
        assert "no peers environment" in r.extra["llama.cpp"] and "benchmarks/peers_env.sh" in r.extra["llama.cpp"]
        assert not any(k.startswith("llama.cpp") for k in r.times_ms)
        assert r.times_ms["HF fp32"] > 0
        if "sublayer" in r.times_ms:  # fast_inference of a Llama may not exist yet: then the row says so
            assert r.extra["same tokens as HF fp32"] is True or r.dtype != "fp32"
        else:
            assert "not available" in r.extra["sublayer"]
    generate = [r for r in decode if r.case.endswith("Llama.generate")]
    assert len(generate) == 2 and all(r.extra["same tokens as HF fp32"] is True for r in generate)
    assert all(r.ratio() is not None for r in generate)  # ours against HF fp32 (the base without llama.cpp)
    assert train.times_ms["sublayer"] > 0 and train.times_ms["HF"] > 0
    assert float(train.extra["|loss - HF loss|"]) < 1e-5 and train.extra["dropout"] == 0.0
    (path,) = tmp_path.glob("llama-*.md")
    md = path.read_text()
    assert "Llama (SmolLM-135M shape) vs llama.cpp and HF" in md and md.count("\n| Llama ") == len(rows)
    assert any(ln.startswith("wrote ") for ln in lines)


def test_tokenizer_has_exactly_vocab_size_entries_and_falls_back_to_bytes(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    llama.write_tokenizer(tmp_path, 263)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 263
    assert tok.token_to_id("<0x41>") == 3 + 0x41 and tok.token_to_id("\u2581t2") == 262
    ids = tok.encode("hi A").ids
    assert all(3 <= i <= 259 for i in ids)  # no merges: every character through its UTF-8 bytes (or ▁)
    assert tok.decode(ids) == "hi A"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_bad_tokenizer_size_and_gguf_type(tmp_path):
    rule = r"vocab_size must be >= 260 \(3 specials, 256 bytes, the word start\), got 100"
    with pytest.raises(ValueError, match=rule):
        llama.write_tokenizer(tmp_path, 100)
    with pytest.raises(ValueError, match="outtype must be one of f32, q8_0, bf16, f16, got 'q4_0'"):
        llama.gguf_file(tmp_path, "q4_0", tmp_path)


def test_only_the_named_jobs_run_the_llama_ones():
    assert set(jobs.DEFAULT_JOBS) | {"llama", "llama-train", "gpt2-llamacpp", "ov-embed", "ov-decode"} == set(jobs.JOBS)
    assert not any(n.startswith(("llama", "ov-", "gpt2-")) for n in jobs.DEFAULT_JOBS)


def test_the_gpt2_llama_cpp_job_without_the_peers_env_says_how_to_build_it(tmp_path, monkeypatch):
    llama.use_peers_env(None)
    monkeypatch.chdir(tmp_path)  # no .peers-env here: llama.cpp, the job's only peer, is missing
    with pytest.raises(ValueError, match=r"gpt2-llamacpp needs llama.cpp \(--peers-env DIR\): no peers environment at "
                       r"\.peers-env \(build it: benchmarks/peers_env.sh \.peers-env\)"):  # fmt: skip
        jobs.run_jobs(quick=True, reps=1, only="gpt2-llamacpp", work=tmp_path / "work")


@pytest.mark.skipif(not llama.PEERS.ready(llama.peers_env()), reason="no llama.cpp peers env (benchmarks/peers_env.sh)")
@pytest.mark.filterwarnings("ignore")
def test_llama_cpp_decodes_the_converted_ggufs_with_hf_fp32_tokens(tmp_path):
    rows = jobs.run_jobs(quick=True, reps=1, only="llama", work=tmp_path / "work")
    assert len(rows) == 8
    for r in rows:
        assert "llama.cpp" not in r.extra
        assert r.times_ms[r.base] > 0 and r.base.startswith("llama.cpp")
    fp32 = [r for r in rows if r.case.endswith("Llama.generate")]
    assert all(r.extra["llama.cpp f32 fraction equal to HF fp32"] == 1.0 for r in fp32)
    assert {r.base for r in rows} == {"llama.cpp f32", "llama.cpp bf16", "llama.cpp q8_0"}


@pytest.mark.skipif(not llama.PEERS.ready(llama.peers_env()), reason="no llama.cpp peers env (benchmarks/peers_env.sh)")
@pytest.mark.filterwarnings("ignore")
def test_llama_cpp_decodes_the_gpt2_folder_converted_with_our_fp32_tokens(tmp_path):
    rows = jobs.run_jobs(quick=True, reps=1, only="gpt2-llamacpp", work=tmp_path / "work")
    assert [(r.case, r.dtype) for r in rows] == [
        (f"GPT-2 greedy decoding, batch {b} vs llama.cpp {t}", dt)
        for b in (1, 8) for dt, t in (("fp32", "f32"), ("bf16", "f16"), ("bf16", "bf16"))]  # fmt: skip
    for r in rows:
        assert r.times_ms[r.base] > 0 and r.times_ms["sublayer"] > 0 and r.ratio() is not None
    fp32 = [r for r in rows if r.dtype == "fp32"]
    assert all(r.extra["llama.cpp f32 same tokens as our fp32"] for r in fp32)
    assert not any("fp32 same tokens as our fp32" in r.extra for r in fp32)
    assert all(isinstance(r.extra[f"{r.base} same tokens as our fp32"], bool) for r in rows)
