"""``tpipe.PipelineSpec``: how a layer sequence is pipelined, in one validated value.

Every front end (``tpipe.Sequential``, ``tpipe.pipeline``, ``tpipe.nnx``), the trainer's config,
the report and the auto-tuner describe a pipeline with the same settings: stages, micro-batches,
schedule, chunks per stage, balance, remat and its granularity, per-example keyword names, layer
loop unrolling, and the mesh and its axis names. :class:`PipelineSpec` holds them, checks every
one on construction (a bad value is a ``TypeError``/``ValueError`` naming the value and the fix,
before anything is traced), and hands out what follows from them: the schedule's table (from the
one cached factory, :func:`tpipe.schedules.build`), the number of chunks, the placement.

Example::

  >>> spec = PipelineSpec(num_stages=4, num_microbatches=8, schedule="1f1b")
  >>> spec.is_fused, spec.num_chunks, spec.table.num_ticks
  (True, 4, 22)
  >>> spec.replace(schedule="gpipe").table.bubble_fraction == 3 / 11
  True
  >>> PipelineSpec(num_stages=2, num_microbatches=4, remat="some")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  ValueError: Unknown remat 'some'; choose one of ('none', 'full', 'dots') or pass a ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from jax.sharding import Mesh

from tpipe import mesh as mesh_lib
from tpipe import schedules

BALANCE_NAMES = ("params", "flops", "time")
REMAT_NAMES = ("none", "full", "dots")
GRANULARITY_NAMES = ("chunk", "layer", "nested")
# The schedules whose backward splits into BI and W.
SPLIT_BACKWARD = ("zb_h1", "zbv")
# What W may compute again in a split backward (PipelineSpec.weight_recompute).
WEIGHT_RECOMPUTE_NAMES = ("none", "forward", "backward")
# PipelineSpec.tick_costs asking for one action per tick.
PLAIN_TICKS = "plain"


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """How a sequence of layers is pipelined. Frozen; validated on construction.

  Every front end, the trainer's config, the report and the auto-tuner take this one value. How
  the settings interact, and why: docs/design/pipeline-spec.md.

  Attributes:
    num_stages: pipeline stages S; equals the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica.
    schedule: ``"gpipe"``, ``"circular"`` (backward by autodiff through the tick loop),
      ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"`` or ``"zbv"`` (fused: forward and backward
      interleaved, memory bounded in S); see :mod:`tpipe.schedules`.
    num_repeats: chunks per stage R: 1 for ``"gpipe"``, ``"1f1b"``, ``"zb_h1"``; 2 for ``"zbv"``;
      any for ``"circular"``; at least 2 for ``"interleaved_1f1b"``.
    balance: how the ``S * R`` chunks are cut: ``"params"``, ``"flops"``, ``"time"`` or a
      sequence of layer-unit counts per chunk (a repeated layer of n copies is n units).
    remat: ``"none"``, ``"full"``, ``"dots"`` or a ``jax.checkpoint`` policy.
    remat_granularity: what one checkpoint covers: ``"nested"`` (the default: the chunk, and
      inside it each unit), ``"chunk"``, ``"layer"`` or an int ``k`` (every ``k`` units). It
      does nothing under ``remat="none"``: with nothing to recompute every granularity runs
      the ``"chunk"`` program (:attr:`granularity`).
    per_example: names of keyword arguments whose arrays carry the batch as leading axis; they
      are split into micro-batches with the input. Other arrays are broadcast to every layer.
    unroll: layer units per iteration of a repeated layer's ``lax.scan`` (``True``: all).
    mesh: the device mesh; ``None`` means the ambient mesh (``jax.set_mesh``), else one device.
    transfer_delay: which links between neighbouring stages are read one tick late, so the
      transfer overlaps a tick of compute: ``None`` (default: the links that cross slices of
      ``mesh``), ``0`` none, ``1`` all, or one 0/1 per link (link ``l`` joins stage ``l`` to
      ``(l + 1) % S``).
    stream_inputs: whether each micro-batch's inputs travel to stage 0 one stage per tick
      (where M is a multiple of S) rather than being gathered once before the first tick.
    tick_costs: fused schedules only: how the table is laid out. None (default): in compound
      ticks for per-action costs derived from the layers' FLOPs when the pipeline is built
      (:mod:`tpipe.schedules.derived_costs`; ``describe()`` shows them). A mapping ``{"F": .., "B":
      ..}`` (with ``"BI"`` and ``"W"`` for the zero-bubble schedules) overrides them, kept as a
      sorted tuple of ``(action, cost)`` pairs; ``"plain"``: one action per tick.
    weight_recompute: split backward only (``"zb_h1"``, ``"zbv"``): what ``W`` computes again
      rather than a micro-batch awaiting it keeping it: False (nothing), ``"forward"`` (or True)
      or ``"backward"``.
    overlap_microbatches: fused schedules in compound ticks only: where a stage runs a forward
      of one micro-batch and a backward (``B`` or ``BI``) of another in one tick, run the two in
      one conditional with their layer loops unrolled, so the compiler can run one's
      collectives (a mixture of experts' all-to-all) while the other computes, as DualPipe
      overlaps them. Compiles the paired actions once more.
    stage_axis: the mesh axis of stages.
    data_axis: the mesh axis of data-parallel replicas (the batch is split over it).
  """

  num_stages: int
  num_microbatches: int
  schedule: str = "gpipe"
  num_repeats: int = 1
  balance: Any = "params"
  remat: Any = "full"
  remat_granularity: Any = "nested"
  per_example: Sequence[str] = ()
  unroll: int | bool = 1
  mesh: Mesh | None = None
  transfer_delay: Any = None
  stream_inputs: bool = True
  tick_costs: Any = None
  weight_recompute: bool | str = False
  overlap_microbatches: bool = False
  stage_axis: str = mesh_lib.STAGE_AXIS
  data_axis: str = mesh_lib.DATA_AXIS

  def __post_init__(self):
    for name in ("num_stages", "num_microbatches", "num_repeats"):
      schedules.forward.check_count(name, getattr(self, name))
    if not isinstance(self.schedule, str):
      raise TypeError(f"schedule must be a name, one of {schedules.NAMES}, got "
                      f"{self.schedule!r}.")
    for name in ("stage_axis", "data_axis"):
      if not isinstance(getattr(self, name), str):
        raise TypeError(f"{name} must be a mesh axis name (a string), got "
                        f"{getattr(self, name)!r}.")
    if self.mesh is not None:
      if not isinstance(self.mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                        f"{type(self.mesh).__name__}.")
      mesh_lib.check_stage_axis(self.mesh, self.num_stages, self.stage_axis, "the mesh given")
    if self.transfer_delay is not None:  # Raises for a bad value; a sequence kept as a tuple.
      delays = schedules.actions.link_delays(self.transfer_delay, self.num_stages)
      if not isinstance(self.transfer_delay, (int, np.integer)):
        object.__setattr__(self, "transfer_delay", delays)
    if not isinstance(self.stream_inputs, (bool, np.bool_)):
      raise TypeError(f"stream_inputs must be True or False, got {self.stream_inputs!r}.")
    if not (isinstance(self.tick_costs, str) and self.tick_costs == PLAIN_TICKS):
      object.__setattr__(self, "tick_costs", schedules.check_costs(self.tick_costs))
    object.__setattr__(self, "weight_recompute", check_weight_recompute(self.weight_recompute))
    if self.weight_recompute and self.schedule not in SPLIT_BACKWARD:
      raise ValueError(f"weight_recompute={self.weight_recompute!r} recomputes what W needs in a "
                       f"split backward; schedule={self.schedule!r} has none: use one of "
                       f"{SPLIT_BACKWARD} or weight_recompute=False.")
    self._check_overlap()
    self.table  # Builds (and caches) the table: raises for unknown names or bad repeats.
    check_remat(self.remat)
    check_remat_granularity(self.remat_granularity)
    check_unroll(self.unroll)
    object.__setattr__(self, "balance", _check_balance_form(self.balance, self.num_chunks))
    object.__setattr__(self, "per_example", _check_per_example(self.per_example))
    if self.stage_axis == self.data_axis:
      raise ValueError(f"stage_axis and data_axis must differ, both are {self.stage_axis!r}.")

  def _check_overlap(self) -> None:
    if not isinstance(self.overlap_microbatches, (bool, np.bool_)):
      raise TypeError(f"overlap_microbatches must be True or False, got "
                      f"{self.overlap_microbatches!r}.")
    if not self.overlap_microbatches:
      return
    if not schedules.is_fused(self.schedule):
      raise ValueError(f"overlap_microbatches=True pairs a forward and a backward of one tick; "
                       f"schedule={self.schedule!r} runs its backward apart: use one of "
                       f"{schedules.FUSED_SCHEDULE_NAMES} or overlap_microbatches=False.")
    if self.tick_costs == PLAIN_TICKS:
      raise ValueError("overlap_microbatches=True pairs the actions of compound ticks; "
                       "tick_costs='plain' runs one action per tick: leave tick_costs None (or "
                       "give costs) or set overlap_microbatches=False.")

  def replace(self, **changes) -> "PipelineSpec":
    """A copy with ``changes`` (setting names as keywords), validated again; of the same class
    (a variant such as :class:`tpipe.experimental.search.SearchedSpec` keeps its own settings)."""
    names = tuple(f.name for f in dataclasses.fields(self))
    unknown = sorted(set(changes) - set(names))
    if unknown:
      raise TypeError(f"Unknown pipeline setting(s) {unknown}; the settings are {names}.")
    return dataclasses.replace(self, **changes)

  @property
  def granularity(self) -> Any:
    """The remat granularity the pipeline runs with (:func:`granularity_in_effect`):
    ``remat_granularity``, except ``"chunk"`` under ``remat="none"``."""
    return granularity_in_effect(self.remat, self.remat_granularity)

  @property
  def table(self) -> schedules.Schedule | schedules.FusedSchedule:
    """The schedule's table, from the cached factory :func:`tpipe.schedules.build`."""
    return schedules.build(self.schedule, self.num_stages, self.num_microbatches,
                           self.num_repeats, self.delays, self.given_tick_costs)

  @property
  def given_tick_costs(self) -> tuple[tuple[str, float], ...] | None:
    """The per-action costs the table is laid out for: ``tick_costs``, None for ``"plain"``."""
    return None if self.tick_costs == PLAIN_TICKS else self.tick_costs

  @property
  def delays(self) -> tuple[int, ...]:
    """Per link of the ring of stages, 0 or 1 extra tick: ``transfer_delay`` as given, or (None)
    the links that cross slices of the spec's mesh (:func:`tpipe.mesh.crossing_links`). An
    ambient mesh (``jax.set_mesh``) is abstract inside ``jit``, without devices to tell slices
    apart: with one, give ``transfer_delay`` (or ``mesh=``) to delay links."""
    if self.transfer_delay is not None:
      return schedules.actions.link_delays(self.transfer_delay, self.num_stages)
    if self.mesh is None:
      return (0,) * self.num_stages
    return tuple(int(c) for c in mesh_lib.crossing_links(self.mesh, self.stage_axis))

  @property
  def is_fused(self) -> bool:
    """Whether the schedule interleaves forward and backward in one table."""
    return schedules.is_fused(self.schedule)

  @property
  def num_chunks(self) -> int:
    """Chunks the layers are cut into: ``S * R``."""
    return self.num_stages * self.num_repeats

  @property
  def placement(self) -> str:
    """Where chunk ``c`` lives (``"loop"``: stage ``c % S``; ``"v"``: ZB-V's)."""
    return schedules.placement(self.schedule)

  def run_mesh(self, owner: str):
    """The mesh to run on (see :func:`tpipe.mesh.resolve`), errors naming ``owner``."""
    return mesh_lib.resolve(self.mesh, self.num_stages, self.stage_axis, owner)

  def data_size(self, mesh) -> int:
    """Data-parallel replicas on ``mesh`` (1 without a data axis)."""
    return int(dict(mesh.shape).get(self.data_axis, 1))

  def row_shards(self, mesh) -> int:
    """The devices of one stage a batch's rows are split over: ``mesh``'s data x fsdp
    devices."""
    return self.data_size(mesh) * int(dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1))

  def microbatch_size(self, batch: int, row_shards: int = 1) -> int:
    """Examples in one micro-batch on one device: ``batch`` split over ``row_shards`` devices
    (:meth:`row_shards`; 1 for a batch one device holds) and then into ``num_microbatches``;
    at least 1, the one example planning traces a smaller batch with."""
    return max(1, batch // (self.num_microbatches * row_shards))


def field_names() -> tuple[str, ...]:
  """The settings a :class:`PipelineSpec` holds, in order."""
  return tuple(f.name for f in dataclasses.fields(PipelineSpec))


def make(owner: str, spec: PipelineSpec | None = None, **settings) -> PipelineSpec:
  """``spec`` with ``settings`` applied, or a new spec from ``settings``; errors say ``owner``.

  Front ends take a spec, or the settings as keywords (``tpipe.Sequential(layers, num_stages=4,
  num_microbatches=8)``), or both (the keywords override the spec's).

  Raises:
    TypeError, ValueError: a bad setting, prefixed with ``owner`` (the API the user called).
  """
  try:
    if spec is None:
      unknown = sorted(set(settings) - set(field_names()))
      if unknown:
        raise TypeError(f"unknown pipeline setting(s) {unknown}; the settings are "
                        f"{field_names()}.")
      return PipelineSpec(**settings)
    if not isinstance(spec, PipelineSpec):
      raise TypeError(f"spec must be a tpipe.PipelineSpec, got {type(spec).__name__}.")
    return spec.replace(**settings) if settings else spec
  except (TypeError, ValueError) as error:
    raise type(error)(f"{owner}: {error}") from None


def check_remat(remat) -> None:
  """Validates a ``remat`` option: one of :data:`REMAT_NAMES` or a ``jax.checkpoint`` policy."""
  if isinstance(remat, str):
    if remat not in REMAT_NAMES:
      raise ValueError(f"Unknown remat {remat!r}; choose one of {REMAT_NAMES} or pass a "
                       "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable.")
  elif not callable(remat):
    raise TypeError(f"remat must be one of {REMAT_NAMES} or a jax.checkpoint policy callable, "
                    f"got {remat!r} of type {type(remat).__name__}.")


def check_weight_recompute(value) -> bool | str:
  """Validates a ``weight_recompute`` option and returns it as False, ``"forward"`` or
  ``"backward"`` (True is ``"forward"``, ``"none"`` is False)."""
  if isinstance(value, (bool, np.bool_)):
    return "forward" if value else False
  if isinstance(value, str) and value in WEIGHT_RECOMPUTE_NAMES:
    return False if value == "none" else value
  raise (ValueError if isinstance(value, str) else TypeError)(
      f"weight_recompute must be True, False or one of {WEIGHT_RECOMPUTE_NAMES}, got "
      f"{value!r}.")


def check_remat_granularity(granularity) -> int | None:
  """Validates a ``remat_granularity``; returns units per checkpointed piece, or ``None`` for
  ``"chunk"`` (the whole chunk is the one piece).

  Args:
    granularity: ``"chunk"``, ``"layer"`` (the same as ``1``), ``"nested"`` (pieces of one unit
      inside the chunk's own checkpoint, :func:`tpipe.core.planning.remat.chunk_policy`) or a
      positive int ``k``.
  """
  if isinstance(granularity, str):
    if granularity == "chunk":
      return None
    if granularity in ("layer", "nested"):
      return 1
    raise ValueError(f"Unknown remat_granularity {granularity!r}; choose one of "
                     f"{GRANULARITY_NAMES} or a positive int k (k layer units per checkpoint).")
  if isinstance(granularity, (int, np.integer)) and not isinstance(granularity, bool):
    if granularity >= 1:
      return int(granularity)
    raise ValueError(f"remat_granularity must be >= 1 layer units per checkpoint, got "
                     f"{granularity!r}; or choose one of {GRANULARITY_NAMES}.")
  raise TypeError(f"remat_granularity must be one of {GRANULARITY_NAMES} or a positive int, got "
                  f"{granularity!r} of type {type(granularity).__name__}.")


def granularity_in_effect(remat, granularity) -> Any:
  """The remat granularity a pipeline runs with: ``granularity``, except ``"chunk"`` under
  ``remat="none"`` whatever was given. With nothing to recompute, finer pieces would only add
  checkpoints that save everything and loops over pieces (re-rolling ``unroll=True``): a slower
  program that saves no memory. So under ``remat="none"`` every granularity is one
  program, the one that adds nothing. Validates both (raises as :func:`check_remat` and
  :func:`check_remat_granularity` do)."""
  check_remat(remat)
  check_remat_granularity(granularity)
  if isinstance(remat, str) and remat == "none":
    return "chunk"
  return granularity


def check_unroll(unroll) -> None:
  """``unroll`` as ``lax.scan`` takes it: an int >= 1 (units per loop iteration) or a bool."""
  if isinstance(unroll, bool):
    return
  if not isinstance(unroll, (int, np.integer)) or unroll < 1:
    raise ValueError(f"unroll must be an int >= 1 (layer units per iteration of a repeated "
                     f"layer's loop) or True (unroll it whole), got {unroll!r}.")


def _check_balance_form(balance, num_chunks: int):
  """A balance name, or unit counts (a tuple of ints >= 1, one per chunk)."""
  if isinstance(balance, str):
    if balance not in BALANCE_NAMES:
      raise ValueError(f"Unknown balance {balance!r}; choose one of {BALANCE_NAMES} or pass "
                       f"a list of {num_chunks} layer-unit counts, one per chunk.")
    return balance
  not_a_list = (isinstance(balance, bytes) or not hasattr(balance, "__iter__")
                or (isinstance(balance, np.ndarray) and balance.ndim != 1))
  if not_a_list:
    raise TypeError(f"balance must be one of {BALANCE_NAMES} or a list with one layer-unit "
                    f"count per chunk, e.g. [3, 3, 2]; got {balance!r}.")
  counts = []
  for i, count in enumerate(balance):
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
      raise TypeError(f"balance[{i}] = {count!r} is not an int; give each chunk a whole number "
                      "of layer units.")
    if count < 1:
      raise ValueError(f"balance[{i}] = {count}: every chunk needs at least one layer unit.")
    counts.append(int(count))
  if len(counts) != num_chunks:
    raise ValueError(f"balance={counts} has {len(counts)} entries but num_stages * num_repeats "
                     f"= {num_chunks} chunks; give one layer-unit count per chunk.")
  return tuple(counts)


def _check_per_example(per_example) -> tuple[str, ...]:
  if isinstance(per_example, str):
    raise TypeError(f"per_example must be a sequence of keyword names, got the string "
                    f"{per_example!r}; write per_example=({per_example!r},).")
  try:
    names = tuple(per_example)
  except TypeError:
    raise TypeError(f"per_example must be a sequence of keyword names, got {per_example!r}; "
                    "write e.g. per_example=('targets',), or () for none.") from None
  if not all(isinstance(n, str) for n in names):
    raise TypeError(f"per_example must hold keyword names (strings), got {per_example!r}.")
  return names


def layers_per_chunk(length: int, num_chunks: int, owner: str) -> int:
  """Blocks in each chunk; raises ValueError unless ``length`` splits evenly."""
  if length % num_chunks:
    raise ValueError(
        f"{owner}: length={length} layers cannot be split evenly into num_stages * num_repeats "
        f"= {num_chunks} chunks; choose a length that is a multiple of {num_chunks} or change "
        "num_stages/num_repeats.")
  return length // num_chunks


def for_stack(owner: str, length: int, spec: PipelineSpec | None = None,
              **settings) -> PipelineSpec:
  """The spec of a stack of ``length`` identical blocks: the settings given, the blocks cut
  evenly (``balance`` is fixed); fused schedules are refused (a stack returns activations)."""
  try:
    schedules.forward.check_count("length", length)
  except (TypeError, ValueError) as error:
    raise type(error)(f"{owner}: {error}") from None
  if "balance" in settings:
    raise ValueError(f"{owner} cuts the blocks evenly over the chunks; balance is for "
                     "tpipe.Sequential (any sequence of layers).")
  spec = make(owner, spec, **settings)
  if spec.is_fused:
    front = owner.rsplit(".", 1)[0]  # "tpipe" or "tpipe.nnx": the owner's own Sequential.
    raise ValueError(
        f"{owner} returns the blocks' activations, but schedule={spec.schedule!r} runs the "
        "backward inside the pipeline and differentiates the loss, which needs a last layer "
        f"that computes each example's loss. Use {front}.Sequential([{front}.Repeat(block, "
        f"length), YourLoss()], schedule={spec.schedule!r}, per_example=('targets',), ...), or "
        "schedule='gpipe'/'circular' here.")
  per_chunk = layers_per_chunk(length, spec.num_chunks, owner)
  return spec.replace(balance=[per_chunk] * spec.num_chunks)
