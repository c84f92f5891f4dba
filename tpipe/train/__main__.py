"""``python -m tpipe.train --config=CONFIG --workdir=DIR``: see :mod:`tpipe.train.trainer`."""

from tpipe.train import cli
from tpipe.train import trainer

if __name__ == "__main__":
  cli.run(trainer.main)
