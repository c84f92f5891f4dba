"""The example application: models, data (the stdlib corpus, or your files tokenized and packed),
configs to experiments, checkpoints, metrics, the absl trainer (``python -m tpipe.train``), and
Hugging Face checkpoints in and out with evaluation and generation (``tpipe.train.pretrained``,
``python -m tpipe.train.evaluate``, ``generate``, ``export``)."""
