"""Fused schedule tables drawn by hand, and a replay of a table's message routing.

Tables are written one row per stage, one column per tick: ``F3`` is the forward of micro-batch
3, ``B``/``BI``/``W`` the full, input and weight backward, ``/c`` the stage's local chunk c,
``.`` idle. A wide table may be drawn in blocks of ticks separated by a blank line. Pure NumPy.
"""

import numpy as np

from tpipe import schedules

IDLE = schedules.IDLE
A = schedules.Action


def parse(text):
  """``(action, microbatch, chunk)`` ``[tick, stage]`` arrays from a hand-drawn table."""
  blocks = [[line.split() for line in block.strip().splitlines()]
            for block in text.strip().split("\n\n")]
  rows = [sum((block[s] for block in blocks), []) for s in range(len(blocks[0]))]
  assert all(len(block) == len(rows) for block in blocks), "blocks with different stage counts"
  assert len({len(r) for r in rows}) == 1, "ragged table"
  tables = np.full((3, len(rows[0]), len(rows)), IDLE, np.int64)
  for s, row in enumerate(rows):
    for t, cell in enumerate(row):
      if cell == ".":
        continue
      name = cell.rstrip("0123456789/")
      numbers = cell[len(name):].split("/")
      tables[:, t, s] = A[name], int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
  return tables


def assert_table(schedule, text):
  """Asserts that ``schedule``'s action, micro-batch and chunk tables are the drawn ones."""
  action, microbatch, chunk = parse(text)
  np.testing.assert_array_equal(schedule.action, action)
  np.testing.assert_array_equal(schedule.microbatch, microbatch)
  np.testing.assert_array_equal(schedule.chunk, chunk)


def fused(text, slots, stages, microbatches, chunks=1, placement="loop", forward_only=False):
  """A :class:`tpipe.schedules.FusedSchedule` named ``"hand"`` from a drawn table and its stash
  slots (``slots`` drawn like the table: one row per stage)."""
  action, microbatch, chunk = parse(text)
  return schedules.FusedSchedule("hand", stages, microbatches, chunks, placement, action=action,
                                 microbatch=microbatch, chunk=chunk,
                                 stash_slot=np.array(slots).T, forward_only=forward_only)


def replay_mailboxes(s):
  """Runs a fused table's routing row by row; returns how many messages were delivered.

  Asserts that every message lands, at the first row of a tick, in a free mailbox slot of the
  right receiver, sent in the tick before (two before over a delayed link), is read once by the
  action that needs it, and that nothing is left over or sent by an action that sends nothing.
  """
  vstage = s.virtual_stage
  first = s.first_rows()
  mailbox = [{} for _ in range(s.num_stages)]  # slot -> (kind, micro-batch, model chunk) held.
  sent = {}  # (row, stage) -> what the action there sent.
  delivered = 0
  for r in range(s.num_rows):
    t = s.tick[r]
    arrivals = s.arrival_slots()[r]
    for dst in range(s.num_stages):
      for k, direction in enumerate((1, -1, 0)):
        slot = arrivals[dst, k]
        if slot != IDLE:
          assert r == first[t], "a message arrives inside a tick"
          src = (dst - direction) % s.num_stages
          delay = s.delays[schedules.actions.link_of(src, direction, s.num_stages)] if (
              direction) else 0
          senders = [q for q in np.nonzero(s.tick == t - 1 - delay)[0]
                     if s.send_dir[q, src] == direction and s.send_slot[q, src] == slot
                     and (q, src) in sent]
          assert len(senders) == 1, "no single sender in the tick the message left"
          assert slot not in mailbox[dst], "overwrote a message nobody read"
          mailbox[dst][slot] = sent[(senders[0], src)]
    for st in np.nonzero(s.busy[r])[0]:
      kind, m = A(s.action[r, st]), int(s.microbatch[r, st])
      v = int(vstage[st, s.chunk[r, st]])
      if kind == A.F:
        expect = ("act", m, v - 1) if v > 0 else None
        sent[(r, st)] = ("act", m, v) if v < vstage.size - 1 else None
      elif kind == A.W:
        expect = None
      else:
        expect = ("grad", m, v + 1) if v < vstage.size - 1 else None
        sent[(r, st)] = ("grad", m, v) if v > 0 else None
      assert (s.send_slot[r, st] != IDLE) == (sent.get((r, st)) is not None and kind != A.W)
      if expect is None:
        assert s.recv_slot[r, st] == IDLE
      else:
        assert mailbox[st].pop(s.recv_slot[r, st]) == expect
        delivered += 1
  assert all(not box for box in mailbox)
  assert all(len(box) <= n for box, n in zip(mailbox, s.mailbox_slots()))
  return delivered
