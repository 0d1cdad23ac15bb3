"""What test modules share, importable as ``kit`` (pyproject's ``pythonpath = ["tests"]``): no test module
imports another one, and nothing here is a test.

- ``kit.spies``: counting wrappers around launchers and reference functions (which path ran).
- ``kit.oracles``: eager and float64 implementations several suites compare against.
- ``kit.workers``: running a function on the ranks of a torch.distributed group (spawned processes).
- ``kit.hf_models``: tiny Hugging Face models of every model type fuselm.hf knows, built from code.
- ``kit.fake_graphs``: CUDA graphs emulated on the CPU (``emulate(monkeypatch)``), for fuselm.graph_step's
  bookkeeping in CI (the ``graph_device`` fixture of tests/conftest.py runs a test on both).

The ``gen`` fixture (a CPU generator seeded by the test's id) lives in tests/conftest.py.
"""


def skip_unless_fuselm_trl():
    """Skip the calling test unless trl is installed in a version fuselm.trl supports; returns trl."""
    import pytest

    trl = pytest.importorskip("trl")
    from fuselm.trl import patching

    if not patching._supported(getattr(trl, "__version__", "unknown")):
        pytest.skip(f"fuselm.trl supports trl {patching.SUPPORTED}; trl {trl.__version__} is installed")
    return trl
