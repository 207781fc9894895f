"""``sublayer.checkpoints``: Hugging Face-format folders (safetensors / ``pytorch_model.bin`` + ``config.json``).

:mod:`.io` reads and writes folders with errors that name the file and checks keys strictly; :mod:`.generation`
reads and writes the decoding defaults (``generation_config.json``);
:mod:`.gpt2`, :mod:`.bert` and :mod:`.llama` are the key maps (names, fused and transposed layouts) — kept out of the
model code. The models' ``from_pretrained``/``save_pretrained`` use them.
"""

from . import bert, generation, gpt2, live, llama
from .generation import FROM_CONFIG, GenerationConfig, read_generation_config, write_generation_config
from .io import (
    CONFIG_NAME,
    CheckpointError,
    check_and_convert,
    hf_activation,
    read_config,
    read_hf_folder,
    read_state_dict,
    resolve_folder,
    write_folder,
)

__all__ = [
    "CONFIG_NAME",
    "CheckpointError",
    "FROM_CONFIG",
    "GenerationConfig",
    "bert",
    "check_and_convert",
    "generation",
    "gpt2",
    "hf_activation",
    "live",
    "llama",
    "read_config",
    "read_hf_folder",
    "read_state_dict",
    "read_generation_config",
    "resolve_folder",
    "write_folder",
    "write_generation_config",
]
