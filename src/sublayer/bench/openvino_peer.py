"""OpenVINO rows of ``sublayer bench --jobs`` (``--only ov-embed,ov-decode``; ``--ov-env DIR`` for the peer).

OpenVINO runs in a process of its own (:mod:`sublayer.bench.openvino_worker`) with the python of a side
environment (``benchmarks/peers_env_openvino.sh``: a venv with openvino, openvino-genai, openvino-tokenizers and
optimum-intel), driven between the other implementations' calls in the same interleaved rounds; each call's wall
time includes its round trip (a short JSON line each way; inputs are sent once, before the timed calls). Models
are exported to OpenVINO IR by optimum-intel (``optimum-cli export openvino``) from the same HF folders our models
load, once, beside them. Every OpenVINO model is compiled with ``INFERENCE_PRECISION_HINT`` f32 or bf16,
``INFERENCE_NUM_THREADS`` = torch's threads and ``PERFORMANCE_HINT`` LATENCY; the other properties are OpenVINO's
defaults, and the rows report the ones that change results (KV cache precision, dynamic quantization).

* ``ov-embed``: MiniLM (``model``, e.g. all-MiniLM-L6-v2; random weights of its shape without it), 64 x 128 right
  padded (lengths 32..128), sentence embeddings (hidden states, then mean pooling): ``fast_inference`` fp32 / bf16 /
  int8 ``.embed``, HF ``BertModel`` fp32, bf16 weights and bf16 autocast, OpenVINO f32 and bf16 (IR exported with
  fp32 weights). Every implementation's worst token cosine to HF fp32's hidden states (real tokens) is reported; the
  last row sets the fastest of ours against the fastest peer, among those at min token cosine >= :data:`MIN_COS`.
* ``ov-decode``: GPT-2 124M shape (random weights, the ``decode`` job's folder), prompt 32 + 32 greedy tokens,
  batch 1 and 8: ``generate`` of our fp32 model and of ``fast_inference`` bf16 / int8 against
  ``openvino_genai.LLMPipeline`` (token ids in through ``TokenizedInputs``, no tokenizer; end token ignored) on IR
  with fp32 weights at f32 and bf16 precision and on IR with int8 weights (``--weight-format int8``: nncf's
  per-channel asymmetric int8) at f32 and bf16 precision, and CTranslate2 int8. Each row's fraction of tokens equal
  to our fp32 ones. Every call gets a prompt it has not seen (the same one for every engine at that call): GenAI
  keeps earlier prompts' KV caches (its prefix cache), and a benchmark that repeated one prompt would time its
  prefill only once.

Without the side environment the OpenVINO columns are left out and each row says how to build it. ``quick``: tiny
shapes, the same rows (the test suite runs them).
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models import Bert, fast_inference
from .harness import Row, SideEnv, bert_batch, bert_model, ct2_greedy, cycled, mean_pool, time_interleaved
from .llama import LlamaCpp

__all__ = ["MIN_COS", "OV_ENV", "OpenVino", "decode_rows", "embed_rows", "export_ir", "ov_env", "ov_versions", "use_ov_env"]

MIN_COS = 0.999  # the accuracy bar of the embedding's "best" row: min token cosine to HF fp32
WEIGHT_FORMATS = ("fp32", "int8")
# the OpenVINO side environment (benchmarks/peers_env_openvino.sh; ``sublayer bench --ov-env DIR`` names the folder)
OV_ENV = SideEnv(".peers-env-ov", "peers_env_openvino.sh", "ov env", "OpenVINO peers environment")
use_ov_env, ov_env, ov_versions = OV_ENV.use, OV_ENV.path, OV_ENV.versions


def export_ir(folder: Path, task: str, weight_format: str, env: Path) -> Path:
    """optimum-intel's OpenVINO IR of the HF ``folder`` for ``task`` (``feature-extraction``,
    ``text-generation-with-past``) with ``weight_format`` weights (fp32, int8), made once beside it with the
    ``optimum-cli`` of the peers environment ``env``.

    Raises:
        ValueError: ``weight_format`` is not fp32 or int8. RuntimeError: the export failed (its output).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be fp32 or int8, got {weight_format!r}")
    out = folder.parent / f"{folder.name}-ov-{weight_format}"
    if not (out / "openvino_model.xml").is_file():
        cmd = [str(env / "bin" / "optimum-cli"), "export", "openvino", "--model", str(folder), "--task", task,
               "--library", "transformers", "--weight-format", weight_format, str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not (out / "openvino_model.xml").is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"optimum-cli export openvino --weight-format {weight_format} failed ({last}):\n"
                               f"{done.stdout[-1500:]}{done.stderr[-3000:]}")  # fmt: skip
    return out


class OpenVino(LlamaCpp):
    """OpenVINO in a worker process (:mod:`sublayer.bench.openvino_worker`) run by the peers environment's
    python: encoders (``load_encoder``, ``set_input``, ``embed``, ``hidden``) and GenAI pipelines (``load_llm``,
    ``generate``)."""

    WORKER, NAME = "openvino_worker.py", "OpenVINO"

    def load_ir(self, op: str, key: str, path: Path, *, precision: str, threads: int) -> dict:
        """The worker's ``op`` (``load_encoder``, ``load_llm``) on the IR folder ``path``: its compiled properties."""
        return self.ask(op=op, key=key, path=str(path), precision=precision, threads=threads)["properties"]

    def hidden(self, key: str) -> torch.Tensor:
        with tempfile.TemporaryDirectory() as tmp:
            self.ask(op="hidden", key=key, out=f"{tmp}/h.npy")
            return torch.from_numpy(np.load(f"{tmp}/h.npy"))


def _ov_extras(row: Row, peer: str | None, props: dict | None, note: str | None) -> None:
    """OpenVINO's extras of a row: the properties that change results of ``peer``'s compiled model (``props``,
    where it was compiled) and ``note`` (why OpenVINO did not run)."""
    if props is not None:
        keep = ("KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "INFERENCE_PRECISION_HINT")
        row.extra[f"{peer} compiled"] = ", ".join(f"{k} {v}" for k, v in props.items() if k in keep)
    if note:
        row.extra["OpenVINO"] = note


def _bert_folder(quick: bool, model: Path | None, work: Path) -> tuple[Path, str]:
    """(a HF BERT folder, its name): ``model``, or random weights of MiniLM's shape (tiny: quick) saved once."""
    if model is not None:
        return Path(model), Path(model).name
    bert, name = bert_model(quick)
    folder = Path(work) / f"bert-random-l{bert.config.n_layers}-d{bert.config.d_model}"
    if not (folder / "config.json").is_file():
        bert.to_hf().save_pretrained(folder)
    return folder, name


def embed_rows(quick: bool, reps: int, work: Path, model: Path | None = None, *,
               log: Callable[[str], None] = print) -> list[Row]:  # fmt: skip
    """MiniLM embeddings: ours fp32 / bf16 / int8 against HF and OpenVINO f32 / bf16 (see the module doc)."""
    import transformers

    folder, name = _bert_folder(quick, model, work)
    ours = Bert.from_pretrained(folder).eval()
    ids, mask, shape = bert_batch(quick, ours.config.vocab_size)
    b = ids.shape[0]
    mine = {"fp32": fast_inference(ours, dtype=torch.float32), "bf16": fast_inference(ours, dtype=torch.bfloat16),
            "int8": fast_inference(ours, quantize="int8")}  # fmt: skip
    hf = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    hf_bf16 = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False, dtype=torch.bfloat16).eval()

    def hf_hidden(m, autocast: bool = False) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return m(input_ids=ids, attention_mask=mask).last_hidden_state

    hidden: dict[str, Callable[[], torch.Tensor]] = {f"sublayer {k}": (lambda m=m: m(ids, mask)) for k, m in mine.items()}
    hidden |= {"HF fp32": lambda: hf_hidden(hf), "HF bf16 weights": lambda: hf_hidden(hf_bf16),
               "HF bf16 autocast": lambda: hf_hidden(hf, True)}  # fmt: skip
    fns: dict[str, Callable[[], object]] = {f"sublayer {k}": (lambda m=m: m.embed(ids, mask)) for k, m in mine.items()}
    fns |= {k: (lambda h=h: mean_pool(h(), mask)) for k, h in hidden.items() if k.startswith("HF")}  # their pooling
    props: dict[str, dict] = {}

    def setup(ov: OpenVino, env: Path) -> None:
        ir = export_ir(folder, "feature-extraction", "fp32", env)
        for p in ("f32", "bf16"):
            props[p] = ov.load_ir("load_encoder", p, ir, precision=p, threads=torch.get_num_threads())
            ov.ask(op="set_input", key=p, ids=ids.tolist(), mask=mask.tolist())

    ov, note = OV_ENV.start(OpenVino, Path(work) / "openvino-worker.log", setup, log)
    with ov or contextlib.nullcontext():
        for p in props if ov is not None else ():
            fns[f"OpenVINO {p}"] = lambda p=p: ov.ask(op="embed", key=p)
            hidden[f"OpenVINO {p}"] = lambda p=p: ov.hidden(p)
        real = mask.bool()
        ref = hidden["HF fp32"]().float()[real]
        cos = {k: float(F.cosine_similarity(h().float()[real], ref, dim=-1).min()) for k, h in hidden.items()}
        res = time_interleaved(fns, reps, 1)
    rows = []
    for dt, peer, others in (("fp32", "OpenVINO f32", ("HF fp32",)),
                             ("bf16", "OpenVINO bf16", ("HF bf16 weights", "HF bf16 autocast", "HF fp32")),
                             ("int8", "OpenVINO bf16", ("HF fp32",))):  # fmt: skip
        row = Row(f"MiniLM embedding vs OpenVINO ({name}): sublayer {dt}", shape, dt, "embed",
                  base=peer if peer in res else "HF fp32", work=float(b), unit="seq")  # fmt: skip
        names = {"sublayer": f"sublayer {dt}", **{k: k for k in (peer, *others)}}
        row.fill({k: res[v] for k, v in names.items() if v in res})
        row.extra |= {f"{v} min token cos vs HF fp32": round(cos[v], 5) for v in names.values() if v in cos}
        _ov_extras(row, peer, props.get(peer.split()[-1]), note)
        rows.append(row)
    ok = {k: res[k].ms for k in res if cos[k] >= MIN_COS}
    best_ours = min((k for k in ok if k.startswith("sublayer")), key=ok.get, default=None)
    best_peer = min((k for k in ok if not k.startswith("sublayer")), key=ok.get, default=None)
    row = Row(f"MiniLM embedding ({name}): best at min token cos >= {MIN_COS}", shape, "best", "embed",
              base=best_peer or "none", work=float(b), unit="seq")  # fmt: skip
    row.fill({k: res[v] for k, v in (("sublayer", best_ours), (best_peer, best_peer)) if v})
    row.extra |= {"sublayer setting": best_ours, "best peer": best_peer,
                  "their min token cos": f"{cos.get(best_ours, float('nan')):.5f} / {cos.get(best_peer, float('nan')):.5f}"}
    row.extra["below the bar"] = ", ".join(f"{k} {v:.5f}" for k, v in cos.items() if v < MIN_COS) or "none"
    _ov_extras(row, None, None, note)
    rows.append(row)
    return rows


_OV_DECODE = {"OpenVINO GenAI f32": ("fp32", "f32"), "OpenVINO GenAI bf16": ("fp32", "bf16"),
              "OpenVINO GenAI int8": ("int8", "f32"), "OpenVINO GenAI int8 (bf16 precision)": ("int8", "bf16")}


def decode_rows(quick: bool, reps: int, work: Path, model=None, *, gpt2_decoding: Callable,
                ct2_generator: Callable, log: Callable[[str], None] = print) -> list[Row]:  # fmt: skip
    """Greedy GPT-2 decoding, batch 1 and 8: ours fp32 / bf16 / int8 against OpenVINO GenAI and CTranslate2 int8
    (see the module doc). ``gpt2_decoding(quick, work)``: the ``decode`` job's (config, prompt length, new tokens,
    HF folder, our GPT2, shape label); ``ct2_generator(folder, "int8")``: CTranslate2's int8 generator on it, or
    None (those of :mod:`sublayer.bench.jobs`, passed in: that module runs these rows)."""
    cfg, prompt, new, folder, ours, shape = gpt2_decoding(quick, work)
    mine = {"fp32": ours, "bf16": fast_inference(ours, dtype=torch.bfloat16), "int8": fast_inference(ours, quantize="int8")}
    ct2 = ct2_generator(folder, "int8")
    threads = torch.get_num_threads()
    props: dict[str, dict] = {}

    def setup(ov: OpenVino, env: Path) -> None:
        irs = {w: export_ir(folder, "text-generation-with-past", w, env) for w in WEIGHT_FORMATS}
        for k, (w, p) in _OV_DECODE.items():
            props[k] = ov.load_ir("load_llm", k, irs[w], precision=p, threads=threads)

    ov, note = OV_ENV.start(OpenVino, Path(work) / "openvino-worker.log", setup, log)
    rows = []
    with ov or contextlib.nullcontext():
        for b in (1, 8):
            # a new prompt at every call (the warm-up's, then one per round), the same for every engine
            prompts = [torch.randint(0, cfg.vocab_size - 1, (b, prompt), generator=torch.Generator().manual_seed(s))
                       for s in range(b, b + 16 * (reps + 1), 16)]  # fmt: skip
            fns: dict[str, Callable[[], object]] = {
                f"sublayer {k}": cycled(prompts, lambda ids, m=m: m.generate(ids, new)[:, prompt:])
                for k, m in mine.items()}  # fmt: skip
            if ov is not None:
                fns |= {k: cycled(prompts, lambda ids, k=k: ov.generate(k, ids.tolist(), new)) for k in _OV_DECODE}
            if ct2 is not None:
                def ct2_call(ids: torch.Tensor) -> torch.Tensor:
                    return torch.tensor(ct2_greedy(ct2, [[f"t{i}" for i in r] for r in ids.tolist()], new))

                fns["CTranslate2 int8"] = cycled(prompts, ct2_call)
            outs = {k: torch.as_tensor(f()) for k, f in fns.items()}  # the warm-up, on prompts[0]
            res = time_interleaved(fns, reps, 0)
            ref = outs["sublayer fp32"]
            int8_peer = min((k for k in _OV_DECODE if "int8" in k and k in res), key=lambda k: res[k].ms, default=None)
            for dt, peer, others in (("fp32", "OpenVINO GenAI f32", ()),
                                     ("bf16", "OpenVINO GenAI bf16", ()),
                                     ("int8", int8_peer, tuple(k for k in (*_OV_DECODE, "CTranslate2 int8")
                                                               if "int8" in k and k != int8_peer))):  # fmt: skip
                base = peer if peer in res else "CTranslate2 int8" if dt == "int8" and ct2 is not None else "none"
                row = Row(f"GPT-2 greedy decoding vs OpenVINO GenAI, batch {b}", shape, dt, "generate", base=base,
                          work=float(b * new), unit="tok")  # fmt: skip
                names = {"sublayer": f"sublayer {dt}", **{k: k for k in (peer, *others) if k}}
                row.fill({k: res[v] for k, v in names.items() if v in res})
                row.extra |= {f"{v} same as our fp32": round(float((outs[v] == ref).float().mean()), 3)
                              for v in names.values() if v in outs and v != "sublayer fp32"}  # fmt: skip
                _ov_extras(row, peer, props.get(peer), note)
                rows.append(row)
    return rows
