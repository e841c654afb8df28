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
