"""``sublayer.models``: models made of the sub-layers, one readable file each, dataclass configs."""

from .bert import Bert, BertConfig
from .config import ModelConfig
from .fast import FastBert, FastCausalLM, FastGPT2, fast_inference
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig
from .quantized import QuantizedBert, QuantizedCausalLM, QuantizedGPT2, load_quantized
from .transformer import Transformer, TransformerConfig

__all__ = [
    "Bert",
    "BertConfig",
    "FastBert",
    "FastCausalLM",
    "FastGPT2",
    "GPT2",
    "GPT2Config",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "QuantizedBert",
    "QuantizedCausalLM",
    "QuantizedGPT2",
    "Transformer",
    "TransformerConfig",
    "fast_inference",
    "load_quantized",
]
