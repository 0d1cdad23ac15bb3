"""The ops: one subpackage each (reference, kernels, op, README). The public functions are
re-exported by `fuselm` itself; this package does not re-export them, so that
`fuselm.ops.<op>` stays the subpackage and never a function of the same name."""
