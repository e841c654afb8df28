"""Layout.spec: logical axes onto mesh axes, checked on an abstract mesh (no devices needed)."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import MESH_AXES


def mesh(**sizes):
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


LAYOUT = Layout(min_shard=0)


@pytest.mark.parametrize(
    ("shape", "names", "expected"),
    [
        ((64, 256), ("embed", "mlp"), PartitionSpec("fsdp", "tensor")),
        ((256, 64), ("mlp", "embed"), PartitionSpec("tensor", "fsdp")),
        # heads takes tensor; fsdp (which 4 heads cannot also take) stays free for embed
        ((4, 16, 64), ("heads", "kv", "embed"), PartitionSpec("tensor", None, "fsdp")),
        # 257 rows divide neither axis: the vocabulary stays whole, embed still shards
        ((257, 64), ("vocab", "embed"), PartitionSpec(None, "fsdp")),
        ((256, 64), ("vocab", "embed"), PartitionSpec(("tensor", "fsdp"), None)),
        ((64,), ("embed",), PartitionSpec("fsdp")),
    ],
)
def test_rules_place_each_dimension(shape, names, expected):
    assert LAYOUT.spec(shape, names, mesh(fsdp=4, tensor=2)) == expected


def test_axes_of_size_one_shard_nothing():
    assert LAYOUT.spec((64, 256), ("embed", "mlp"), mesh()) == PartitionSpec(None, None)


def test_small_parameters_stay_replicated():
    assert Layout().spec((64, 256), ("embed", "mlp"), mesh(fsdp=4)) == PartitionSpec()


def test_undeclared_parameters_take_the_largest_dimension_fsdp_divides():
    assert LAYOUT.spec((6, 8), None, mesh(fsdp=4)) == PartitionSpec(None, "fsdp")


def test_a_rule_onto_a_batch_axis_is_refused():
    layout = Layout(rules=(("embed", "data"),), min_shard=0)
    with pytest.raises(LayoutError, match="split the batch"):
        layout.spec((64,), ("embed",), mesh(data=2))


def test_a_rule_naming_no_mesh_axis_is_refused_with_the_axis_it_likely_meant():
    """A parameter rule onto a misspelled axis left the parameter whole on every device (the only
    sign, if any, a tolerance refusal blaming the mesh's sizes); an activation rule's stopped the
    step with JAX's traceback."""
    for rules, said in (({"embed": "fdsp"}, r"'embed' -> 'fdsp' names 'fdsp', which is no mesh axis .*'fsdp' for 'fdsp'"),
                        ({"batch": ("dta", "fsdp")}, r"names 'dta', which is no mesh axis .*'data' for 'dta'"),
                        ({"mlp": "model"}, r"names 'model', which is no mesh axis \(the mesh's are data, expert")):
        with pytest.raises(LayoutError, match=said) as refused:
            Layout(rules=rules)
        assert "\n" not in str(refused.value)


# -- the stage axis is the layout's own ----------------------------------------------------------


def test_a_rule_onto_the_stage_axis_is_refused_and_the_stack_is_placed_there_by_the_layout():
    # The spec (dew.training, Layout): "A parameter the rules place on the data, sequence or stage
    # axis is refused. [...] The stage axis holds the layer stack's pipeline stages, which the
    # decoder places itself from the stored tree."
    from dew.training.placement.layout import DEFAULT_RULES

    for rules in ((("mlp", "stage"),), (("layers", "stage"),), {"embed": ("fsdp", "stage")}):
        with pytest.raises(LayoutError, match="stage axis"):
            Layout(rules=rules)
    assert all("stage" not in ((axes,) if isinstance(axes, str) else tuple(axes or ()))
               for _, axes in DEFAULT_RULES)
    # No rule names it, yet the stored tree's layers axis splits over the stage axis, whatever
    # the rules, and a small stacked leaf keeps its stage too (its devices hold its layers).
    stages = mesh(stage=2, fsdp=2)
    assert LAYOUT.spec((4, 64, 256), ("layers", "embed", "mlp"), stages) == PartitionSpec("stage", "fsdp", None)
    assert Layout().spec((4, 8), ("layers", "embed"), stages) == PartitionSpec("stage", None)
    own = Layout(rules=(("embed", "fsdp"),), min_shard=0)
    assert own.spec((4, 64), ("layers", "embed"), stages) == PartitionSpec("stage", "fsdp")
    # Activations the stack carries (a pipeline's state) are constrained the same way.
    assert ("layers", "stage") in own.axis_rules and ("layers", "stage") in Layout().axis_rules


def test_a_run_json_written_when_the_defaults_listed_the_stage_rule_still_reads():
    from dew.training.config import TrainerConfig

    written = [["embed", "fsdp"], ["layers", "stage"]]  # as an older dew's run.json records them
    config = TrainerConfig(steps=1, layout={"rules": written})
    assert config.layout.axis_rules == (("embed", "fsdp"), ("layers", "stage"))


def _checked(leaves, sizes, tolerance=0.02):
    """Layout.check of parameters {name: (shape, spec)} placed so on an abstract mesh of sizes."""
    import jax
    from jax.sharding import NamedSharding

    grid = mesh(**sizes)
    params = {"params": {name: jax.ShapeDtypeStruct(shape, "float32") for name, (shape, _) in leaves.items()}}
    shardings = {"params": {name: NamedSharding(grid, spec) for name, (_, spec) in leaves.items()}}
    Layout(tolerance=tolerance).check(params, shardings, grid)


def test_a_pipeline_s_stages_do_not_hide_its_replication_over_fsdp():
    """The held share divided a stage-split stack by the stage axis and the perfect share did not: a
    layout whose fsdp axis split nothing was refused at 200% on fsdp=3 and accepted with 4 stages."""
    stack = {"wo": ((4, 512, 129), PartitionSpec("stage", None, None))}  # 129: fsdp=3 splits neither width
    for sizes in ({"fsdp": 3}, {"fsdp": 3, "stage": 2}, {"fsdp": 3, "stage": 4}):
        with pytest.raises(LayoutError, match=r"keeps 200\.0% more parameter memory"):
            _checked({"wo": ((4, 512, 129), PartitionSpec(None, None, None) if "stage" not in sizes
                             else stack["wo"][1])}, sizes)
    _checked({"wo": ((4, 510, 129), PartitionSpec("stage", "fsdp", None))}, {"fsdp": 3, "stage": 4})  # split: kept


def test_the_refusal_names_only_weights_held_beyond_their_share():
    """It listed the three leaves of most excess, those at exactly their share among them."""
    leaves = {"embed": ((257, 256), PartitionSpec(None, "fsdp")),  # 257 rows: tensor=2 cannot split them
              "wo": ((1024, 256), PartitionSpec("tensor", "fsdp")),
              "wi": ((256, 1024), PartitionSpec("fsdp", "tensor"))}
    with pytest.raises(LayoutError, match=r"Most replicated: \['params'\]\['embed'\] \(257, 256\)\. Choose"):
        _checked(leaves, {"fsdp": 4, "tensor": 2})
