""":class:`FuselmKernelConfig`: transformers' ``KernelConfig`` that maps fuselm's ``kernels`` layers
(:mod:`fuselm.hf.hub_kernels`, shipped in ``hub_layers/``) and nothing else, for
``from_pretrained(..., use_kernels=True, kernel_config=fuselm.hf.kernel_config())``. Imports transformers and
``kernels``: only :func:`fuselm.hf.kernel_config` imports this module."""

from __future__ import annotations

from kernels import LocalLayerRepository
from transformers import KernelConfig

from .hub_kernels import HUB_LAYERS

LAYERS = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "ApplyRotary"}  # transformers' layer name -> fuselm's
DEVICES = ("cuda", "cpu")  # where fuselm's layers run: Triton on CUDA, the PyTorch reference on the CPU


class FuselmKernelConfig(KernelConfig):
    """fuselm's layers for the layer names a model registers, on ``devices``, in every kernelize mode
    (training, inference, torch.compile), from the local repository: no Hub lookup, nothing inherited
    from transformers' default mapping (other tagged layers keep their own forward)."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        if (
            isinstance(devices, str)
            or not isinstance(devices, (tuple, list))
            or not devices
            or any(d not in DEVICES for d in devices)
        ):
            raise ValueError(f"devices must be a non-empty tuple of {DEVICES}, got {devices!r}")
        mapping = {name: f"{HUB_LAYERS}:{layer}" for name, layer in LAYERS.items()}
        super().__init__(kernel_mapping=mapping, use_local_kernel=True, inherit_mapping=False)
        self.devices = tuple(devices)

    def sanitize_kernel_mapping(self, model) -> None:
        """Nothing to check in a mapping fuselm wrote; keeps the layer names ``model`` registers."""
        self.store_registered_layer_names(model)

    def create_compatible_mapping(self, model, compile: bool = False) -> None:
        """The mapping kernelize reads: for each layer name ``model`` registers, fuselm's layer on each
        device, for every mode (a plain repository is ``kernels``' fallback for all modes; transformers'
        own conversion maps only the mode the model was loaded in, so a ``train()`` after loading would
        lose it)."""
        registered = set(self.registered_layer_names.values())
        self.kernel_mapping = {
            name: dict.fromkeys(self.devices, LocalLayerRepository(repo_path=HUB_LAYERS, layer_name=layer))
            for name, layer in LAYERS.items()
            if name in registered
        }
