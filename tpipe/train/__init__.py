"""The example application: models, data, configs to experiments, checkpoints, metrics and the
absl trainer (``python -m tpipe.train``)."""
