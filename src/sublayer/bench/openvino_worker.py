"""OpenVINO's encoder inference and OpenVINO GenAI's greedy decoding for the benchmark, in a process of its own.

Run by :mod:`sublayer.bench.openvino` with the python of the OpenVINO peers environment
(``benchmarks/peers_env_openvino.sh``); it imports openvino, openvino_genai, numpy and
:mod:`sublayer.bench.worker_loop` only, never sublayer or torch.
Models are OpenVINO IR folders exported beforehand (``optimum-cli export openvino``). Every model is compiled for
the CPU with ``INFERENCE_PRECISION_HINT`` (``f32`` or ``bf16``), ``INFERENCE_NUM_THREADS`` and
``PERFORMANCE_HINT=LATENCY`` set explicitly; the rest is OpenVINO's defaults, which ``load`` reports.
It answers that loop's JSON lines:

* ``{"op": "versions"}`` -> ``{"openvino": ..., "openvino-genai": ...}``;
* ``{"op": "load_encoder", "key": K, "path": IR folder, "precision": P, "threads": N}`` -> ``{"properties": {...}}``:
  the encoder (``openvino_model.xml``: input_ids, attention_mask, token_type_ids -> last_hidden_state) compiled;
* ``{"op": "set_input", "key": K, "ids": [[...]], "mask": [[...]]}`` -> ``{"ok": true}``: the batch the next
  ``embed`` calls run on (sent once, outside the timed calls);
* ``{"op": "embed", "key": K}`` -> ``{"ok": true}``: one inference on that batch and sentence-transformers' mean
  pooling (the mean over real tokens, L2-normalised) of its hidden states;
* ``{"op": "hidden", "key": K, "out": PATH}`` -> ``{"ok": true}``: the hidden states of that batch saved to ``PATH``
  (``numpy.save``, float32), for the accuracy check;
* ``{"op": "load_llm", "key": K, "path": IR folder, "precision": P, "threads": N}`` -> ``{"properties": {...}}``:
  ``openvino_genai.LLMPipeline`` on the folder (no tokenizer: token ids in, token ids out);
* ``{"op": "generate", "key": K, "prompts": [[ids]] (same length), "new": M}`` -> ``{"tokens": [[ids]]}``: greedy
  decoding of all rows at once (``TokenizedInputs``, mask all ones), exactly M new tokens a row (end token
  ignored).
"""

from pathlib import Path

import numpy as np
import openvino as ov
from worker_loop import serve

_PROPS = ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT", "KV_CACHE_PRECISION",
          "DYNAMIC_QUANTIZATION_GROUP_SIZE", "NUM_STREAMS")  # fmt: skip


def config(precision: str, threads: int) -> dict:
    """The properties every model is compiled with."""
    if precision not in ("f32", "bf16"):
        raise ValueError(f"precision must be f32 or bf16, got {precision!r}")
    return {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}


def _properties(compiled) -> dict:
    out = {}
    for name in _PROPS:
        try:
            value = compiled.get_property(name)
            out[name] = value.to_string() if isinstance(value, ov.Type) else str(value)
        except Exception:  # noqa: BLE001 - a property this OpenVINO does not have
            pass
    return out


class _Encoder:
    def __init__(self, core: ov.Core, path: str, precision: str, threads: int):
        self.compiled = core.compile_model(str(Path(path) / "openvino_model.xml"), "CPU", config(precision, threads))
        self.request = self.compiled.create_infer_request()
        self.names = {p.get_any_name() for p in self.compiled.inputs}
        self.properties = _properties(self.compiled)
        self.inputs: dict = {}

    def set_input(self, ids: list, mask: list) -> None:
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        self.inputs = {k: v for k, v in feed.items() if k in self.names}

    def hidden(self) -> np.ndarray:
        return self.request.infer(self.inputs)[self.compiled.output(0)]

    def embed(self) -> np.ndarray:
        h = self.hidden().astype(np.float32)
        w = self.inputs["attention_mask"][..., None].astype(np.float32)
        s = (h * w).sum(1) / w.sum(1)
        return s / np.maximum(np.linalg.norm(s, axis=-1, keepdims=True), 1e-12)


class _LLM:
    def __init__(self, core: ov.Core, path: str, precision: str, threads: int):
        import openvino_genai as g

        cfg = config(precision, threads)
        self.pipe = g.LLMPipeline(path, "CPU", **cfg)
        # what the same IR gets from these properties and OpenVINO's defaults (KV cache precision, dynamic
        # quantization), read from a plain compile of it: the pipeline does not expose its compiled model
        self.properties = _properties(core.compile_model(str(Path(path) / "openvino_model.xml"), "CPU", cfg))
        self.g = g

    def generate(self, prompts: list, new: int) -> list:
        ids = np.asarray(prompts, dtype=np.int64)
        inputs = self.g.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        gc = self.g.GenerationConfig()
        gc.max_new_tokens, gc.min_new_tokens, gc.ignore_eos, gc.do_sample = new, new, True, False
        res = self.pipe.generate(inputs, gc)
        return [list(map(int, t)) for t in res.tokens]


def main() -> None:
    core = ov.Core()
    models: dict = {}

    def versions(req: dict) -> dict:
        import importlib.metadata as md

        return {k: md.version(k) for k in ("openvino", "openvino-genai")}

    def load(cls, req: dict) -> dict:  # the IR folder compiled as ``cls`` (_Encoder, _LLM): its properties
        m = models[req["key"]] = cls(core, req["path"], req["precision"], req["threads"])
        return {"properties": m.properties}

    serve({
        "versions": versions,
        "load_encoder": lambda req: load(_Encoder, req), "load_llm": lambda req: load(_LLM, req),
        "generate": lambda req: {"tokens": models[req["key"]].generate(req["prompts"], req["new"])},
        "set_input": lambda req: models[req["key"]].set_input(req["ids"], req["mask"]),
        "embed": lambda req: models[req["key"]].embed(),
        "hidden": lambda req: np.save(req["out"], models[req["key"]].hidden().astype(np.float32)),
    })  # fmt: skip


if __name__ == "__main__":
    main()
