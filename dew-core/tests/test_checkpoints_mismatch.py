"""A changed configuration is a mismatch, named, with nothing on disk changed; damage alone is quarantined."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointTreeMismatchError
from dew.training.trainer import ResumeMismatchError
from test_checkpoints import (  # every test folder is on sys.path (conftest.py)
    SINGLE,
    full_state,
    save,
    template_of,
)
from tiny_objective import DATA, Tiny  # noqa: E402  # every test folder is on sys.path (conftest.py)


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _trained(tmp_path: Path) -> Path:
    """A run of 3 steps with adam, every step kept."""
    directory = tmp_path / "run"
    checkpoints = Checkpoints(directory, keep=None)
    Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=checkpoints).fit(
        DATA, steps=3, checkpoint_every=1)
    checkpoints.close()
    assert [name for name in _listing(directory) if name.isdigit()] == ["1", "2", "3"]
    return directory


def test_another_optimizer_is_a_named_mismatch_and_changes_nothing(tmp_path: Path) -> None:
    directory = _trained(tmp_path)
    before = _listing(directory)
    changed = Trainer(Tiny(), optax.adamw(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory))
    with pytest.raises(CheckpointTreeMismatchError) as caught:
        changed.place()
    message = str(caught.value)
    # adamw's state has one more (empty) node than adam's; the leaves are the same.
    assert caught.value.step == 3
    assert ".opt_state[2] (EmptyState) is in the state but not in the checkpoint" in message, message
    assert "Nothing was changed on disk" in message
    assert _listing(directory) == before  # no step renamed to .dew-corrupt, no lease left behind

    same = Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory))
    restored, _, _ = same.place()
    assert int(restored.step) == 3  # the newest step, still there


def test_a_refused_resume_keeps_the_recipe_the_run_was_trained_with(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    first = {"optimizer": "adam", "steps": 2}
    Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
            recipe=first).fit(DATA, steps=2)
    assert json.loads((directory / "run.json").read_text()) == first

    changed = Trainer(Tiny(), optax.adamw(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
                      recipe={"optimizer": "adamw", "steps": 4})
    with pytest.raises(CheckpointTreeMismatchError, match="Nothing was changed on disk"):
        changed.fit(DATA, steps=4)
    assert json.loads((directory / "run.json").read_text()) == first  # what `dew train --resume` reads

    second = {"optimizer": "adam", "steps": 4}  # the same model and optimizer, trained further
    with pytest.warns(UserWarning, match="holds no data position"):  # DATA's stream keeps none
        Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
                recipe=second).fit(DATA, steps=4)
    assert json.loads((directory / "run.json").read_text()) == second
    assert not list(directory.glob(".run.json*"))  # no file left from writing it


class _Unreachable:
    """A tracker whose service is gone from step `gone` on (W&B online without a network, say)."""

    def __init__(self, gone: int = 0) -> None:
        self.gone = gone

    def log(self, scalars, step):
        if step >= self.gone:
            raise OSError("the tracker's service cannot be reached")

    def artifact(self, value, step):
        self.log({}, step)

    def close(self):
        pass


def test_a_resume_that_fails_before_it_keeps_a_step_keeps_the_recipe_the_run_was_trained_with(
        tmp_path: Path) -> None:
    """Its overrides were written at the start, so a resume with a tracker it could not reach left
    them as the run's recipe, and the next plain resume failed again on them."""
    directory = tmp_path / "run"
    first = {"tracker": "offline", "steps": 2}
    Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
            recipe=first).fit(DATA, steps=2)
    failing = {"tracker": "online", "steps": 4}
    with pytest.warns(UserWarning, match="holds no data position"), pytest.raises(OSError, match="cannot be reached"):
        Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
                tracker=_Unreachable(), recipe=failing).fit(DATA, steps=4, log_every=1)
    assert json.loads((directory / "run.json").read_text()) == first
    # one that kept a step before it failed trained with its recipe: that is the run's now
    with pytest.warns(UserWarning, match="holds no data position"), pytest.raises(OSError, match="cannot be reached"):
        Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
                tracker=_Unreachable(gone=4), recipe=failing).fit(DATA, steps=4, log_every=1, checkpoint_every=1)
    assert json.loads((directory / "run.json").read_text()) == failing
    assert Checkpoints(directory).latest == 3


def test_changed_accumulation_is_named_before_the_tree_is_compared(tmp_path: Path) -> None:
    directory = _trained(tmp_path)
    before = _listing(directory)
    changed = Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory),
                      accumulation=2)
    with pytest.raises(ResumeMismatchError, match=r"accumulation: checkpoint 1, this trainer 2"):
        changed.place()
    assert _listing(directory) == before


def test_meta_reads_the_manifest_alone(tmp_path: Path) -> None:
    directory = _trained(tmp_path)
    checkpoints = Checkpoints(directory)
    assert checkpoints.meta()["accumulation"] == 1
    assert checkpoints.meta(2)["accumulation"] == 1


def test_each_step_records_the_dew_that_wrote_it_and_a_misfit_from_another_dew_says_so(tmp_path: Path) -> None:
    """A change in dew's own state between two versions is not the recipe's doing: the refusal names
    the writer's versions beside this one's."""
    from importlib import metadata

    from test_checkpoints import reseal

    directory = _trained(tmp_path)
    assert Checkpoints(directory).meta(3)["dew"]["dew-core"] == metadata.version("dew-core")
    changed = Trainer(Tiny(), optax.adamw(0.1), key=jax.random.key(0), checkpoints=Checkpoints(directory))
    with pytest.raises(CheckpointTreeMismatchError) as caught:
        changed.place()
    assert "was written by" not in str(caught.value)  # this dew wrote it: the recipe changed
    manifest = json.loads((directory / "3" / "dew.json").read_text())
    manifest["meta"]["dew"] = {"dew-core": "0.0.1"}
    (directory / "3" / "dew.json").write_bytes(reseal(manifest))
    with pytest.raises(CheckpointTreeMismatchError) as caught:
        changed.place()
    assert f"written by dew-core 0.0.1, and this is dew-core {metadata.version('dew-core')}" in str(caught.value)


def test_an_intact_step_orbax_cannot_read_is_a_mismatch_not_damage(tmp_path: Path) -> None:
    """A tree the node and leaf tables accept but Orbax refuses (here: a format-1 manifest, no node table)."""
    checkpoints = Checkpoints(tmp_path, keep=None)
    save(checkpoints, 1, full_state(1))
    checkpoints.close()
    manifest = json.loads((tmp_path / "1" / "dew.json").read_text())
    del manifest["nodes"], manifest["digest"]
    manifest["format"] = 1
    (tmp_path / "1" / "dew.json").write_text(json.dumps(manifest))
    # The same leaves under another tree shape: opt_state gains an empty node.
    state = full_state(1)
    other = state.replace(opt_state=(*state.opt_state, optax.EmptyState()))
    before = _listing(tmp_path)
    with pytest.raises(CheckpointTreeMismatchError, match="its files are intact, but Orbax cannot read them"):
        Checkpoints(tmp_path).restore(template_of(other), partition=SINGLE)
    assert _listing(tmp_path) == before


def test_damage_is_still_quarantined(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=None)
    for step in (1, 2):
        save(checkpoints, step, full_state(step))
    checkpoints.close()
    (tmp_path / "2" / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(CheckpointCorruptedError):
        Checkpoints(tmp_path, fallback=False).restore(template_of(full_state()), partition=SINGLE)
    assert (tmp_path / "2").is_dir()  # fallback=False only reports
    restored = Checkpoints(tmp_path).restore(template_of(full_state()), partition=SINGLE)
    assert restored.step == 1 and (tmp_path / "2.dew-corrupt").is_dir()
