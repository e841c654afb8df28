"""The trainer's config and recipe overrides: the mapping onto the Trainer, run.json, and the
process setup that runs before JAX starts. (Recipes parsed against registered objectives and
readers are tested in tests/test_recipe_config.py: they need dew-objectives.)"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
import time

import pydantic
import pytest

from dew.recipes.config import apply_overrides
from dew.recipes.errors import RecipeError
from dew.testing.processes import free_port
from dew.training.config import TrainerConfig
from dew.training.runtime.process import _merged_flags, run_timestamp

# -- TrainerConfig -------------------------------------------------------------------------


def test_the_trainer_fields_are_the_trainers_own_types():
    # One type per concept: the recipe's mesh, layout and profile are validated as the very
    # MeshSpec, Layout and ProfileWindow the Trainer takes; no mapper sits between them.
    from dew.training.placement.layout import Layout
    from dew.training.placement.mesh import MeshSpec
    from dew.training.profiling import ProfileWindow

    config = TrainerConfig(
        steps=10, accumulation=2, dynamic_scale=True,
        mesh={"fsdp": 2, "tensor": 2, "stage": 2, "microbatches": 4},
        layout={"rules": [["embed", "fsdp"], ["mlp", ["tensor", "fsdp"]]], "min_shard": 8},
        profile={"directory": "/tmp/trace", "steps": 3},
    )
    assert config.mesh == MeshSpec(fsdp=2, tensor=2, stage=2, microbatches=4)
    assert config.layout == Layout(rules=(("embed", "fsdp"), ("mlp", ("tensor", "fsdp"))), min_shard=8)
    assert config.profile == ProfileWindow("/tmp/trace", steps=3, warmup=2)
    assert TrainerConfig(steps=1).layout == Layout()
    # the checks are the types' own, written once
    with pytest.raises(pydantic.ValidationError, match="must be a positive multiple of stage"):
        TrainerConfig(steps=1, mesh={"stage": 2, "microbatches": 3})
    with pytest.raises(pydantic.ValidationError, match=r"microbatches \(0\) must be a positive multiple of stage"):
        TrainerConfig(steps=1, mesh={"stage": 2, "microbatches": 0})  # 0 is a multiple: refused only at the step
    with pytest.raises(pydantic.ValidationError, match="at least one step"):
        TrainerConfig(steps=1, profile={"directory": "t", "steps": 0})
    with pytest.raises(pydantic.ValidationError, match="fsdpp"):
        TrainerConfig(steps=1, mesh={"fsdpp": 2})


def test_each_group_of_trainer_fields_belongs_to_its_owner():
    from dew.checkpoints.settings import CheckpointSettings
    from dew.training.cadence import Cadence
    from dew.training.config import TrainerSettings
    from dew.training.runtime.process import ProcessSettings

    config = TrainerConfig(steps=5, checkpoint_dir="ckpt", keep=2, xla_flags=["--a=1"], log_every=2)
    for owner in (Cadence, CheckpointSettings, ProcessSettings, TrainerSettings):
        assert isinstance(config, owner)
        assert set(owner.model_fields) <= set(TrainerConfig.model_fields)
    groups = [set(o.model_fields) for o in (Cadence, CheckpointSettings, ProcessSettings, TrainerSettings)]
    assert sum(len(g) for g in groups) == len(set().union(*groups))  # no field has two owners
    assert config.checkpoint_arguments() == {"directory": "ckpt", "keep": 2}
    assert ProcessSettings(**{k: getattr(config, k) for k in ProcessSettings.model_fields}).xla_flags == ["--a=1"]


def test_fit_arguments_count_epochs_in_steps():
    from dew.training.cadence import EpochsNeedRecordsError

    assert TrainerConfig(epochs=2.5, log_every=7).fit_arguments(steps_per_epoch=4) == {
        "steps": 10, "log_every": 7, "eval_every": None, "checkpoint_every": None, "preview": False}
    with pytest.raises(EpochsNeedRecordsError, match="set trainer.steps instead"):
        TrainerConfig(epochs=1).fit_arguments(steps_per_epoch=None)


def test_trainer_from_config_uses_the_mapping():
    import jax
    import optax

    from dew.testing.doubles import Linear
    from dew.training.trainer import Trainer

    objective = Linear()  # a Trainer is given real parts: a stand-in is refused by name
    trainer = Trainer.from_config(TrainerConfig(steps=1, mesh={"fsdp": 1}, accumulation=3),
                                  objective, optax.sgd(0.1), key=jax.random.key(0))
    assert trainer.accumulation == 3 and trainer.objective is objective


# -- overrides, run.json ----------------------------------------------------------------------


def test_overrides_set_nested_keys_list_items_and_typed_values():
    data = {"trainer": {"steps": 3}, "trackers": [{"name": "local", "directory": "a"}]}
    out = apply_overrides(data, ["trainer.steps=10", "trainer.mesh.fsdp=2", "trackers.0.directory=b",
                                 "optimizer.learning_rate=1e-3", "trainer.profile=null",
                                 "description=two words"])
    assert out == {"trainer": {"steps": 10, "mesh": {"fsdp": 2}, "profile": None},
                   "trackers": [{"name": "local", "directory": "b"}],
                   "optimizer": {"learning_rate": 1e-3}, "description": "two words"}
    with pytest.raises(RecipeError, match="not key=value"):
        apply_overrides({}, ["trainer.steps"])
    with pytest.raises(RecipeError, match="holds 1 item"):
        apply_overrides(copy.deepcopy(data), ["trackers.3.name=x"])
    # A value holding "#" lost it as a YAML comment: GSM8K's answer pattern became null and dew eval
    # scored 0 without a word; a double-quoted regular expression kept its quotes (YAML refuses "\d").
    out = apply_overrides({}, ["answer_pattern=#### (.+)", "pattern== (\\d+) #", 'stop="#"',
                               'template="Q: {question}\\nA:"', 'regex="= (\\d+)"', "note=a # b"])
    assert out == {"answer_pattern": "#### (.+)", "pattern": "= (\\d+) #", "stop": "#",
                   "template": "Q: {question}\nA:", "regex": "= (\\d+)", "note": "a # b"}


# -- training from a recipe ------------------------------------------------------------------


def _find_config(row):
    """The recipe inside a journaled run_started row, wherever the journal nests it."""
    if isinstance(row, dict):
        if "config" in row and isinstance(row["config"], dict):
            return row["config"]
        for value in row.values():
            found = _find_config(value)
            if found is not None:
                return found
    return None


# -- the process --------------------------------------------------------------------------------


def test_merged_flags_keep_others_and_replace_same_names():
    assert _merged_flags("--a=1 --b=2", ["--b=3", "--c"]) == "--a=1 --b=3 --c"
    assert _merged_flags("", ["--c"]) == "--c"


def test_prepare_process_raises_limits_and_sets_flags(tmp_path, python_in_subprocess):
    cache = tmp_path / "cache"
    out = python_in_subprocess(f"""
        import resource
        for which in (resource.RLIMIT_NOFILE, resource.RLIMIT_CORE):
            soft, hard = resource.getrlimit(which)
            resource.setrlimit(which, (min(64, hard) if hard != resource.RLIM_INFINITY else 64, hard))
        import os
        from dew.training import TrainerConfig, prepare_process
        from dew.training.runtime import BackendAlreadyStartedError
        config = TrainerConfig(steps=1, compilation_cache_dir={str(cache)!r},
                               xla_flags=["--xla_force_host_platform_device_count=3"])
        prepare_process(config)
        nofile, core = resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_CORE)
        cap = int(open("/proc/sys/fs/nr_open").read())
        assert nofile[0] == nofile[1] or (nofile[1] == resource.RLIM_INFINITY and nofile[0] == cap), nofile
        assert core[0] == 0, core  # no core files unless asked for (see the test below)
        import jax
        print("flags", os.environ["XLA_FLAGS"])
        print("devices", jax.device_count())
        print("cache", jax.config.jax_compilation_cache_dir)
        prepare_process(config)  # the same flags again: nothing would be lost
        try:
            prepare_process(TrainerConfig(steps=1, xla_flags=["--xla_force_host_platform_device_count=5"]))
        except BackendAlreadyStartedError as error:
            print("refused:", error)
    """)
    assert "flags --xla_force_host_platform_device_count=3\n" in out
    assert "devices 3" in out
    assert f"cache {cache}" in out and cache.is_dir()
    assert "refused: JAX already opened its backend" in out


def test_core_files_are_written_only_when_asked_for(python_in_subprocess):
    # A core file holds the environment's secrets: the default lowers the soft limit to 0
    # even when the shell raised it; core_dumps=True raises it to the hard limit.
    out = python_in_subprocess("""
        import resource
        from dew.training import TrainerConfig, prepare_process
        hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
        prepare_process(TrainerConfig(steps=1))
        print("default", resource.getrlimit(resource.RLIMIT_CORE)[0])
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
        prepare_process(TrainerConfig(steps=1, core_dumps=True))
        print("asked", resource.getrlimit(resource.RLIMIT_CORE)[0] == hard)
    """)
    assert "default 0\n" in out
    assert "asked True" in out


def test_multi_host_without_a_pool_says_what_to_set(python_in_subprocess):
    out = python_in_subprocess("""
        import os
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            os.environ.pop(name, None)
        from dew.training import TrainerConfig, prepare_process
        from dew.training.runtime.process import ProcessPoolError
        try:
            prepare_process(TrainerConfig(steps=1, multi_host=True))
        except ProcessPoolError as error:
            print(error)
    """)
    assert "JAX_COORDINATOR_ADDRESS" in out and "JAX_NUM_PROCESSES" in out


def test_run_timestamp_format():
    stamp = run_timestamp()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d", stamp)
    assert abs(time.mktime(time.strptime(stamp, "%Y-%m-%d_%H:%M:%S")) - time.time()) < 5


@pytest.mark.slow
def test_run_timestamp_is_process_zeros_in_a_pool(tmp_path):
    """Two real processes join a pool through prepare_process; process 1's clock is wrong."""
    port = free_port()
    code = textwrap.dedent("""
        import os, time
        from dew.training import TrainerConfig, prepare_process, run_timestamp
        prepare_process(TrainerConfig(steps=1, multi_host=True))
        if os.environ["JAX_PROCESS_ID"] == "1":
            time.strftime = lambda fmt, *a: "1999-01-01_00:00:00"
        import jax
        print("pool", jax.process_count(), "stamp", run_timestamp())
    """)
    children = []
    for index in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index))
        children.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [child.communicate(timeout=240) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-3000:]
    stamps = [re.search(r"pool 2 stamp (\S+)", out).group(1) for out, _ in outputs]
    assert stamps[0] == stamps[1] != "1999-01-01_00:00:00"


def test_a_run_json_from_before_layout_was_one_type_still_reads():
    # Runs trained before the recipe validated Layout itself wrote ``layout: {rules: null}``.
    from dew.training.placement.layout import DEFAULT_RULES

    config = TrainerConfig(steps=1, layout={"rules": None, "min_shard": 4, "tolerance": 0.02})
    assert config.layout.rules == DEFAULT_RULES and config.layout.min_shard == 4
