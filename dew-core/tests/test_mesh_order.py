"""build_mesh's device order: jax.make_mesh's topology order when devices are unset, row-major when given.

The spec (build_mesh): "devices names the devices and their order on one
slice: the mesh takes them row-major over MESH_AXES, so the last axes hold
neighbouring entries. Unset is every device, in the order jax.make_mesh
gives the platform's topology." A TPU slice cannot be had on a CPU, so its
chips are stood in for by objects carrying what JAX reads of a device (its
platform, kind, torus coordinates); jax.make_mesh lays them out for real.
"""

from __future__ import annotations

import dataclasses
import random
from unittest import mock

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from dew.training.placement.mesh import MESH_AXES, MeshSpec, ReplicaError, build_mesh


@dataclasses.dataclass(frozen=True)
class Chip:
    """What jax.make_mesh reads of a device."""

    id: int
    coords: tuple[int, int, int]
    platform: str = "tpu"
    device_kind: str = "TPU v4"
    process_index: int = 0
    core_on_chip: int = 0
    slice_index: int = 0


def v4_slice(shuffle: int | None = 0, **fields) -> list[Chip]:
    """A 2x2x2 TPU v4 slice (eight chips), listed in a shuffled order."""
    chips = [Chip(i, (x, y, z), **fields) for i, (z, y, x) in enumerate(np.ndindex(2, 2, 2))]
    if shuffle is not None:
        random.Random(shuffle).shuffle(chips)
    return chips


def neighbours(a: Chip, b: Chip) -> bool:
    return sum(abs(p - q) for p, q in zip(a.coords, b.coords, strict=True)) == 1


def test_unset_devices_take_the_order_make_mesh_gives_a_tpu_slice():
    chips = v4_slice()
    spec = MeshSpec(fsdp=4, tensor=2)
    with mock.patch("jax.devices", lambda *args: chips):
        mesh = build_mesh(spec)
    assert mesh.axis_names == MESH_AXES and mesh.axis_types == (AxisType.Auto,) * 6
    sizes = [mesh.shape[a] for a in MESH_AXES]
    made = jax.make_mesh(sizes, MESH_AXES, devices=chips)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in made.devices.flat]
    # The topology order puts the last axis's pairs on neighbouring chips, which the order the
    # devices were listed in does not.
    pairs = mesh.devices.reshape(-1, 2)
    assert all(neighbours(a, b) for a, b in pairs)
    listed = np.asarray(chips, dtype=object).reshape(-1, 2)
    assert not all(neighbours(a, b) for a, b in listed)


def test_given_devices_are_laid_out_row_major_in_their_order():
    chips = v4_slice()
    mesh = build_mesh(MeshSpec(fsdp=4, tensor=2), devices=chips)
    assert [d.id for d in mesh.devices.flat] == [c.id for c in chips]
    assert mesh.devices[0, 0, 0, 1, 0, 0] is chips[1]  # the last axes hold neighbouring entries


def test_unset_devices_on_cpu_keep_the_platforms_order():
    cpus = [Chip(i, (0, 0, 0), platform="cpu", device_kind="cpu") for i in (3, 0, 2, 1)]
    with mock.patch("jax.devices", lambda *args: cpus):
        mesh = build_mesh(MeshSpec(tensor=2))
    assert [d.id for d in mesh.devices.flat] == [3, 0, 2, 1]
    real = build_mesh(MeshSpec())  # this process's own devices, all of them
    assert list(real.devices.flat) == jax.devices()


def test_devices_over_several_slices_ask_for_replicas():
    chips = v4_slice(None) + [dataclasses.replace(c, id=c.id + 8, slice_index=1) for c in v4_slice(None)]
    with mock.patch("jax.devices", lambda *args: chips), \
            pytest.raises(ReplicaError, match=r"span 2 slices.*MeshSpec.replicas=2"):
        build_mesh(MeshSpec(fsdp=8))
