"""tpipe.core.base.arguments: a layer's extra call arguments bound to its signature, sorted into
per-example, broadcast and static values, rebuilt for the call, and the errors of the binding
rules.

The same rules through the front ends (a pipelined block's side inputs) are in
tests/linen/test_call_arguments.py.
"""

import doctest

import jax
import numpy as np
import pytest

from tests.helpers import blocks
from tpipe.core.base import arguments

pytestmark = pytest.mark.unit

WIDTH = 8
BATCH = 16
CALL = blocks.SideInputBlock.__call__  # (self, x, gate, bias, extras=None, *, scale, deterministic)


def _inputs():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((BATCH, WIDTH)), rng.uniform(size=(BATCH, WIDTH)),
          rng.standard_normal(WIDTH))


def _split(args, kwargs, per_example=("gate",), batch_size=BATCH):
  return arguments.split_keywords(arguments.bind(CALL, args, kwargs, owner="SideInputBlock"),
                                  per_example=per_example, batch_size=batch_size,
                                  owner="SideInputBlock")


def test_bound_arguments_sorted_by_kind_and_rebuilt_as_keywords():
  x, gate, bias = _inputs()
  del x
  extras = {"gain": np.ones(WIDTH), "shift": np.zeros(WIDTH)}
  split = _split((gate,), {"bias": bias, "extras": extras, "scale": 2.0})
  assert [a.shape for a in split.per_example] == [(BATCH, WIDTH)]
  assert len(split.broadcast) == 3  # bias and the two arrays of the dict.
  assert split.per_example_names() == ("gate",)
  assert sorted(split.broadcast_names()) == ["bias", "extras", "extras"]
  kwargs = split.rebuild(split.broadcast, split.per_example)
  assert kwargs["gate"] is gate and kwargs["bias"] is bias
  assert kwargs["extras"]["gain"] is extras["gain"] and kwargs["scale"] == 2.0


def test_per_example_argument_is_found_by_name_however_it_is_passed():
  _, gate, bias = _inputs()
  positional = arguments.bind(CALL, (gate, bias), {}, owner="SideInputBlock")
  keyword = arguments.bind(CALL, (), {"bias": bias, "gate": gate}, owner="SideInputBlock")
  assert positional == keyword == {"gate": gate, "bias": bias}
  for split in (_split((gate, bias), {}), _split((), {"bias": bias, "gate": gate})):
    assert split.per_example == (gate,) and split.broadcast == (bias,)
    assert split.names == ("bias", "gate")


def test_bind_gives_a_var_keyword_parameters_entries_by_name():
  def call(self, x, mask, **rest):
    del self, x, mask, rest

  assert arguments.bind(call, (1,), {"train": True}, owner="B") == {"mask": 1, "train": True}


def test_bind_refuses_values_that_cannot_be_passed_by_name():
  def by_position(self, x, mask, /, train=False):
    del self, x, mask, train

  def rest(self, x, *more, train=False):
    del self, x, more, train

  with pytest.raises(TypeError, match=r"B.__call__\(self, x, mask, /, train=False\) takes 'mask' "
                                      r"by position only.*can be passed by keyword"):
    arguments.bind(by_position, (1,), {}, owner="B")
  with pytest.raises(TypeError, match=r"takes 'more' by position only"):
    arguments.bind(rest, (1, 2), {}, owner="B")
  assert arguments.bind(rest, (), {"train": True}, owner="B") == {"train": True}


def test_rebuild_puts_new_arrays_in_place_and_keeps_static_values():
  _, gate, bias = _inputs()
  split = _split((gate, bias), {"deterministic": False, "scale": 3})
  # Python numbers and bools are static: neither broadcast nor split, never traced.
  assert split.names == ("bias", "gate")
  micro = gate[:4]
  kwargs = split.rebuild(("new bias",), (micro,))
  assert kwargs == {"gate": micro, "bias": "new bias", "scale": 3, "deterministic": False}
  # Abstract arrays are arrays too (shapes are planned before any value exists).
  abstract = _split((jax.ShapeDtypeStruct((BATCH, WIDTH), np.float32),
                     jax.ShapeDtypeStruct((WIDTH,), np.float32)), {})
  assert abstract.names == ("bias", "gate")


def test_split_keywords_rebuilds_keywords_only():
  _, gate, bias = _inputs()
  split = arguments.split_keywords({"targets": gate, "bias": bias, "train": True},
                                   per_example=("targets",), batch_size=BATCH, owner="model")
  assert split.per_example == (gate,) and split.broadcast == (bias,)
  kwargs = split.rebuild((bias[:2],), (gate[:4],))
  assert kwargs["targets"].shape == (4, WIDTH) and kwargs["bias"].shape == (2,)
  assert kwargs["train"] is True


@pytest.mark.parametrize("per_example,error,match", [
    ("gate", TypeError, r"got the string 'gate'; write per_example=\('gate',\)"),
    ((1,), TypeError, r"per_example must hold parameter names \(strings\), got \(1,\)"),
    (("x",), ValueError, "per_example names 'x', the input SideInputBlock pipelines; the input is "
                         "always split into micro-batches, so leave it out of per_example"),
    (("mask",), ValueError, r"per_example names 'mask', which is not a parameter of "
                            r"SideInputBlock.__call__; its parameters after the input are "
                            r"\['gate', 'bias', 'extras', 'scale', 'deterministic'\]"),
])
def test_check_per_example_names_the_fix(per_example, error, match):
  with pytest.raises(error, match=match):
    arguments.check_per_example(CALL, per_example, "SideInputBlock")


def test_check_per_example_returns_the_names():
  assert arguments.check_per_example(CALL, ["gate", "extras"], "SideInputBlock") == (
      "gate", "extras")
  assert arguments.extra_parameter_names(CALL) == ("gate", "bias", "extras", "scale",
                                                   "deterministic")


def test_keyword_names_are_none_for_a_call_taking_any():
  assert arguments.keyword_names(CALL) == ("gate", "bias", "extras", "scale", "deterministic")

  def takes_any(self, x, mask, **kwargs):
    del self, x, mask, kwargs

  def takes_positions(self, x, *rest, train=False):
    del self, x, rest, train

  assert arguments.keyword_names(takes_any) is None
  assert arguments.keyword_names(takes_positions) == ("train",)


def test_per_example_array_needs_the_batch_as_leading_axis():
  _, gate, bias = _inputs()
  with pytest.raises(ValueError, match=r"per-example argument 'gate' of SideInputBlock has an "
                                       r"array of shape \(8, 8\), but per-example arrays need "
                                       r"the batch \(16\) as their leading axis.*drop 'gate' "
                                       r"from per_example"):
    _split((gate[:8], bias), {})
  extras = {"gain": np.ones(BATCH), "shift": np.zeros(())}
  with pytest.raises(ValueError, match=r"'extras' of SideInputBlock has an array at "
                                       r"\['shift'\] of shape \(\)"):
    _split((gate, bias, extras), {}, per_example=("extras",))


def test_arguments_that_do_not_fit_the_signature_are_a_type_error():
  _, gate, bias = _inputs()
  with pytest.raises(TypeError, match=r"do not fit SideInputBlock.__call__\(self, x, gate, bias, "
                                      r".*'colour'"):
    arguments.bind(CALL, (gate, bias), {"colour": 3}, owner="SideInputBlock")
  with pytest.raises(TypeError, match="do not fit SideInputBlock.__call__.*missing a required "
                                      "argument: 'bias'"):
    arguments.bind(CALL, (gate,), {}, owner="SideInputBlock")


def test_a_failure_with_a_batch_like_broadcast_argument_names_per_example_as_the_fix():
  """What both front ends' pipeline transforms raise (tpipe.pipeline, tpipe.nnx.pipeline)."""
  _, gate, bias = _inputs()
  extras = {"gain": np.ones((BATCH, 1)), "shift": np.zeros(WIDTH)}
  split = _split((gate, bias, extras), {}, per_example=())
  assert arguments.batch_like_broadcast(split, BATCH) == ("extras", "gate")
  with pytest.raises(ValueError, match=r"^SideInputBlock failed on one micro-batch: TypeError: "
                                       r"shapes\nThe broadcast argument\(s\) \['extras', 'gate'\] "
                                       r"have the batch size 16 .* pass per_example=\('extras', "
                                       r"'gate'\) to tpipe.pipeline\.$") as caught:
    with arguments.hint_per_example(split, BATCH, failed="SideInputBlock",
                                    owner="tpipe.pipeline"):
      raise TypeError("shapes")
  assert isinstance(caught.value.__cause__, TypeError)
  # Without such an argument (gate split per example, bias one row) the error passes as it was.
  split = _split((gate, bias), {})
  assert arguments.batch_like_broadcast(split, BATCH) == ()
  with pytest.raises(TypeError, match="^shapes$"):
    with arguments.hint_per_example(split, BATCH, failed="SideInputBlock",
                                    owner="tpipe.pipeline"):
      raise TypeError("shapes")
  # Other errors are not the layers' shape errors: they pass too.
  split = _split((gate, bias, extras), {}, per_example=())
  with pytest.raises(KeyError):
    with arguments.hint_per_example(split, BATCH, failed="SideInputBlock",
                                    owner="tpipe.pipeline"):
      raise KeyError("gain")


def test_module_doctests_pass():
  result = doctest.testmod(arguments)
  assert result.attempted >= 6 and result.failed == 0
