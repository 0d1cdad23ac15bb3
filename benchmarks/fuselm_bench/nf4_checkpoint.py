"""A random-init causal LM saved as a pre-quantized bitsandbytes NF4 checkpoint, one tensor at a time.

For shapes whose bf16 weights fit neither the GPU machine's disk nor its host memory (Llama-3.3-70B: 141 GB
in bf16): each tensor of the model laid out on the meta device is drawn on ``device`` (HF's init), the decoder
layers' linear weights quantized there as ``load_in_4bit`` with double quantization does, and written from
the host in safetensors shards of at most :data:`SHARD_BYTES`: nothing larger than one bf16 weight and one
shard is held. ``from_pretrained(folder)`` loads the 4-bit layers as saved (its ``config.json`` has the
``quantization_config``; the embeddings, norms and lm_head stay bf16).

Example (a tiny Llama on the CPU; bitsandbytes' CPU backend quantizes):
    >>> import tempfile, torch
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2)
    >>> folder = tempfile.mkdtemp()
    >>> written = save_nf4_checkpoint(config, folder, torch.device("cpu"), seed=0)
    >>> model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    >>> type(model.model.layers[0].mlp.down_proj).__name__, written["quantized"]
    ('Linear4bit', 14)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

QUANTIZATION = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8",
}
BLOCKSIZE = 64
SHARD_BYTES = 4 << 30


class _Shards:
    """Tensors gathered on the host, written as ``model-0000i.safetensors`` once ``limit`` bytes are held."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}  # what model.safetensors.index.json says
        self.held = self.total = self.files = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor = tensor.contiguous().cpu()
        self.held += tensor.numel() * tensor.element_size()
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            self.files += 1
            name = f"model-{self.files:05d}.safetensors"
            save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
            self.weight_map.update(dict.fromkeys(self.pending, name))
            self.total, self.pending, self.held = self.total + self.held, {}, 0


def save_nf4_checkpoint(
    config: Any, folder: str | Path, device: torch.device, *, seed: int
) -> dict[str, Any]:
    """Write ``config``'s causal LM, random init (seeded), as an NF4 pre-quantized checkpoint into ``folder``
    (see the module's docstring)."""
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lm_head = skeleton.get_output_embeddings()
    modules = dict(skeleton.named_modules())
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(seed)
    shards = _Shards(folder, SHARD_BYTES)
    quantized = tensors = 0
    for name, meta in skeleton.state_dict().items():  # tied weights appear once
        module = modules[name.rpartition(".")[0]]
        if meta.dim() == 1:  # norm weights (and any bias): HF initializes them to ones / zeros
            value = torch.ones if "norm" in name else torch.zeros
            shards.add(name, value(meta.shape, dtype=meta.dtype))
        else:
            weight = torch.empty(meta.shape, dtype=meta.dtype, device=device).normal_(
                0.0, std, generator=generator
            )
            # what load_in_4bit quantizes: the linear layers' weights but the output head's
            if isinstance(module, torch.nn.Linear) and module is not lm_head and name.endswith(".weight"):
                packed, state = bnb_functional.quantize_4bit(
                    weight, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4"
                )
                del weight
                shards.add(name, packed)
                for key, part in state.as_dict(packed=True).items():
                    shards.add(f"{name}.{key}", part)
                quantized += 1
            else:
                shards.add(name, weight)
        tensors += 1
    shards.flush()
    index = {"metadata": {"total_size": shards.total}, "weight_map": shards.weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config stays unquantized
    config.quantization_config = dict(QUANTIZATION)
    config.save_pretrained(folder)
    return {"quantized": quantized, "tensors": tensors, "bytes": shards.total}
