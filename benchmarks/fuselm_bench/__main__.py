"""``python -m fuselm_bench ...`` (from ``benchmarks/``, or with it on ``PYTHONPATH``): the lab's command
line, the same as ``fuselm bench ...``."""

import sys

from .cli import main

sys.exit(main())
