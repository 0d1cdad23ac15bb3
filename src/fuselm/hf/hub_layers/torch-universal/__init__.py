"""fuselm's norm and RoPE as a ``kernels`` layer repository (one universal build: the Triton kernels are
fuselm's own): ``kernels`` imports this file by path and reads :data:`layers`. What they compute:
:mod:`fuselm.hf.hub_kernels`."""

from fuselm.hf.hub_kernels import layers

__all__ = ["layers"]
