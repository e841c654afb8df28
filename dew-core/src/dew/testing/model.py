"""ModelKit: a Flax model declares logical axes on every parameter, and shards on eight devices.

dew places parameters from the logical axis names their modules declare
(``nn.with_logical_partitioning``, or the ``dew.nn.sharding`` helpers); a
parameter without them falls back to a heuristic and a misspelled name is
never sharded. Subclass and supply the model and example inputs::

    class TestMyModel(ModelKit):
        def model(self):
            return MyModel(width=64)

        def inputs(self):
            return (jnp.zeros((2, 16), jnp.int32),)

``test_layout_check_passes_on_fake_devices`` builds the layout on a mesh of
``devices`` fake CPU devices (``mesh``: fsdp 4 x tensor 2 by default) in a
child process and runs ``Layout.check``; the class must therefore be defined
at the top level of its module. Choose widths the mesh axes divide, and a
``layout.min_shard`` that the model's large parameters reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import linen as nn

from dew.testing.devices import call_on_fake_devices
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec, build_mesh
from dew.tree_paths import path_name

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["ModelKit"]


def _is_box(x: object) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


class ModelKit:
    """Conformance tests for a Flax model (see the module docstring)."""

    seed: int = 0
    devices: int = 8
    mesh: MeshSpec = MeshSpec(fsdp=4, tensor=2)
    layout: Layout = Layout(min_shard=256)

    def model(self) -> nn.Module:
        """The model under test, freshly built (small)."""
        raise NotImplementedError(f"{type(self).__name__} must define model().")

    def inputs(self) -> tuple[ArrayLike, ...]:
        """Positional arguments for ``model.init(key, *inputs)``."""
        raise NotImplementedError(f"{type(self).__name__} must define inputs().")

    def boxed_variables(self) -> Variables:
        """The model's variables as shapes, with the boxes its modules declared."""
        model, inputs = self.model(), self.inputs()
        return jax.eval_shape(lambda k: model.init(k, *inputs), jax.random.key(self.seed))

    def _parameters(self) -> list[tuple[str, PyTree]]:
        params = self.boxed_variables().get("params", {})
        leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
        return [(path_name(path), leaf) for path, leaf in leaves]

    def test_every_parameter_declares_logical_axes(self) -> None:
        parameters = self._parameters()
        assert parameters, f"{type(self.model()).__name__} has no parameters."
        missing = [name for name, leaf in parameters if not isinstance(leaf, nn.Partitioned)]
        assert not missing, (
            f"{len(missing)} of {len(parameters)} parameters declare no logical axes: {missing[:8]}. "
            "Wrap their initializers in nn.with_logical_partitioning(init, names).")
        wrong = [(name, tuple(leaf.names), tuple(leaf.value.shape)) for name, leaf in parameters
                 if len(leaf.names) != len(leaf.value.shape)]
        assert not wrong, f"Axis names that do not match the parameter's rank: {wrong[:5]}."

    def test_logical_axes_are_named_in_the_layout_rules(self) -> None:
        known = {name for name, _ in self.layout.axis_rules}
        unknown = sorted({(axis, name) for name, leaf in self._parameters()
                          if isinstance(leaf, nn.LogicallyPartitioned)
                          for axis in leaf.names if axis is not None and axis not in known})
        assert not unknown, (
            f"Logical axes that no layout rule names, so they never shard: {unknown[:8]}. Use the names "
            f"of dew.nn.sharding or add rules to the layout ({sorted(known)}).")

    def test_layout_check_passes_on_fake_devices(self) -> None:
        call_on_fake_devices(type(self), "check_layout_here", devices=self.devices)

    def check_layout_here(self) -> None:
        """Run Layout.check on this process's devices (the child process of the test above)."""
        assert len(jax.devices()) == self.devices, (
            f"Expected {self.devices} devices, this process sees {len(jax.devices())}.")
        mesh = build_mesh(self.mesh)
        boxed = self.boxed_variables()
        shardings = self.layout.shardings(mesh, boxed)
        large = [leaf for leaf in jax.tree.leaves(nn.meta.unbox(boxed))
                 if leaf.size >= self.layout.min_shard]
        assert large, (
            f"No parameter reaches layout.min_shard={self.layout.min_shard} elements, so "
            "Layout.check would check nothing; lower min_shard or widen the model.")
        self.layout.check(boxed, shardings, mesh)
