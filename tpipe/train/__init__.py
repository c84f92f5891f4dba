"""The model library beside the engine: what a user imports to build and feed a pipelined model.

Models and blocks (:mod:`.models`, :mod:`.blocks`, :mod:`.models_nnx`, :mod:`.convnet`,
:mod:`.lm_ends`), attention (:mod:`.attention`, :mod:`.flash_attention`), mixtures of experts
(:mod:`.moe`, :mod:`.experts`, :mod:`.expert_dispatch`), losses (:mod:`.losses`), data and
document packing (:mod:`.data`, :mod:`.sources`, :mod:`.document_packing`, :mod:`.images`),
tokenization (:mod:`.tokenization`),
Hugging Face checkpoints in and out (:mod:`.pretrained`, :mod:`.architecture`), checkpointing
(:mod:`.checkpointing`), compact optimizer moments (:mod:`.compact_moments`) and tied embeddings
(:mod:`.tied`).

The command-line programs built on it (the trainer ``python -m tpipe.train``, the report,
autotune, evaluation, generation, export) live apart in :mod:`tpipe.train.cli`.
"""
