"""Synchronous SGD with pipelined models: the train state, where it lives, and the jitted step.

The step is an ordinary ``jax.jit`` program over global arrays: the batch is split over the
``data`` mesh axis, pipelined parameters over the ``stage`` axis, the rest replicated. Inside
the pipeline, gradients accumulate over micro-batches in the tick loop and are summed across data
replicas once per step (see :mod:`tpipe.core.loops.forward`): with a loss that is the mean over the
global batch, that sum is the average of the replicas' gradients, so one step equals one step of
plain SGD on the whole batch on one device.

Example::

  shardings = tpipe.shardings(params, mesh, stacked=("blocks",))   # the stack over stages
  state = tpipe.create_train_state(params, optimizer, shardings)
  step = tpipe.make_train_step(loss_fn, optimizer, shardings=tpipe.shardings(state, mesh,
                                                                             stacked=("blocks",)))
  state, metrics = step(state, jax.device_put(batch, tpipe.data_sharding(mesh)), rng)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpipe import axis_rules
from tpipe import mesh as mesh_lib

# loss_fn(params, batch, rng) -> scalar mean loss over the global batch.
LossFn = Callable[[Any, Any, jax.Array], jax.Array]


@flax.struct.dataclass
class TrainState:
  """What a training step reads and writes (and what a checkpoint holds)."""

  step: jax.Array
  params: Any
  opt_state: Any
  # Variables the model updates itself (BatchNorm's running statistics), or None.
  model_state: Any = None


def shardings(tree, mesh: Mesh, stacked: Sequence[str] = (), *,
              stage_axis: str = mesh_lib.STAGE_AXIS, rules=None):
  """Where each leaf of a parameter tree, or of a whole :class:`TrainState`, lives on ``mesh``.

  A stack of layers (``nn.scan``'s layout ``[L, ...]``) is split over ``stage_axis`` on its
  leading (layer) axis, so each device stores only its stage's layers. Stacks are the leaves
  under the top-level names in ``stacked``, and every boxed leaf whose first axis is named
  ``stage_axis``: the boxes ``init`` returns name it so for ``tpipe.pipeline``'s stack and a
  ``tpipe.Repeat``'s copies (a boxed stack whose layer count the stages do not divide stays
  whole over ``stage``). On a mesh with ``fsdp`` or ``tensor`` devices every parameter is also
  split over them as its logical axis names say (:func:`tpipe.axis_rules.weight_spec`: give the
  boxed parameters ``init`` returns; unboxed or unannotated leaves are split over ``fsdp`` on
  their largest dimension). For a whole :class:`TrainState`, every subtree of the optimizer
  state shaped like the parameters (optax's moments) takes the parameters' shardings leaf for
  leaf; the rest (the step, Adam's count) is replicated.

  Args:
    tree: parameters (boxed or not), or a ``TrainState``, as arrays or
      ``jax.ShapeDtypeStruct``s.
    mesh: the device mesh.
    stacked: top-level parameter names of the pipelined stacks, e.g. ``("blocks",)``.
    stage_axis: the mesh's stage axis.
    rules: ``(logical name, mesh axes)`` pairs (default: an enclosing
      ``nn.logical_axis_rules`` context, else :data:`tpipe.DEFAULT_RULES`).

  Returns:
    A tree of ``NamedSharding`` with the structure of ``tree`` (of its unboxed values).

  Raises:
    TypeError, ValueError: ``stacked`` is a string or names no parameter, or a stack's layer
      count does not divide by the stages.
  """
  if isinstance(stacked, str):
    raise TypeError(f"stacked must be a sequence of names, got the string {stacked!r}; "
                    f"write stacked=({stacked!r},).")
  params = tree.params if isinstance(tree, TrainState) else tree
  missing = [name for name in stacked if name not in params]
  if missing:
    raise ValueError(f"stacked names {missing} are not top-level keys of params "
                     f"({sorted(params)}); pass the names of the tpipe.pipeline modules.")
  num_stages = dict(mesh.shape).get(stage_axis, 1)
  replicated = NamedSharding(mesh, P())
  rules = axis_rules.resolve_rules(rules)
  reserved = (stage_axis, mesh_lib.DATA_AXIS)

  def one(path, leaf):
    names = None
    if isinstance(leaf, nn.Partitioned):
      names, leaf = tuple(leaf.names), leaf.value
    shape = tuple(getattr(leaf, "shape", ()))
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if not shape:
      return replicated
    named_stack = names is not None and len(names) == len(shape) and names[0] == stage_axis
    if not named_stack and not any(k in stacked for k in keys):
      return NamedSharding(mesh, axis_rules.weight_spec(shape, names, mesh, rules,
                                                        reserved=reserved))
    if shape[0] % num_stages and not named_stack:
      raise ValueError(f"{jax.tree_util.keystr(path)} has {shape[0]} layers, not "
                       f"divisible by the {num_stages} stages of the mesh.")
    if names is not None and len(names) == len(shape):
      names = names[1:]  # The layer axis's own name (nn.scan's metadata_params).
    inner = axis_rules.weight_spec(shape[1:], names, mesh, rules, reserved=reserved)
    return NamedSharding(mesh, P(None if shape[0] % num_stages else stage_axis, *inner))

  is_box = lambda a: isinstance(a, nn.Partitioned)
  if isinstance(tree, TrainState):
    param_shardings = jax.tree_util.tree_map_with_path(one, tree.params, is_leaf=is_box)
    return tree.replace(
        step=replicated, params=param_shardings,
        opt_state=follow_params(tree.opt_state, tree.params, param_shardings,
                                lambda path, leaf: replicated if not np.shape(
                                    getattr(leaf, "value", leaf)) else one(path, leaf)),
        model_state=jax.tree.map(lambda _: replicated, tree.model_state))
  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_box)


def follow_params(opt_state, params, param_values, other):
  """``opt_state`` with every subtree shaped like ``params`` (optax keeps each moment in a tree
  of the parameters' structure) replaced by ``param_values``, and every other leaf ``x`` at
  ``path`` by ``other(path, x)``.

  Boxes (``nn.Partitioned``) are unboxed first on both sides, so boxed moments of boxed
  parameters match."""
  is_box = lambda a: isinstance(a, nn.Partitioned)
  unbox = lambda tree: jax.tree.map(lambda a: a.value if is_box(a) else a, tree, is_leaf=is_box)
  treedef = jax.tree.structure(unbox(params))
  matches = lambda t: jax.tree.structure(unbox(t)) == treedef
  return jax.tree_util.tree_map_with_path(
      lambda path, t: param_values if matches(t) else other(path, t), opt_state,
      is_leaf=lambda t: matches(t) or is_box(t))


def create_train_state(params, optimizer: optax.GradientTransformation,
                       shardings=None, model_state=None) -> TrainState:
  """Places ``params`` (by ``shardings``, if given) and creates the optimizer state beside them.

  Every optimizer leaf that follows a parameter (``optax.tree_map_params``: Adam's moments) is
  created in that parameter's sharding, split from the start: no device ever holds a whole
  moment it does not own. State that follows no parameter (Adam's count) and the step are
  replicated over the same mesh.

  Args:
    params: the parameters (boxed or not).
    optimizer: an optax gradient transformation.
    shardings: the parameters' ``NamedSharding`` tree (:func:`shardings`), or a whole
      ``TrainState`` of them; None keeps the parameters where they are.
    model_state: running statistics (BatchNorm), replicated over the mesh, or None.
  """
  step = jnp.zeros((), jnp.int32)
  if shardings is None:
    return TrainState(step=step, params=params, opt_state=jax.jit(optimizer.init)(params),
                      model_state=model_state)
  if isinstance(shardings, TrainState):
    shardings = shardings.params
  mesh = jax.tree.leaves(shardings)[0].mesh
  replicated = NamedSharding(mesh, P())
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
      shardings, transform_non_params=lambda _: replicated,
      is_leaf=lambda a: isinstance(a, nn.Partitioned))
  # A jitted copy, not device_put: the step donates the state's buffers, and device_put may hand
  # back the caller's own buffer as a shard (seen with jax 0.10.2 even with may_alias=False).
  params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)
  # Created where it lives: the partitioner would otherwise replicate the zeros.
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)

  def onto_mesh(leaf):
    if isinstance(leaf, jax.Array) and leaf.sharding.device_set != replicated.device_set:
      return jax.device_put(leaf, replicated)
    return leaf

  if model_state is not None:
    model_state = jax.tree.map(onto_mesh, jax.tree.map(jnp.copy, model_state))
  return TrainState(step=onto_mesh(step), params=params, opt_state=opt_state,
                    model_state=model_state)


def _split(state: TrainState):
  """``(parameters, the rest of the state)``: the jitted step's first two arguments."""
  if not isinstance(state, TrainState):
    raise TypeError(f"the train step takes a tpipe.TrainState, got {type(state).__name__}; "
                    "build one with tpipe.create_train_state(params, optimizer, shardings).")
  return state.params, state.replace(params=None)


def _join(params, rest: TrainState) -> TrainState:
  """The inverse of :func:`_split`: the state from the parameters and the rest."""
  return rest.replace(params=params)


def _step_arguments(args):
  """The jitted step's ``(params, rest, batch, rng)`` as the step's ``(state, batch, rng)``,
  for trees that follow the arguments (``args_info``, ``input_shardings``)."""
  (params, rest, batch, rng), kwargs = args
  return (_join(params, rest), batch, rng), kwargs


class TrainStep:
  """The jitted step :func:`make_train_step` returns: ``step(state, batch, rng) -> (state,
  metrics)``, and ``step.lower(state, batch, rng)`` for ahead-of-time compilation::

    compiled = step.lower(state, batch, rng).compile()
    print(compiled.memory_analysis())
    state, metrics = compiled(state, batch, rng)

  Inside, the jitted program takes the parameters and the rest of the state as two arguments,
  so that each can be donated or not on its own (``jax.jit`` donates whole arguments); the
  lowered and compiled steps hide that split as the step itself does.
  """

  def __init__(self, jitted):
    self.jitted = jitted  # jitted(params, state without params, batch, rng).

  def __call__(self, state: TrainState, batch, rng):
    return self.jitted(*_split(state), batch, rng)

  def lower(self, state: TrainState, batch, rng) -> LoweredTrainStep:
    """The step lowered for ``state``, ``batch`` and ``rng`` (arrays or
    ``jax.ShapeDtypeStruct``s with shardings)."""
    return LoweredTrainStep(self.jitted.lower(*_split(state), batch, rng))


class LoweredTrainStep:
  """A lowered :class:`TrainStep`: what :class:`jax.stages.Lowered` is to a jitted function,
  with the step's arguments ``(state, batch, rng)``. ``lowered`` is JAX's own, over the jitted
  program's ``(params, rest of state, batch, rng)``."""

  def __init__(self, lowered: jax.stages.Lowered):
    self.lowered = lowered

  def compile(self, compiler_options=None) -> CompiledTrainStep:
    return CompiledTrainStep(self.lowered.compile(compiler_options))

  def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
    return self.lowered.as_text(dialect, debug_info=debug_info)

  def compiler_ir(self, dialect: str | None = None):
    return self.lowered.compiler_ir(dialect)

  def cost_analysis(self):
    return self.lowered.cost_analysis()

  @property
  def args_info(self):
    """``((state, batch, rng), {})`` of :class:`jax.stages.ArgInfo` (``donated``)."""
    return _step_arguments(self.lowered.args_info)


class CompiledTrainStep:
  """A compiled :class:`TrainStep`: ``compiled(state, batch, rng) -> (state, metrics)``, and
  what :class:`jax.stages.Compiled` reports, so the :mod:`tpipe.tools` analyses read it too.
  ``compiled`` is JAX's own, over the jitted program's ``(params, rest of state, batch, rng)``.
  """

  def __init__(self, compiled: jax.stages.Compiled):
    self.compiled = compiled

  def __call__(self, state: TrainState, batch, rng):
    return self.compiled(*_split(state), batch, rng)

  def as_text(self) -> str:
    return self.compiled.as_text()

  def memory_analysis(self):
    return self.compiled.memory_analysis()

  def cost_analysis(self):
    return self.compiled.cost_analysis()

  @property
  def input_shardings(self):
    """``((state, batch, rng), {})`` of shardings."""
    return _step_arguments(self.compiled.input_shardings)

  @property
  def output_shardings(self):
    """``(state, metrics)`` of shardings."""
    return self.compiled.output_shardings


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    shardings=None, donate: bool = True,
                    donate_params: bool = False) -> TrainStep:
  """Builds the jitted synchronous-SGD step ``step(state, batch, rng) -> (state, metrics)``.

  By default the step donates the input state's optimizer state (and step counter and model
  state) to the new state's, and writes the new parameters to buffers of their own. Donating
  the parameters as well costs more than it saves with the TPU compiler: they are read all
  through the pipeline's loops and overwritten only at the end, and the compiler then holds
  about two more copies of them in its temporaries, where with buffers of their own it
  accumulates the gradient sums in those buffers (a Llama-3-8B-shaped step on 64 v5p chips:
  4.14 GiB of temporaries with the parameters donated, 3.11 without, for 0.54 GiB of
  parameters per device; ``experiments/results/memory_at_scale.md``).

  Args:
    loss_fn: ``loss_fn(params, batch, rng) -> loss``, the mean over the global batch (a
      ``(loss, aux)`` pair is not accepted: return aux from a separate eval function). When the
      state has a ``model_state`` (BatchNorm statistics), ``loss_fn(params, batch, rng,
      model_state) -> (loss, new_model_state)``, e.g. ``model.apply({"params": params,
      "batch_stats": model_state}, x, train=True, mutable=["batch_stats"], method="loss")``.
    optimizer: an optax gradient transformation.
    shardings: optional ``TrainState`` of shardings (see :func:`shardings`); the new state is
      constrained to them so parameters stay where they were.
    donate: donate the input state's optimizer state, step counter and model state to the
      output (the optimizer state is most of the state: AdamW's two moments are twice the
      parameters).
    donate_params: donate the parameters too (with ``donate``). Off by default (see above);
      measure with ``step.lower(...).compile().memory_analysis()`` before turning it on.

  Returns:
    The jitted step (a :class:`TrainStep`). ``metrics`` holds ``loss`` (before the update) and
    ``grad_norm``. The input state's donated buffers are invalid after a call.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}.")
  for name, value in (("donate", donate), ("donate_params", donate_params)):
    if not isinstance(value, bool):
      raise TypeError(f"{name} must be True or False, got {value!r}.")
  if donate_params and not donate:
    raise ValueError("donate_params=True needs donate=True: the parameters are donated only "
                     "with the rest of the state.")

  def step(params, rest: TrainState, batch, rng):
    state = _join(params, rest)
    if state.model_state is None:
      loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, rng)
      model_state = None
    else:
      (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state.params, batch, rng, state.model_state)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           model_state=model_state)
    if shardings is not None:
      new_state = jax.lax.with_sharding_constraint(new_state, shardings)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  donated = ((0, 1) if donate_params else (1,)) if donate else ()
  return TrainStep(jax.jit(step, donate_argnums=donated))
