"""Layout.shardings on leaves no module declares axes for: the largest-divisible-axis heuristic.

The spec (Layout.shardings): "A leaf whose path no module declares takes the
largest-divisible-axis heuristic, so a model family can be declared at a
time." The parameter axes are fsdp, expert and tensor; the largest that
divides a dimension takes it, then the next. Checked on abstract meshes (no
devices needed); the many-device run is in test_batch_axes.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import MESH_AXES


def mesh(**sizes: int) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


@pytest.mark.parametrize(
    ("sizes", "shape", "expected"),
    [
        # the case the fsdp-only heuristic left whole: tensor alone splits the larger dimension
        ({"tensor": 4}, (1024, 1024), P("tensor", None)),
        ({"expert": 2}, (512, 1024), P(None, "expert")),
        # as before under fsdp alone: the largest dimension fsdp divides, the first of equals
        ({"fsdp": 4}, (6, 8), P(None, "fsdp")),
        # the largest axis first (tensor=4), then fsdp on what is left largest
        ({"fsdp": 2, "tensor": 4}, (1024, 1024), P("tensor", "fsdp")),
        # 6 columns take no axis, so both stack on the rows
        ({"fsdp": 2, "tensor": 4}, (1024, 6), P(("tensor", "fsdp"), None)),
        # an axis that divides no dimension leaves the leaf whole along it
        ({"tensor": 8}, (6, 10), P(None, None)),
        ({"fsdp": 3, "tensor": 4}, (1024, 1024), P("tensor", None)),
    ],
)
def test_an_undeclared_leaf_takes_the_largest_axis_that_divides_a_dimension(sizes, shape, expected):
    assert Layout(min_shard=0).spec(shape, None, mesh(**sizes)) == expected


def _undeclared(shape: tuple[int, ...]) -> dict:
    """A variables tree whose one parameter no module declared axes for (a plain nn.Dense kernel)."""
    return {"params": {"Dense_0": {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)}}}


def test_under_tensor_alone_check_accepts_what_it_refused_replicated():
    """Before: under tensor=4 alone a (1024, 1024) leaf stayed whole and check refused the layout."""
    layout, where = Layout(), mesh(tensor=4)
    params = _undeclared((1024, 1024))
    placed = layout.shardings(where, params)
    kernel = placed["params"]["Dense_0"]["kernel"]
    factor = math.prod(where.shape[a] for a in kernel.spec if a is not None)
    assert factor == 4  # a quarter of the matrix per device: the perfect share over tensor=4
    layout.check(params, placed, where)  # accepted
    whole = jax.tree.map(lambda _: NamedSharding(where, P()), params)
    with pytest.raises(LayoutError, match="300.0% more parameter memory") as refused:
        layout.check(params, whole, where)  # what the fsdp-only heuristic gave
    # Whole on each of 4 devices is 4x the perfect share: the tolerance the refusal names (3, above
    # the 1.0 a fraction would stop at) accepts it, and anything below it does not.
    assert "Layout(tolerance=3)" in str(refused.value)
    Layout(tolerance=3.0).check(params, whole, where)
    with pytest.raises(LayoutError, match="300.0%"):
        Layout(tolerance=2.99).check(params, whole, where)


def test_declared_leaves_keep_their_rules():
    """The heuristic is only for leaves without names: a declared one follows DEFAULT_RULES."""
    layout = Layout(min_shard=0)
    assert layout.spec((1024, 1024), ("embed", "mlp"), mesh(tensor=4)) == P(None, "tensor")
    assert layout.spec((1024, 1024), ("embed", "kv"), mesh(tensor=4)) == P(None, None)
