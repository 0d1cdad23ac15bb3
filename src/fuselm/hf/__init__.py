"""Hugging Face integration: run transformers models on fuselm's kernels.

    >>> import fuselm.hf
    >>> fuselm.hf.patch("llama")            # every Llama model, built before or after   # doctest: +SKIP
    >>> model = fuselm.hf.patch(model)      # or one built model (PEFT-wrapped, multimodal) # doctest: +SKIP
    >>> fuselm.hf.unpatch(model)                                                           # doctest: +SKIP

transformers is an optional dependency (``pip install "fuselm[hf]"``); it is imported when a target is
patched, not when this package is. Tested with transformers 5.17 to 5.25 (README: transformers >= 5.25).
"""

from .block_report import BlockRun, Report, report
from .hub_kernels import kernel_config
from .patching import is_patched, patch, unpatch
from .registry import FAMILIES, FamilySpec, markdown_table, supported_model_types

__all__ = [
    "patch",
    "unpatch",
    "is_patched",
    "report",
    "Report",
    "BlockRun",
    "kernel_config",
    "supported_model_types",
    "markdown_table",
    "FAMILIES",
    "FamilySpec",
]
