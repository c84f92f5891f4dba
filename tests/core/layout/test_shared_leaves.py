"""tpipe.core.layout.shared_leaves: which plain layers' weights move to shared staged arrays, how
they
group (one canonical shape, either orientation) and when they stay packed. Pure NumPy."""

import doctest

import pytest

from tpipe.core.layout import shared_leaves

pytestmark = pytest.mark.unit

Candidate = shared_leaves.Candidate


def _weight(stage, layer, shape, path="['kernel']", dtype="float32", names=None):
  return Candidate(chunk=stage, stage=stage, layer=layer, path=path, shape=shape, dtype=dtype,
                   names=names)


def test_canonical_puts_a_matrix_larger_dimension_first():
  assert shared_leaves.canonical((8, 100)) == ((100, 8), True)
  assert shared_leaves.canonical((100, 8)) == ((100, 8), False)
  assert shared_leaves.canonical((4, 4)) == ((4, 4), False)
  assert shared_leaves.canonical((2, 3, 4)) == ((2, 3, 4), False)  # Only matrices turn.
  assert shared_leaves.canonical((7,)) == ((7,), False)


def test_embedding_and_head_share_one_leaf_the_head_transposed():
  embed = _weight(0, 0, (100, 8), "['embedding']", names=("vocab", "embed"))
  head = _weight(3, 2, (8, 100), names=("embed", "vocab"))
  bias = _weight(3, 2, (100,), "['bias']")
  (group,) = shared_leaves.plan([embed, bias, head], num_stages=4)
  assert (group.name, group.shape, group.dtype, group.slots) == ("shared_0", (100, 8),
                                                                 "float32", 1)
  assert group.names == ("vocab", "embed")  # The first member's orientation and names.
  assert group.members == (
      shared_leaves.Member(chunk=0, layer=0, path="['embedding']", slot=0, transposed=False),
      shared_leaves.Member(chunk=3, layer=2, path="['kernel']", slot=0, transposed=True))
  assert group.entry_bytes == 100 * 8 * 4


def test_weights_of_one_stage_take_a_slot_each():
  first, second = _weight(1, 0, (6, 6), "['a']"), _weight(1, 0, (6, 6), "['b']")
  (group,) = shared_leaves.plan([first, second, _weight(0, 1, (6, 6))], num_stages=2)
  assert group.slots == 2
  assert [(m.chunk, m.slot) for m in group.members] == [(1, 0), (1, 1), (0, 0)]


def test_a_group_moves_only_where_it_costs_no_more_than_it_saves():
  # Stage 0 holds two [100, 8] matrices and stage 1 one: a shared leaf of 2 entries per stage
  # (6,400 bytes per device) for what it takes out of the fullest stage's packed buffer.
  matrices = [_weight(0, 0, (100, 8), "['a']"), _weight(0, 0, (100, 8), "['b']"),
              _weight(1, 1, (8, 100))]
  (group,) = shared_leaves.plan(matrices, num_stages=2)  # Stage 0 packs 6,400 bytes less.
  assert group.slots == 2 and [m.transposed for m in group.members] == [False, False, True]
  # With an 8,000-byte vector on stage 1, the fullest stage shrinks by 3,200 bytes only.
  big_vector = _weight(1, 1, (2000,), "['bias']")
  assert shared_leaves.plan(matrices + [big_vector], num_stages=2) == ()
  # A weight on one stage alone never pays while another stage packs anything.
  assert shared_leaves.plan([matrices[0], _weight(1, 1, (10,))], num_stages=2) == ()


def test_dtypes_and_shapes_group_apart_largest_first():
  weights = [_weight(0, 0, (16, 4)), _weight(1, 1, (4, 16)),
             _weight(0, 0, (16, 4), "['half']", dtype="bfloat16"),
             _weight(1, 1, (16, 4), "['half']", dtype="bfloat16"),
             _weight(0, 0, (32, 8), "['big']"), _weight(1, 1, (32, 8), "['big']"),
             _weight(0, 0, (16,), "['bias']"), _weight(1, 1, (16,), "['bias']")]
  groups = shared_leaves.plan(weights, num_stages=2)
  kinds = [(g.shape, g.dtype) for g in groups]
  assert kinds == [((32, 8), "float32"), ((16, 4), "float32"), ((16, 4), "bfloat16")]
  assert [g.name for g in groups] == ["shared_0", "shared_1", "shared_2"]
  assert all(g.slots == 1 and len(g.members) == 2 for g in groups)


def test_module_doctest():
  result = doctest.testmod(shared_leaves)
  assert result.attempted >= 3 and result.failed == 0
