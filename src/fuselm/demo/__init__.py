"""``fuselm demo``: train a small Llama twice from the same init, Hugging Face eager then fuselm-patched.

    >>> from fuselm.demo import default_settings, run_demo, format_table
    >>> result = run_demo(default_settings("cpu"), out=".")  # fuselm_demo.png, .json  # doctest: +SKIP
    >>> print(format_table(result))                                                  # doctest: +SKIP

The corpus ships with the package (``corpus.txt``, tokenized as bytes): nothing is downloaded. Needs
transformers and, for the plot, matplotlib (``pip install "fuselm[demo]"``); see :mod:`fuselm.demo.train`.
"""

from .train import (
    CPU_SIZE,
    GPU_SIZE,
    DemoResult,
    DemoSettings,
    ModelSize,
    RunResult,
    SavedTensorMeter,
    compare,
    default_settings,
    format_table,
    load_corpus,
    run_demo,
)

__all__ = [
    "CPU_SIZE",
    "GPU_SIZE",
    "DemoResult",
    "DemoSettings",
    "ModelSize",
    "RunResult",
    "SavedTensorMeter",
    "compare",
    "default_settings",
    "format_table",
    "load_corpus",
    "run_demo",
]
