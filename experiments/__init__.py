"""Experiment scripts: each runs from the repository root as ``python -m experiments.<name>``.

Importing this package is the scripts' one preamble (:func:`experiments._common.preamble`): it
runs before a script's own imports, so every script gets the emulated CPU devices whatever the
order of its imports.
"""

from experiments import _common

_common.preamble()
