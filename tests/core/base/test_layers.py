"""tpipe.core.base.layers: unit names, the RNG rule, keyword routing and the input checks shared by
every front end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import core_layers as cl
from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib


def _layer(kind, copies=None, keywords=None):
  return layers_lib.Layer(kind=kind, copies=copies, apply=lambda *a: a, keywords=keywords)


@pytest.mark.unit
def test_unit_names_and_counts():
  layers = [_layer("Embed"), _layer("Block", copies=3), _layer("Head")]
  assert [layer.units for layer in layers] == [1, 3, 1]
  assert layers_lib.unit_names(layers) == (
      "layers_0 Embed", "layers_1[0] Block", "layers_1[1] Block", "layers_1[2] Block",
      "layers_2 Head")


def test_unit_rngs_follow_the_rule_and_are_deterministic():
  rngs = {"dropout": jax.random.key(3), "noise": jax.random.key(4)}
  keys = layers_lib.unit_rngs(rngs, 5, 2)
  assert set(keys) == {"dropout", "noise"}
  want = jax.random.fold_in(jax.random.fold_in(rngs["dropout"], 5), 2)
  np.testing.assert_array_equal(jax.random.key_data(keys["dropout"]), jax.random.key_data(want))
  again = layers_lib.unit_rngs(rngs, 5, 2)
  np.testing.assert_array_equal(jax.random.key_data(again["noise"]),
                                jax.random.key_data(keys["noise"]))
  data = {(u, m): jax.random.key_data(layers_lib.unit_rngs(rngs, u, m)["dropout"]).tolist()
          for u in range(3) for m in range(3)}
  assert len({str(v) for v in data.values()}) == 9  # Every unit and micro-batch its own key.
  assert layers_lib.unit_rngs({}, 1, 1) == {}


def test_layer_keywords_routes_what_each_layer_takes():
  mask, targets = jnp.ones((2, 2), bool), jnp.zeros((4,))
  split = arguments.split_keywords({"mask": mask, "targets": targets, "train": True},
                                   per_example=("targets",), batch_size=4, owner="test")
  taking = layers_lib.layer_keywords(_layer("A", keywords=("mask", "train")), split,
                                     split.broadcast, split.per_example)
  assert set(taking) == {"mask", "train"} and taking["train"] is True
  assert taking["mask"] is mask
  anything = layers_lib.layer_keywords(_layer("B"), split, split.broadcast, split.per_example)
  assert set(anything) == {"mask", "targets", "train"}
  assert layers_lib.layer_keywords(_layer("C", keywords=()), split, split.broadcast,
                                   split.per_example) == {}


@pytest.mark.unit
def test_check_keywords_names_the_unknown_ones():
  layers = [_layer("A", keywords=("mask",)), _layer("B", keywords=("targets",))]
  layers_lib.check_keywords(layers, ["mask", "targets"], "owner")
  with pytest.raises(TypeError, match=r"owner: no layer's call takes the keyword argument\(s\) "
                     r"\['other'\]; the layers take \['mask', 'targets'\]"):
    layers_lib.check_keywords(layers, ["mask", "other"], "owner")
  with pytest.raises(ValueError, match="per_example names 'other'"):
    layers_lib.check_keywords(layers, ["other"], "owner", what="per_example name")
  layers_lib.check_keywords(layers + [_layer("C")], ["other"], "owner")  # **kwargs takes any.


@pytest.mark.unit
def test_batch_size_checks_the_leading_axis():
  assert layers_lib.batch_size({"a": np.zeros((6, 2)), "b": np.zeros((6,))}, "owner") == 6
  with pytest.raises(ValueError, match="owner: the input x has no arrays"):
    layers_lib.batch_size({}, "owner")
  with pytest.raises(ValueError, match=r"the same leading batch axis; got shapes \[\(6, 2\), "
                     r"\(5,\)\]"):
    layers_lib.batch_size([np.zeros((6, 2)), np.zeros((5,))], "owner")
  with pytest.raises(ValueError, match="the same leading batch axis"):
    layers_lib.batch_size([np.float32(1.0)], "owner")


@pytest.mark.unit
def test_from_measure_keeps_of_one_call_what_each_apply_returns():
  calls = []

  def measure(params, stats, h, kwargs, rngs):
    calls.append((params, stats, h, kwargs, rngs))
    return h * params, {"mean": h}, {("bn",): 0.9}, {"loss": h}

  layer = layers_lib.from_measure("Scale", 3, measure, keywords=("train",), identity="id",
                                  aux_values=lambda sown: {"aux_loss/x": sown["loss"] + 1})
  assert (layer.kind, layer.copies, layer.units, layer.keywords, layer.identity) == (
      "Scale", 3, 3, ("train",), "id")
  args = (2, {}, 5, {"train": True}, {})
  assert layer.apply(*args) == (10, {"mean": 5})
  assert layer.apply_with_momenta(*args) == (10, {"mean": 5}, {("bn",): 0.9})
  assert layer.apply_with_aux_values(*args) == (10, {"mean": 5}, {"aux_loss/x": 6})
  assert calls == [args] * 3


@pytest.mark.unit
def test_check_unsown_names_what_would_be_dropped_and_the_fix():
  layers_lib.check_unsown([], "Block writes to the variable collection(s)", "fix it")
  with pytest.raises(ValueError, match=r"^Block writes to the variable collection\(s\) "
                                       r"\['intermediates'\] \(with self.sow\), which its caller "
                                       r"would receive outside a pipeline, .* Take what you need "
                                       r"from the output instead, or fix it\.$"):
    layers_lib.check_unsown(["intermediates"], "Block writes to the variable collection(s)",
                            "fix it")


@pytest.mark.unit
def test_logical_names_are_one_copys():
  annotations = [("['kernel']", ("layers", "embed", "mlp"), 3), ("['bias']", ("mlp",), 2),
                 ("['scale']", None, 2)]
  # Stacked copies: a name on the copy axis (as long as the leaf's dimensions) is dropped.
  assert layers_lib.logical_names(annotations, copies=4) == {
      "['kernel']": ("embed", "mlp"), "['bias']": ("mlp",), "['scale']": None}
  assert layers_lib.logical_names(annotations, copies=None) == {
      "['kernel']": ("layers", "embed", "mlp"), "['bias']": ("mlp",), "['scale']": None}
  assert layers_lib.logical_names([("['w']", ["embed"], 1)], None) == {"['w']": ("embed",)}


def test_abstract_types_and_copies():
  tree = {"w": jnp.zeros((3, 4, 2), jnp.bfloat16), "b": np.zeros((3,), np.int32)}
  abstract = layers_lib.abstract(tree)
  assert abstract["w"] == jax.ShapeDtypeStruct((3, 4, 2), jnp.bfloat16)
  assert layers_lib.types(tree) == {"w": ((3, 4, 2), "bfloat16"), "b": ((3,), "int32")}
  assert layers_lib.same_type(tree, abstract)
  assert not layers_lib.same_type(tree, {"w": abstract["w"], "b": abstract["w"]})
  assert layers_lib.one_copy(tree)["w"] == jax.ShapeDtypeStruct((4, 2), jnp.bfloat16)


def test_eval_shape_passes_python_values_as_they_are():
  fn = lambda x, train, scale: x * scale if train else x[:1]
  out = layers_lib.eval_shape(fn, jnp.zeros((4, 2)), True, 2.0)
  assert out.shape == (4, 2)
  assert layers_lib.eval_shape(fn, jnp.zeros((4, 2)), False, 2.0).shape == (1, 2)


def test_outside_mesh_binds_axis_names_to_groups_of_one():
  mean_over_data = lambda x: jax.lax.pmean(x, "data") + jax.lax.axis_index("stage")
  bound = layers_lib.outside_mesh(mean_over_data, ("data", "stage"))
  np.testing.assert_array_equal(bound(jnp.arange(3.0)), [0.0, 1.0, 2.0])


def test_the_test_layers_are_core_layers():
  assert layers_lib.unit_names(cl.LAYERS) == (
      "layers_0 Project", "layers_1[0] Block", "layers_1[1] Block", "layers_1[2] Block",
      "layers_1[3] Block", "layers_2 Loss")
