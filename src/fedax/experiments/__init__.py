"""Experiments: validated configs, building and running one experiment from a config, its
run directory, strict JSON outputs and plots. Both the ``fedax`` command (``cli``) and the
papers' reproductions (``reproduce``) stand on this layer."""
