"""``tpipe.nnx.Sequential``: a sequence of Flax NNX layers, pipelined on the one engine.

At every call each layer is split into its graph definition and its state (``nnx.split``), and the
engine (:mod:`tpipe.core.engine`) runs pure functions that merge a fresh copy of the layer from
that state (:mod:`tpipe.nnx.layers`). Everything is a pure function of the ``Param`` values, so
``nnx.grad``/``nnx.value_and_grad`` of a function of ``model(x)`` or ``model.loss(x)`` give the
layers' gradients, and ``nnx.Optimizer`` updates them in place.

Example::

  rngs = nnx.Rngs(0)
  model = tpipe.nnx.Sequential(
      [Embed(vocab, width, rngs=rngs),
       tpipe.nnx.Repeat(lambda rngs: Block(width, rngs=rngs), 24, rngs=rngs),
       HeadLoss(vocab, width, rngs=rngs)],
      num_stages=4, num_microbatches=16, per_example=("targets",), mesh=mesh)
  losses = model(tokens, targets=targets)        # [batch]
  loss = model.loss(tokens, targets=targets)     # their mean; differentiate this
"""

from __future__ import annotations

from typing import Sequence

from flax import nnx

from tpipe import spec as spec_lib
from tpipe.nnx import stack

OWNER = "tpipe.nnx.Sequential"


class Sequential(stack.Stack, nnx.Module):
  """Applies ``layers`` (NNX modules) in order, pipelined over the ``stage`` axis of a mesh.

  ``model(x, **kwargs)`` returns the last layer's outputs for the whole batch, equal to ``x``
  passed through the layers in order, each getting the keyword arguments its ``__call__`` names,
  under every schedule. ``model.loss(x, **kwargs)`` returns the mean of the last layer's
  per-example losses over the global batch; differentiate it (a fused schedule runs its backward
  inside the schedule; differentiating a fused schedule's outputs raises and says so).

  Args:
    layers: ``nnx.Module`` instances and :class:`tpipe.nnx.Repeat` entries, in order. Each maps
      the previous layer's output (any pytree of arrays, batch first) to its own. Their only
      state may be ``nnx.Param``, ``nnx.BatchNorm`` statistics and RNG streams
      (``nnx.Dropout``).
    spec: a :class:`tpipe.PipelineSpec`, or None to build one from ``settings``.
    rngs: where the layers' random keys come from (needed when a layer has RNG streams): its
      ``dropout`` stream, else its default one; one key per call.
    **settings: :class:`tpipe.PipelineSpec` fields, overriding ``spec``'s.

  With a ``mesh``, the state lives on it from construction on, each variable at its home
  (:mod:`tpipe.nnx.homes`: parameters whole over ``stage`` unless :func:`tpipe.nnx.shard` splits
  them), and calls keep it there: a train step under ``nnx.jit`` returns the state with the
  shardings it took, so the next step reuses its compiled program. Make the ``nnx.Optimizer``
  under ``jax.set_mesh(mesh)``, so Flax makes its step count on the mesh too (made on one device,
  the count comes back on the mesh and the second step compiles again).

  Randomness follows the rule of :mod:`tpipe.core.base.layers`, with the NNX step of
  :mod:`tpipe.nnx.layers`: unit ``u`` on global micro-batch ``m`` runs with its ``j``-th
  ``nnx.RngKey`` set to ``fold_in(fold_in(fold_in(K, u), m), j)``, ``K`` the call's key.

  Raises:
    TypeError, ValueError: at construction, for a bad layer or setting.
  """

  owner = OWNER

  def __init__(self, layers: Sequence[nnx.Module], *, spec: spec_lib.PipelineSpec | None = None,
               rngs: nnx.Rngs | None = None, **settings):
    if not isinstance(layers, (list, tuple)) or not layers:
      raise TypeError(f"{OWNER} takes a non-empty list of nnx.Module layers, got {layers!r}.")
    for i, layer in enumerate(layers):
      if not isinstance(layer, nnx.Module) or isinstance(layer, stack.Stack):
        raise TypeError(f"{OWNER}: layers[{i}] is {layer!r}; each layer must be an nnx.Module "
                        "instance or a tpipe.nnx.Repeat (for a flax.linen module use "
                        "tpipe.Sequential).")
    self.layers = nnx.List(layers)
    self._configure(spec_lib.make(OWNER, spec, **settings), rngs)

  def pipeline_layers(self) -> list[nnx.Module]:
    return list(self.layers)

  def __call__(self, x, **kwargs):
    return self._run(x, kwargs, loss=False)

  def loss(self, x, **kwargs):
    """The mean over the global batch of the last layer's per-example losses."""
    return self._run(x, kwargs, loss=True)

  def loss_terms(self, x, **kwargs):
    """The loss's terms apart, for reporting: ``{"loss": mean per-example loss, "aux_loss/...":
    ..., "aux_metric/...": ...}`` (:meth:`tpipe.core.engine.PlannedPipeline.loss_terms`)."""
    return self._run(x, kwargs, loss=False, terms=True)
