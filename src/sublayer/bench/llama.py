"""Llama rows of ``sublayer bench --jobs``: a SmolLM-135M-shaped model against llama.cpp and HF (``--only llama``
for decoding, ``--only llama-train`` for the training step; ``--peers-env DIR`` for llama.cpp).

The model: :data:`SMOLLM_135M` (hidden 576, 30 layers, 9 heads, 3 key/value heads, intermediate 1536, vocab 49152,
tied embeddings, rope_theta 10000), random weights with the token embedding (also the LM head) scaled by
:data:`EMBED_SCALE`, so that the greedy token is far ahead of the next one and the same under any fp32 summation
order; saved once as a Hugging Face folder with a tokenizer built in code (:func:`write_tokenizer`: a
byte-fallback BPE of exactly ``vocab_size`` entries, which llama.cpp's converter reads as a llama vocabulary).

* ``llama`` (decoding): greedy, prompt 32 + 64 new tokens, batch 1 and batch 8, all implementations interleaved in
  one run per batch size: ``Llama.generate`` (fp32), ``fast_inference(model, dtype=..., quantize=...)`` fp32 /
  bf16 / int8, llama.cpp
  (``llama-cpp-python`` in the peers environment; GGUF f32, q8_0, bf16, f16 made by llama.cpp's converter from the
  HF folder; batch 8 as one ``llama_decode`` a step over 8 sequences) and HF ``generate`` with fp32 and bf16
  weights. Each row compares one precision: ours fp32 vs llama.cpp f32, int8 vs q8_0, bf16 vs bf16 (f16 and HF
  beside), with the ratio to HF and whether the tokens equal HF's fp32 ones.
* ``llama-train``: one AdamW step on 8 x 256 right-padded (lengths 102..256, ~70 % real tokens), dropout off:
  ``Llama.loss`` against HF ``LlamaForCausalLM(labels=)``, with the difference of their losses on the same weights.

llama.cpp runs in a process of its own (:mod:`sublayer.bench.llamacpp_worker`, with the peers environment's
python), driven between the other implementations' calls; each call's wall time includes its round trip (a JSON
line each way). Without the peers environment the llama.cpp columns are left out and the row says how to build it.
``quick``: tiny shapes, the same rows (the test suite runs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from ..models import Llama, LlamaConfig, fast_inference
from .harness import Row, SideEnv, Worker, adamw_step, padded_batch, time_interleaved

__all__ = [
    "EMBED_SCALE", "GGUF_TYPES", "PEERS", "QUICK", "SMOLLM_135M", "LlamaCpp", "decode_rows", "gguf_file", "gpt2_rows",
    "llama_folder", "peer_versions", "peers_env", "train_rows", "use_peers_env", "write_tokenizer",
]  # fmt: skip

SMOLLM_135M = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                   tie_word_embeddings=True, rope_theta=10000.0, eps=1e-5, max_positions=2048)  # fmt: skip
# tiny, with rows in whole q8_0 blocks of 32 (llama.cpp's converter keeps other rows in f16)
QUICK = dict(vocab_size=521, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, tie_word_embeddings=True,
             rope_theta=10000.0, eps=1e-5, max_positions=128)  # fmt: skip
EMBED_SCALE = 8.0  # the token embedding (and tied head) times this: peaked next-token distributions
GGUF_TYPES = ("f32", "q8_0", "bf16", "f16")
# the llama.cpp side environment (benchmarks/peers_env.sh; ``sublayer bench --peers-env DIR`` names the folder)
PEERS = SideEnv(".peers-env", "peers_env.sh", "peers env", "peers environment", "; minutes: llama.cpp compiles")
use_peers_env, peers_env, peer_versions = PEERS.use, PEERS.path, PEERS.versions
_SPECIALS = ("<unk>", "<s>", "</s>")


def write_tokenizer(folder: str | os.PathLike, vocab_size: int) -> None:
    """A Llama-style tokenizer of exactly ``vocab_size`` entries in ``folder``: ``tokenizer.json`` (a BPE with byte
    fallback and no merges: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, the word
    start ``▁``, then ``▁t{i}`` fillers), ``tokenizer_config.json`` and ``special_tokens_map.json``. HF's
    ``tokenizers`` and llama.cpp's converter (its llama vocabulary path) read it; built in code, nothing downloaded.

    Raises:
        ValueError: ``vocab_size`` below 260 (the specials, the bytes and ``▁``).
    """
    n_fixed = len(_SPECIALS) + 256 + 1
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size must be >= {n_fixed} (3 specials, 256 bytes, the word start), got {vocab_size}")
    pieces = [*_SPECIALS, *(f"<0x{i:02X}>" for i in range(256)), "\u2581"]
    pieces += [f"\u2581t{i}" for i in range(vocab_size - n_fixed)]
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(_SPECIALS)]  # fmt: skip
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {p: i for i, p in enumerate(pieces)}, "merges": []},
    }  # fmt: skip
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "model_max_length": 2048, **special}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def llama_folder(quick: bool, work: str | os.PathLike) -> Path:
    """The benchmark's model (:data:`SMOLLM_135M`, or :data:`QUICK`) as a HF folder under ``work`` with its
    tokenizer; made once (seed 0, embedding scaled by :data:`EMBED_SCALE`), reused when present."""
    shape = QUICK if quick else SMOLLM_135M
    folder = Path(work) / f"llama-random-l{shape['n_layers']}-d{shape['d_model']}-v{shape['vocab_size']}"
    if not (folder / "tokenizer.json").is_file():
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2))
        with torch.no_grad():
            model.embed_tokens.weight.mul_(EMBED_SCALE)
        model.save_pretrained(folder)
        write_tokenizer(folder, shape["vocab_size"])
    return folder


# llama.cpp's converter, run with a BPE vocabulary it does not know (a benchmark's toy tokenizer, whose hash names no
# model): argv = converter, pre-tokenizer name, the converter's arguments; an empty merge list gets one merge (the
# loader wants some), a GPT-2 config without ``n_ctx`` gets ``n_positions``
_CONVERT_AS = """
import runpy, sys
conv, pre = sys.argv[1:3]
sys.path.insert(0, conv.rsplit("/", 1)[0])
from conversion.base import TextModel, gguf
from conversion.gpt2 import GPT2Model
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
vocab_init, gpt2_params = gguf.SpecialVocab.__init__, GPT2Model.set_gguf_parameters
def special_init(self, *a, **k):
    vocab_init(self, *a, **k)
    self.merges = self.merges or ["t 0"]
def set_params(self):
    self.hparams.setdefault("n_ctx", self.hparams["n_positions"])
    gpt2_params(self)
gguf.SpecialVocab.__init__, GPT2Model.set_gguf_parameters = special_init, set_params
sys.argv = [conv, *sys.argv[3:]]
runpy.run_path(conv, run_name="__main__")
"""


def gguf_file(folder: Path, outtype: str, env: Path, *, pre: str | None = None) -> Path:
    """llama.cpp's conversion of the HF ``folder`` to GGUF ``outtype`` (f32, q8_0, bf16, f16) beside it, made
    once with the converter of the peers environment ``env``. ``pre``: the BPE pre-tokenizer to record (e.g.
    ``"gpt-2"``) for a toy byte-level vocabulary the converter does not recognise (the GPT-2 folder of
    :func:`sublayer.bench.jobs.gpt2_folder`); the benchmarks feed token ids, so only the weights matter.

    Raises:
        ValueError: ``outtype`` is not one of :data:`GGUF_TYPES`. RuntimeError: the converter failed (its output).
    """
    if outtype not in GGUF_TYPES:
        raise ValueError(f"outtype must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")
    out = folder.parent / f"{folder.name}-{outtype}.gguf"
    if not out.is_file():
        converter = str(env / "converter" / "convert_hf_to_gguf.py")
        cmd = [str(env / "bin" / "python"), *(("-c", _CONVERT_AS, converter, pre) if pre else (converter,)),
               str(folder), "--outtype", outtype, "--outfile", str(out) + ".tmp"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{done.stderr[-3000:]}")
        os.replace(str(out) + ".tmp", out)
    return out


class LlamaCpp(Worker):
    """llama.cpp in a worker process (:mod:`sublayer.bench.llamacpp_worker`) run by the peers environment's
    python: GGUF files loaded by its ``load`` op (:func:`_llama_cpp`), greedy tokens by :meth:`generate`."""

    WORKER, NAME = "llamacpp_worker.py", "llama.cpp"

    def generate(self, key: str, prompts: list[list[int]], new: int) -> torch.Tensor:
        return torch.tensor(self.ask(op="generate", key=key, prompts=prompts, new=new)["tokens"])


def _llama_cpp(folder: Path, types: tuple[str, ...], n_ctx: int, work: Path, notes: dict[str, str],
               pre: str | None = None) -> LlamaCpp | None:
    """llama.cpp's worker with ``folder`` converted to each GGUF type of ``types`` loaded for batch 1 and 8 (keys
    ``"{type}/{batch}"``); None with ``notes["llama.cpp"]`` saying why where it cannot run (no peers environment,
    a failed conversion or load)."""

    def setup(cpp: LlamaCpp, env: Path) -> None:
        ggufs = {t: str(gguf_file(folder, t, env, pre=pre)) for t in types}
        for b in (1, 8):
            for t, path in ggufs.items():
                cpp.ask(op="load", key=f"{t}/{b}", path=path, n_seq=b, n_ctx=n_ctx, threads=torch.get_num_threads())

    cpp, note = PEERS.start(LlamaCpp, work / "llamacpp-worker.log", setup)
    if note:
        notes["llama.cpp"] = note
    return cpp


def _fast(model, log_notes: dict[str, str], name: str, **kw):
    """``fast_inference(model, **kw)``, or None with a note when it refuses a Llama (TypeError)."""
    try:
        return fast_inference(model, **kw)
    except (TypeError, NotImplementedError) as e:
        log_notes[name] = f"not available ({type(e).__name__}: {e})"
        return None


def decode_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """Greedy decoding, batch 1 and 8, every precision, against llama.cpp and HF (see the module doc)."""
    import transformers

    prompt, new = (8, 8) if quick else (32, 64)
    folder = llama_folder(quick, work)
    ours = Llama.from_pretrained(folder).eval()
    cfg = ours.config
    notes: dict[str, str] = {}
    variants = {"fast_inference fp32": dict(dtype=torch.float32), "fast_inference bf16": dict(dtype=torch.bfloat16),
                "fast_inference int8": dict(quantize="int8")}  # fmt: skip
    fast = {k: _fast(ours, notes, k, **kw) for k, kw in variants.items()}
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    hf_bf16 = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    for m in (hf, hf_bf16):  # no end token: every implementation makes `new` tokens a row
        m.generation_config.eos_token_id = None
    cpp = _llama_cpp(folder, GGUF_TYPES, prompt + new, Path(work), notes)
    shape = (f"{cfg.n_layers}L d{cfg.d_model} {cfg.n_heads}h/{cfg.kv_heads}kv V{cfg.vocab_size}, "
             f"prompt {prompt} + {new}")  # fmt: skip
    rows = []
    with cpp or contextlib.nullcontext():
        for b in (1, 8):
            ids = torch.randint(len(_SPECIALS), cfg.vocab_size, (b, prompt), generator=torch.Generator().manual_seed(b))

            def hf_gen(m):
                with torch.no_grad():
                    return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                      pad_token_id=0)[:, prompt:]  # fmt: skip

            fns: dict[str, Callable[[], torch.Tensor]] = {
                f"sublayer {k}": (lambda m=m: m.generate(ids, new, eos_token_id=None)[:, prompt:])
                for k, m in {"Llama.generate": ours, **fast}.items() if m is not None}  # fmt: skip
            fns |= {"HF fp32": lambda: hf_gen(hf), "HF bf16": lambda: hf_gen(hf_bf16)}
            if cpp is not None:
                fns |= {f"llama.cpp {t}": (lambda t=t: cpp.generate(f"{t}/{b}", ids.tolist(), new)) for t in GGUF_TYPES}
            outs = {k: f() for k, f in fns.items()}  # the warm-up
            res = time_interleaved(fns, reps, 0)
            ref = outs["HF fp32"]
            for dtype, ours_name, peer, others in (
                ("fp32", "sublayer Llama.generate", "llama.cpp f32", ("HF fp32",)),
                ("fp32", "sublayer fast_inference fp32", "llama.cpp f32", ("HF fp32",)),
                ("bf16", "sublayer fast_inference bf16", "llama.cpp bf16", ("llama.cpp f16", "HF bf16")),
                ("int8", "sublayer fast_inference int8", "llama.cpp q8_0", ()),
            ):
                label = ours_name.removeprefix("sublayer ")  # "Llama.generate", "fast_inference fp32", ...
                row = Row(f"Llama greedy decoding, batch {b}: {label}", shape, dtype, "generate",
                          base=peer if cpp is not None else "HF fp32", work=float(b * new), unit="tok")  # fmt: skip
                names = {"sublayer": ours_name, **{k: k for k in (peer, "HF fp32", *others)}}
                row.fill({k: res[v] for k, v in names.items() if v in res})
                if ours_name in res:
                    x_hf = row.ratio(base="HF fp32")
                    row.extra["x vs HF fp32"] = None if x_hf is None else round(x_hf, 2)
                    equal = float((outs[ours_name] == ref).float().mean())
                    row.extra["same tokens as HF fp32"] = equal == 1.0
                    if equal < 1.0:
                        row.extra["fraction equal to HF fp32"] = round(equal, 3)
                else:
                    row.extra["sublayer"] = notes.get(label, "not run")
                for k in (peer, *others):
                    if k in outs and k != "HF fp32":
                        row.extra[f"{k} fraction equal to HF fp32"] = round(float((outs[k] == ref).float().mean()), 3)
                if "llama.cpp" in notes:
                    row.extra["llama.cpp"] = notes["llama.cpp"]
                rows.append(row)
    return rows


def gpt2_rows(quick: bool, reps: int, work: Path, model=None, *, gpt2_decoding: Callable) -> list[Row]:
    """GPT-2 greedy decoding, batch 1 and 8: ``GPT2.generate`` fp32 and ``fast_inference(dtype=torch.bfloat16)``
    against llama.cpp f32 / bf16 / f16 on the ``decode`` job's model and lengths (``gpt2_decoding(quick, work)``:
    :func:`sublayer.bench.jobs.gpt2_decoding`), all interleaved in one run per batch size. Rows: ours fp32 vs
    llama.cpp f32, ours bf16 vs llama.cpp f16 and vs bf16, each saying whether its tokens equal our fp32 ones (and
    the fraction that does where some differ: the random weights leave near-ties, top-2 logit margins down to
    1e-4, where another summation order picks the runner-up and the rest of that row follows it).

    Raises:
        ValueError: the peers environment is not built (``--peers-env DIR``): llama.cpp is this job's only peer.
    """
    cfg, prompt, new, folder, ours, shape = gpt2_decoding(quick, work)
    notes: dict[str, str] = {}
    types = ("f32", "bf16", "f16")
    cpp = _llama_cpp(folder, types, prompt + new, Path(work), notes, pre="gpt-2")
    if cpp is None:
        raise ValueError(f"gpt2-llamacpp needs llama.cpp (--peers-env DIR): {notes['llama.cpp']}")
    bf16 = fast_inference(ours, dtype=torch.bfloat16)
    rows = []
    with cpp:
        for b in (1, 8):
            ids = torch.randint(0, cfg.vocab_size - 1, (b, prompt), generator=torch.Generator().manual_seed(b))
            fns = {f"sublayer {k}": (lambda m=m, ids=ids: m.generate(ids, new, eos_token_id=None)[:, prompt:])
                   for k, m in (("fp32", ours), ("bf16", bf16))}  # fmt: skip
            fns |= {f"llama.cpp {t}": (lambda t=t, b=b, ids=ids: cpp.generate(f"{t}/{b}", ids.tolist(), new))
                    for t in types}  # fmt: skip
            outs = {k: f() for k, f in fns.items()}  # the warm-up
            res = time_interleaved(fns, reps, 0)
            for dt, peer in (("fp32", "llama.cpp f32"), ("bf16", "llama.cpp f16"), ("bf16", "llama.cpp bf16")):
                row = Row(f"GPT-2 greedy decoding, batch {b} vs {peer}", shape, dt, "generate", base=peer,
                          work=float(b * new), unit="tok")  # fmt: skip
                row.fill({"sublayer": res[f"sublayer {dt}"], peer: res[peer]})
                for k in (f"sublayer {dt}", peer)[dt == "fp32" :]:
                    equal = float((outs[k] == outs["sublayer fp32"]).float().mean())
                    name = k.removeprefix("sublayer ")
                    row.extra[f"{name} same tokens as our fp32"] = equal == 1.0
                    if equal < 1.0:  # random weights: near-ties, a different summation order can flip one
                        row.extra[f"{name} fraction equal to our fp32"] = round(equal, 3)
                rows.append(row)
    return rows


def train_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """One AdamW training step against HF ``labels=`` on padded batches, dropout off (see the module doc)."""
    shape = QUICK if quick else SMOLLM_135M
    b, t, lo = (4, 32, 13) if quick else (8, 256, 102)  # lengths lo..t: ~70 % real tokens
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)).train()
    hf = ours.to_hf().train()
    ids, mask = padded_batch(b, t, lo, shape["vocab_size"])
    labels = ids.masked_fill(mask == 0, -100)
    losses = {"sublayer": lambda: ours.loss(ids, attention_mask=mask),
              "HF": lambda: hf(input_ids=ids, attention_mask=mask, labels=labels).loss}  # fmt: skip
    with torch.no_grad():  # same weights: before any step
        diff = abs(losses["sublayer"]().item() - losses["HF"]().item())
    models = {"sublayer": ours, "HF": hf}
    res = time_interleaved({k: adamw_step(models[k], f) for k, f in losses.items()}, reps, 1)
    row = Row("Llama training step (AdamW) vs HF labels=", f"{shape['n_layers']}L d{shape['d_model']} "
              f"V{shape['vocab_size']} {b}x{t} (len {lo}..{t})", "fp32", "training", base="HF",
              work=float(mask.sum()), unit="real tok").fill(res)  # fmt: skip
    row.extra["real tokens"] = f"{int(mask.sum())}/{b * t}"
    row.extra["|loss - HF loss|"] = f"{diff:.2e}"
    row.extra["dropout"] = 0.0
    row.extra["HF attn"] = str(hf.config._attn_implementation)
    return [row]


