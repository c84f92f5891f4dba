"""Where a pipelined model's variables live, and their checkpoint form: the staging surface.

A pipelined model's variables are **logical** at the API boundary (``{"layers_i": tree}``, as
``nn.Sequential`` names them) and **staged** inside the step: a tree with ``STACKED``, ``PACKED``
and ``SHARED`` entries split over the mesh's ``stage`` axis, described by a model's
:class:`StageLayout` (``Sequential.stage_layout(x)``, ``pipeline.layout``). This module is what
an application (a trainer, a checkpoint converter) needs of it:

* :func:`to_staged` and :func:`to_logical`: a whole tree one way or the other, exact.
* :func:`packed_mask` and :func:`shared_mask`: which elements of the packed buffers and shared
  leaves hold weights a predicate selects (an optimizer's weight-decay mask, for example).
* :func:`checkpoint_specs`: the partition specs of the logical (layout-independent) form of
  staged variables whose specs are ``staged_specs`` (:func:`staged_specs_of` reads them off
  arrays), each logical leaf split over the whole mesh.
* :func:`to_checkpoint` and :func:`from_checkpoint`: staged variables to that form and back, a
  part at a time, so that no device gathers the model; a checkpoint saved from one layout resumes
  on any other (stage, data, fsdp, tensor and expert sizes, schedule and split).

Example::

  layout = model.stage_layout(x)                          # a tpipe.Sequential's
  staged = tpipe.staging.to_staged(layout, params)        # {"stacked": ..., "packed": ...}
  assert tpipe.staging.to_logical(layout, staged) == params   # bit for bit
"""

from tpipe.core.layout.accounting import packed_mask, shared_mask
from tpipe.core.layout.checkpoint_form import checkpoint_specs, staged_specs_of
from tpipe.core.layout.description import PACKED, SHARED, STACKED, StageLayout
from tpipe.core.layout.relayout import from_checkpoint, to_checkpoint
from tpipe.core.layout.staging import to_logical, to_staged

__all__ = [
    "PACKED",
    "SHARED",
    "STACKED",
    "StageLayout",
    "checkpoint_specs",
    "from_checkpoint",
    "packed_mask",
    "shared_mask",
    "staged_specs_of",
    "to_checkpoint",
    "to_logical",
    "to_staged",
]
