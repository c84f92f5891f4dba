r"""Exports a run's model as a Hugging Face checkpoint: ``python -m tpipe.train.cli.export``.

Usage::

  python -m tpipe.train.cli.export --workdir=/tmp/run --out=/tmp/run_hf
  python -m tpipe.train.cli.export --workdir=/tmp/run --out=/tmp/run_hf --step=200 --dtype=bfloat16

Writes ``config.json`` and ``model.safetensors`` (PyTorch's names and layouts) of the family the
run's model belongs to (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE or GPT-2:
:func:`tpipe.train.pretrained.export`; a mixture's ``router_aux_loss_coef`` is the run's),
which ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads; a tokenizer file the run
used (``tokenizer.json`` and a ``tokenizer_config.json`` beside it) is copied along. A model that
fits no family (a LayerNorm head with a bias, learned positions with llama blocks) is refused,
naming the fields. ``--out`` must be a new or empty directory.
"""

from __future__ import annotations

import pathlib
import shutil

from absl import app
from absl import flags

from tpipe.train import architecture
from tpipe.train import pretrained
from tpipe.train.cli import loading
from tpipe.train.cli import startup


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command line's flags (called when run as a program)."""
  flags.DEFINE_string("workdir", None, "The run's workdir.")
  flags.DEFINE_string("out", None, "The directory to write the Hugging Face model to.")
  flags.DEFINE_integer("step", None, "The checkpoint to export (default the latest).")
  flags.DEFINE_string("dtype", "float32", "The tensors' dtype: float32 or bfloat16.")


def export_run(workdir: str, out: str, *, step: int | None = None,
               dtype: str = "float32") -> pathlib.Path:
  """Exports ``workdir``'s checkpoint (``step``, default the latest) to ``out``."""
  model = loading.load(workdir=workdir, step=step)
  fields = {name: architecture.value(model.config, name) for name in architecture.FIELDS}
  if "router_aux_loss_coef" in model.config:  # Not architecture: a Mixtral's config has it.
    fields["router_aux_loss_coef"] = model.config.router_aux_loss_coef
  written = pretrained.export(model.params, fields, out, dtype)
  tokenizer = pathlib.Path(str(model.config.get("tokenizer", "")))
  if tokenizer.suffix == ".json" and tokenizer.is_file():
    shutil.copy(tokenizer, written / "tokenizer.json")
    if (tokenizer.parent / "tokenizer_config.json").is_file():
      shutil.copy(tokenizer.parent / "tokenizer_config.json", written)
  return written


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS.workdir or not FLAGS.out:
    raise ValueError("--workdir and --out are required.")
  written = export_run(FLAGS.workdir, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype)
  print(f"Exported {FLAGS.workdir} to {written} (config.json, model.safetensors).")


if __name__ == "__main__":
  define_flags()
  startup.run(main, doc=__doc__)
