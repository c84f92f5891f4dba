"""A trained or imported model outside the trainer: its config and logical parameters.

The evaluation, generation and export entry points read a model from either

* a run's ``--workdir``: the config the run started with (``config.json``, resolved: the
  architecture, the tokenizer, the sequence length) and a checkpoint's parameters (the latest
  unless ``step`` is given), read layer by layer without building the model or its mesh; or
* ``--init_from``: a Hugging Face checkpoint directory (:mod:`tpipe.train.pretrained`), with
  the fields a caller gives (``tokenizer``, ``seq_len``).

::

  model = load(workdir="/tmp/run")
  model.config.tokenizer, model.params["layers_1"]["query"].shape
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import ml_collections

from tpipe.train import architecture
from tpipe.train import checkpointing
from tpipe.train import pretrained

# What a model outside the trainer needs besides its architecture.
_RUN_DEFAULTS = {"seq_len": 1024, "dropout": 0.0, "dtype": "float32", "vocab_chunks": 1,
                 "tokenizer": "bytes", "eod_token": "", "data_format": "", "text_field": "text"}


@dataclasses.dataclass
class LoadedModel:
  """A model's config (architecture and run fields) and logical parameters (NumPy)."""

  config: ml_collections.ConfigDict
  params: dict[str, Any]
  source: str


def define_source_flags(use: str) -> None:
  """Defines the flags that say which model :func:`load` reads: ``--workdir`` (a tpipe run's, its
  latest checkpoint or ``--step``'s) or ``--init_from`` (a Hugging Face checkpoint); ``use``
  says what the program does with the checkpoint (``"evaluate"``)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string("workdir", None,
                      "A tpipe run's workdir (its latest checkpoint, or --step's).")
  flags.DEFINE_string("init_from", None, "A Hugging Face checkpoint directory (config.json and "
                      "*.safetensors) instead of --workdir.")
  flags.DEFINE_integer("step", None, f"The workdir's checkpoint to {use}.")


def _checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  directory = workdir / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
      if directory.is_dir() else []


def load(*, workdir: str | None = None, init_from: str | None = None, step: int | None = None,
         **fields) -> LoadedModel:
  """Reads the model of ``workdir`` (at ``step``, default the latest) or ``init_from``.

  Args:
    workdir: a tpipe run's workdir.
    init_from: a Hugging Face checkpoint directory (or a workdir, as in ``config.init_from``).
    step: the workdir's checkpoint to read (default the latest).
    **fields: config fields to set (e.g. ``tokenizer``, ``seq_len``); empty values are skipped.

  Raises:
    ValueError: neither or both sources, no checkpoint, or no such step.
  """
  if bool(workdir) == bool(init_from):
    raise ValueError("give one of --workdir (a tpipe run) or --init_from (a Hugging Face "
                     "checkpoint directory).")
  given = {k: v for k, v in fields.items() if v not in (None, "", 0)}
  if workdir:
    directory = pathlib.Path(workdir).expanduser()
    if not (directory / "config.json").is_file():
      raise ValueError(f"--workdir={workdir}: no config.json there; is it a tpipe run?")
    steps = _checkpoint_steps(directory)
    if not steps:
      raise ValueError(f"--workdir={workdir} has no checkpoint yet.")
    if step is not None and step not in steps:
      raise ValueError(f"--step={step}: {workdir} has checkpoints of steps {steps}.")
    step = steps[-1] if step is None else step
    saved = json.loads((directory / "config.json").read_text())
    config = ml_collections.ConfigDict({**_RUN_DEFAULTS, **architecture.DEFAULTS, **saved,
                                        **given, "init_from": ""})
    params = {name: checkpointing.read_layer(directory / "checkpoints", step, name)
              for name in ("layers_0", "layers_1", "layers_2")}
    return LoadedModel(config, params, f"{directory} step {step}")
  fields_ = pretrained.architecture_of(init_from)
  config = ml_collections.ConfigDict({**_RUN_DEFAULTS, **fields_, **given, "init_from": ""})
  return LoadedModel(config, pretrained.load_params(init_from, fields_), str(init_from))
