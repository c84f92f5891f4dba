"""The named fused schedules as per-stage action orders: 1F1B, interleaved 1F1B, ZB-H1, ZB-V.

Each schedule is written as the order in which every stage runs its actions; :func:`place` in
:mod:`tpipe.schedules.fused` lays the orders out on ticks (a stage idles until an action's inputs
are done) and validates the table. Every builder takes ``delays`` (per link, 0 or 1 extra tick,
:func:`~tpipe.schedules.actions.link_delays`): the same orders, laid out with the longer
transfers (1F1B and ZB-H1 warm up with one more forward per delayed link ahead). Pure NumPy.
The builders here are what :func:`tpipe.schedules.build` calls; make tables with that, which
validates its arguments and caches the table.
"""

from __future__ import annotations

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import forward as forward_lib
from tpipe.schedules import fused as fused_lib

Action = actions_lib.Action
FusedSchedule = fused_lib.FusedSchedule

# The fused schedules, as :func:`tpipe.schedules.build` knows them, and their chunks per stage
# (None: at least 2, given by num_repeats).
NAMES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def _warmup_delays(delays, num_stages: int, stage: int) -> int:
  """Extra warm-up forwards stage ``s`` needs so delayed links do not idle its steady state:
  each delayed link between it and the last stage adds two ticks to a micro-batch's round trip,
  one forward-backward pair's worth."""
  return sum(actions_lib.link_delays(delays, num_stages)[stage:num_stages - 1])


def _order_1f1b(num_stages: int, num_microbatches: int, stage: int, delays=None):
  """PipeDream-Flush: ``S - 1 - s`` warm-up forwards (one more per delayed link on the way to
  the last stage), then one forward and one backward in turn."""
  warmup = min(num_stages - 1 - stage + _warmup_delays(delays, num_stages, stage),
               num_microbatches)
  order = [(Action.F, m, 0) for m in range(warmup)]
  for i in range(num_microbatches - warmup):
    order += [(Action.F, warmup + i, 0), (Action.B, i, 0)]
  return order + [(Action.B, m, 0) for m in range(num_microbatches - warmup, num_microbatches)]


def _order_zb_h1(num_stages: int, num_microbatches: int, stage: int, delays=None):
  """ZB-H1: 1F1B's order with ``B`` split into ``BI`` and ``W``, stage ``s`` deferring ``s`` W's.

  ``W`` of micro-batch ``k - s`` follows ``BI`` of ``k``, the last ``s`` come at the end: every
  stage holds up to ``S`` micro-batches (1F1B's stage 0), and the deferred ``W`` fill the tail.
  """
  order = []
  for kind, m, c in _order_1f1b(num_stages, num_microbatches, stage, delays):
    if kind == Action.F:
      order.append((kind, m, c))
    else:
      order.append((Action.BI, m, c))
      if m >= stage:
        order.append((Action.W, m - stage, c))
  pending = range(max(0, num_microbatches - stage), num_microbatches)
  return order + [(Action.W, m, 0) for m in pending]


def _order_interleaved(num_stages: int, num_microbatches: int, num_chunks: int, stage: int):
  """Interleaved 1F1B (Megatron-LM): groups of S micro-batches go through the chunks in turn.

  Forward order: for each group, chunk 0 of its micro-batches, then chunk 1, ...; backward order
  the same with the chunks reversed. ``2 (S - 1 - s) + (C - 1) S`` warm-up forwards, then one
  forward and one backward in turn. The pattern is written for whole groups: when S does not
  divide M, the last group is padded with micro-batches that do not exist, and their actions are
  left out afterwards (leaving actions out never makes a valid order wait on itself).
  """
  padded = -(-num_microbatches // num_stages) * num_stages
  forward, backward = [], []
  for start in range(0, padded, num_stages):
    group = range(start, start + num_stages)
    forward += [(m, c) for c in range(num_chunks) for m in group]
    backward += [(m, c) for c in reversed(range(num_chunks)) for m in group]
  total = len(forward)
  warmup = min(2 * (num_stages - 1 - stage) + (num_chunks - 1) * num_stages, total)
  order = [(Action.F, m, c) for m, c in forward[:warmup]]
  for (fm, fc), (bm, bc) in zip(forward[warmup:], backward):
    order += [(Action.F, fm, fc), (Action.B, bm, bc)]
  order += [(Action.B, m, c) for m, c in backward[total - warmup:]]
  return [(kind, m, c) for kind, m, c in order if m < num_microbatches]


def _order_zbv(num_stages: int, num_microbatches: int, stage: int):
  """ZB-V (Qi et al., 2024, sec. 6), chunk 0 going down the stages and chunk 1 coming back.

  The pattern is written for at least ``2S - 1`` micro-batches; with fewer, the actions of the
  missing ones are left out (the rest keep their order).
  """
  count = max(num_microbatches, 2 * num_stages - 1)
  nxt = {a: [0, 0] for a in Action}
  order = []

  def do(kind, c):
    order.append((kind, nxt[kind][c], c))
    nxt[kind][c] += 1

  for _ in range(2 * (num_stages - stage) - 1):  # Fill the way down.
    do(Action.F, 0)
  for _ in range(stage):
    do(Action.F, 1)
    do(Action.F, 0)
  for _ in range(num_stages - stage):  # The first micro-batches turn back up.
    do(Action.F, 1)
    do(Action.BI, 1)
    do(Action.W, 1)
  while nxt[Action.F][1] < nxt[Action.F][0] or nxt[Action.F][0] < count:  # Steady state.
    if nxt[Action.F][0] < count:
      do(Action.F, 0)
    do(Action.BI, 0)
    do(Action.W, 0)
    do(Action.F, 1)
    do(Action.BI, 1)
    do(Action.W, 1)
  for _ in range(stage):  # Drain: input gradients first, weight passes fill in behind.
    do(Action.BI, 0)
    do(Action.BI, 1)
  for _ in range(num_stages - stage):
    do(Action.BI, 0)
    do(Action.W, 0)
  for c in (1, 0):
    while nxt[Action.W][c] < nxt[Action.BI][c]:
      do(Action.W, c)
  return [(kind, m, c) for kind, m, c in order if m < num_microbatches]


def one_f_one_b(num_stages: int, num_microbatches: int, delays=None) -> FusedSchedule:
  """1F1B, PipeDream-Flush (Narayanan et al., ICML 2021): one forward, one backward in turn.

  Stage ``s`` runs ``S - 1 - s`` warm-up forwards, so at most ``min(S - s, M)`` micro-batches are
  in flight there. ``2 (M + S - 1)`` ticks: GPipe's bubble ``(S - 1) / (M + S - 1)``.
  """
  forward_lib.check_count("num_stages", num_stages)
  forward_lib.check_count("num_microbatches", num_microbatches)
  orders = [_order_1f1b(num_stages, num_microbatches, s, delays) for s in range(num_stages)]
  return fused_lib.place("1f1b", num_stages, num_microbatches, 1, "loop", orders, delays=delays)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_repeats: int,
                     delays=None) -> FusedSchedule:
  """Interleaved 1F1B (Narayanan et al., SC 2021): ``num_repeats`` chunks per stage.

  Chunks are placed as the circular schedule places them (``"loop"``). When S divides M:
  ``2 (R M + S - 1)`` ticks, bubble ``(S - 1) / (R M + S - 1)``, and up to
  ``2 (S - 1 - s) + (R - 1) S + 1`` micro-batch chunks in flight on stage ``s``. Other M run too,
  with a few more ticks.
  """
  forward_lib.check_count("num_stages", num_stages)
  forward_lib.check_count("num_microbatches", num_microbatches)
  forward_lib.check_count("num_repeats", num_repeats)
  if num_repeats < 2:
    raise ValueError(f"schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage, got "
                     f"{num_repeats}; use schedule='1f1b' for one.")
  orders = [_order_interleaved(num_stages, num_microbatches, num_repeats, s)
            for s in range(num_stages)]
  return fused_lib.place("interleaved_1f1b", num_stages, num_microbatches, num_repeats, "loop",
                         orders, delays=delays)


def zb_h1(num_stages: int, num_microbatches: int, delays=None) -> FusedSchedule:
  """ZB-H1 (Qi et al., ICLR 2024, sec. 2.1): 1F1B with the backward split into ``BI`` and ``W``.

  Every stage holds up to ``min(S, M)`` micro-batches. With ``M >= S``: ``3M + S - 1`` ticks, so
  with F, BI and W of equal cost each stage idles ``S - 1`` against ``3M`` of work, a third of
  1F1B's ``3 (S - 1)`` (F = 1, B = 2).
  """
  forward_lib.check_count("num_stages", num_stages)
  forward_lib.check_count("num_microbatches", num_microbatches)
  orders = [_order_zb_h1(num_stages, num_microbatches, s, delays) for s in range(num_stages)]
  return fused_lib.place("zb_h1", num_stages, num_microbatches, 1, "loop", orders, delays=delays)


def zbv(num_stages: int, num_microbatches: int, delays=None) -> FusedSchedule:
  """ZB-V (Qi et al., 2024, sec. 6): two chunks per stage placed in a V, split backward.

  With ``M >= 2S``: ``6M + S - 1`` ticks, each stage idle ``S - 1`` of them whatever M (the
  bubble fraction tends to zero), and ``2S`` micro-batch chunks (half a stage each) in flight.
  """
  forward_lib.check_count("num_stages", num_stages)
  forward_lib.check_count("num_microbatches", num_microbatches)
  orders = [_order_zbv(num_stages, num_microbatches, s) for s in range(num_stages)]
  return fused_lib.place("zbv", num_stages, num_microbatches, 2, "v", orders, delays=delays)
