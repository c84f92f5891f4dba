"""Trains a pipelined model from an ml_collections config file.

Usage:
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm
  python -m tpipe.train --config=configs/lm.py:size=tiny --workdir=/tmp/t --config.num_steps=50
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/ft \\
      --config.init_from=/models/llama --config.data='data/*.jsonl' \\
      --config.tokenizer=/models/llama/tokenizer.json

Re-running the same command resumes from the workdir's latest checkpoint. Ctrl-C (SIGINT) or
SIGTERM saves a checkpoint and stops. Override any config field with --config.NAME=VALUE; the
fields, their defaults and meanings are listed below.
"""

from tpipe.train.cli import startup
from tpipe.train.cli import trainer

if __name__ == "__main__":
  startup.run(trainer.main, doc=__doc__)
