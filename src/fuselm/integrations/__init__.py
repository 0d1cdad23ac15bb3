"""fuselm inside the training engines that users configure rather than code: ``axolotl`` (a plugin named in
the YAML). Each module imports without its engine installed."""
