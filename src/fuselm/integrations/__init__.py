"""fuselm inside the training engines that users configure rather than code: ``axolotl`` (a plugin named in
the YAML) and ``torchtitan`` (a loss of its trainer config). Each module imports without its engine."""
