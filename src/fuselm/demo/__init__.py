"""``fuselm demo``: a small Llama trained twice from the same init, Hugging Face eager then fuselm-patched,
on the corpus shipped with the package (bytes as tokens, nothing downloaded); see :mod:`fuselm.demo.train`.
Needs transformers and, for the plot, matplotlib (``pip install "fuselm[demo]"``).

    >>> from fuselm.demo import default_settings, run_demo, format_table
    >>> print(format_table(run_demo(default_settings("cpu"), out=".")))  # doctest: +SKIP
"""

from .train import DemoSettings, default_settings, format_table, run_demo

__all__ = ["DemoSettings", "default_settings", "format_table", "run_demo"]
