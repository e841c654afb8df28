"""`dew check-plugin`: an installed distribution's components certified by dew.testing's kits.

The project's example plugin (tests/third_party) and a planted one, written here, are installed
with pip into a folder of their own (real distribution metadata, real entry points) that the
command's interpreter sees on its path. The example passes every check; the planted plugin's
objective reads the device count, as code written for pmap did, and fails exactly the check
that trains it on eight devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dew.cli import main

EXAMPLE = Path(__file__).with_name("third_party")

PLANTED = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "dew-planted-plugin"
        version = "0.0.1"
        dependencies = ["dew-core"]

        [project.entry-points."dew.objectives"]
        planted_regression = "dew_planted_plugin.objective:PlantedObjective"
        planted_raises = "dew_planted_plugin.raises:Objective"

        [project.entry-points."dew.trackers"]
        planted_tracker = "dew_planted_plugin.broken:BrokenTracker"
        planted_not_a_tracker = "dew_planted_plugin.broken:BrokenReader"
        planted_missing = "dew_planted_plugin.broken:NoSuchTracker"

        [project.entry-points."dew.datasets"]
        planted_reader = "dew_planted_plugin.broken:BrokenReader"

        [project.entry-points."dew.conformance"]
        planted_regression = "dew_planted_plugin.conformance:PlantedKit"
        planted_tracker = "dew_planted_plugin.conformance:OtherTrackerKit"
        planted_reader = "dew_planted_plugin.conformance:OtherReaderKit"

        [tool.setuptools.packages.find]
        where = ["src"]
    """,
    "src/dew_planted_plugin/__init__.py": "",
    "src/dew_planted_plugin/objective.py": """
        import jax
        import jax.numpy as jnp

        from dew.objectives.base import Aux, Mean, Objective


        class PlantedObjective(Objective):
            def __init__(self, inputs: int = 4) -> None:
                self.inputs = inputs

            def init(self, key, variables=None):
                if variables is not None:
                    return variables
                return {"params": {"w": jax.random.normal(key, (self.inputs, 1)), "b": jnp.zeros((1,))}}

            def loss(self, variables, batch, step):
                p = variables["params"]
                errors = (batch["x"] @ p["w"] + p["b"][None, :] - batch["y"]) ** 2
                rows = batch["x"].shape[0]
                global_batch = rows * jax.device_count()  # under pmap, a batch was one device's share
                return Mean(jnp.sum(errors) * rows / global_batch, jnp.asarray(errors.size, jnp.float32)), Aux()

            def required_keys(self):
                return ("x", "y")
    """,
    "src/dew_planted_plugin/raises.py": """
        raise RuntimeError("the planted plugin's settings are broken")
    """,
    "src/dew_planted_plugin/broken.py": """
        class BrokenTracker:
            def log(self, scalars, step):
                raise RuntimeError("broken")

            def artifact(self, value, step):
                raise RuntimeError("broken")

            def close(self):
                raise RuntimeError("broken")


        class BrokenReader:
            def load(self, batch, seed=0):
                raise RuntimeError("broken")
    """,
    "src/dew_planted_plugin/conformance.py": """
        import numpy as np

        from dew.data import TokenWindows
        from dew.telemetry.render import read_scalars
        from dew.testing import DatasetReaderKit, ObjectiveKit, TrackerKit
        from dew.tracking.local import LocalTracker
        from dew_planted_plugin.objective import PlantedObjective


        class OtherTrackerKit(TrackerKit):  # certifies dew's LocalTracker, not the registered tracker
            def tracker(self, directory):
                return LocalTracker(directory)

            def read_back(self, directory):
                return {name: list(zip(s.tolist(), v.tolist()))
                        for name, (s, v) in read_scalars(directory / "scalars.jsonl").items()}


        class OtherReaderKit(DatasetReaderKit):  # reads dew's TokenWindows, not the registered reader
            def dataset(self):
                import tempfile, pathlib
                text = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
                text.write_text("abcdefghij" * 200)
                return TokenWindows(files=str(text), length=8).load(batch=4, seed=0)


        class PlantedKit(ObjectiveKit):
            def objective(self):
                return PlantedObjective()

            def batch(self):
                x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
                return {"x": x, "y": x.sum(axis=1, keepdims=True)}
    """,
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """Both plugins, installed by pip into one folder (no dependencies: dew is the environment's)."""
    root = tmp_path_factory.mktemp("plugins")
    planted = root / "planted"
    for name, text in PLANTED.items():
        (planted / name).parent.mkdir(parents=True, exist_ok=True)
        (planted / name).write_text(textwrap.dedent(text))
    target = root / "site"
    for source in (EXAMPLE, planted):
        build = root / f"build-{source.name}"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                               "--no-build-isolation", "--target", str(target), str(source)],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, TMPDIR=str(root)),
                              cwd=build.parent)
        assert done.returncode == 0, done.stderr
    return target


def _check(distribution: str, site: Path) -> tuple[int, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "dew.cli", "check-plugin", distribution, "--json"],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


@pytest.mark.slow
def test_the_example_plugin_passes_every_kit(installed):
    code, report = _check("dew-example-plugin", installed)
    results = {(c["subject"], c["check"]): c["result"] for c in report["checks"]}
    assert code == 0, [c for c in report["checks"] if c["result"] not in ("passed", "skipped")]
    subjects = {subject for subject, _ in results}
    assert subjects == {"model `example_regressor`", "objective `example_regression`", "tracker `example_jsonl`",
                        "reward `example_shout`", "hooks `example_step_log`"}
    assert results[("objective `example_regression`", "gradients on many devices equal one device")] == "passed"
    assert results[("objective `example_regression`", "resumes bitwise")] == "passed"
    assert results[("tracker `example_jsonl`", "log does not block the step")] == "passed"
    assert results[("model `example_regressor`", "layout check passes on fake devices")] == "passed"
    assert results[("reward `example_shout`", "one finite value per completion")] == "passed"
    assert results[("hooks `example_step_log`", "hooks match the hook specifications")] == "passed"
    # The objective declares no EMA and no frozen leaves: only those checks skip.
    assert {key for key, result in results.items() if result == "skipped"} == {
        ("objective `example_regression`", "ema selects leaves that exist"),
        ("objective `example_regression`", "frozen leaves get no optimizer state and do not move")}
    assert report["passed"] is True and report["dew"].startswith("dew-core ")


@pytest.mark.slow
def test_a_plugin_whose_objective_reads_the_device_count_fails_that_check_by_name(installed, tmp_path):
    code, report = _check("dew-planted-plugin", installed)
    assert code == 1
    failed = {(c["subject"], c["check"]): c["message"] for c in report["checks"] if c["result"] == "failed"}
    assert sorted(failed) == [("objective `planted_raises`", "it loads"),
                              ("objective `planted_regression`", "gradients on many devices equal one device"),
                              ("reader `planted_reader`", "kit builds the registered reader"),
                              ("tracker `planted_missing`", "it loads"),
                              ("tracker `planted_tracker`", "kit builds the registered tracker")]
    # A component without a kit is still loaded: its import failure is named, not hidden as unchecked.
    assert "RuntimeError: the planted plugin's settings are broken" in failed[("objective `planted_raises`", "it loads")]
    assert {(c["subject"], c["check"]) for c in report["checks"] if c["result"] == "unchecked"} == {
        ("tracker `planted_not_a_tracker`", "has a conformance kit")}
    assert "The gradient on 8 devices differs from one device's" in failed[
        ("objective `planted_regression`", "gradients on many devices equal one device")]
    # A kit that builds another tracker or reader would certify that one: refused by name.
    assert "builds a LocalTracker, not the registered BrokenTracker" in failed[
        ("tracker `planted_tracker`", "kit builds the registered tracker")]
    assert "builds no BrokenReader, the registered reader" in failed[
        ("reader `planted_reader`", "kit builds the registered reader")]
    # The Markdown report (what check-plugin prints without --json) says so too, with the versions it
    # was checked with: rendered from these checks rather than running every kit a second time.
    from dew.cli.check_plugin import render_certification
    from dew.testing.certify import Check

    text = render_certification(report["distribution"], report["version"], report["dew"],
                                [Check(**check) for check in report["checks"]])
    assert "dew-planted-plugin 0.0.1 **does not pass** dew's conformance kits" in text
    assert "| objective `planted_regression` | gradients on many devices equal one device | failed |" in text


@pytest.mark.slow
def test_a_component_that_fails_to_load_or_is_no_tracker_is_named_with_its_distribution(installed, tmp_path):
    """A module that raises as it is imported, an entry point naming what its module lacks, and a
    class registered as a tracker without a tracker's methods: one line each, naming the
    distribution and the entry point, before anything trains (a traceback, or one mid-run, before)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")

    def dew(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dew.cli", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)

    done = dew("describe", "planted_raises")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ("'planted_raises' from dew-planted-plugin (entry point 'dew_planted_plugin.raises:Objective') failed "
            "as its module was imported: RuntimeError: the planted plugin's settings are broken") in done.stderr
    done = dew("describe", "planted_missing")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "dew_planted_plugin.broken has no 'NoSuchTracker'" in done.stderr
    done = dew("train", "tiny-lm", "trainer.steps=1", f"trainer.checkpoint_dir={tmp_path}/run",
               "trackers=[{name: planted_not_a_tracker}]")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ("tracker 'planted_not_a_tracker' from dew-planted-plugin (dew_planted_plugin.broken:BrokenReader) has "
            "no log, artifact, close method") in done.stderr
    assert not (tmp_path / "run").exists()  # refused with the recipe, before a folder


def test_a_distribution_that_is_not_installed_is_one_line(capsys):
    assert main(["check-plugin", "dew-no-such-plugin"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No installed distribution is named 'dew-no-such-plugin'" in err


def test_dews_own_rewards_pass_their_registered_kits_and_one_needing_fields_is_unchecked():
    """dew check-plugin dew-objectives called its correct rewards failed: the default kit built them with no
    fields (length's target, format's pattern) and scored them with no context (exact_match's answer)."""
    from dew.testing.certify import checks_of, subjects

    rewards = {s.name: s for s in subjects("dew-objectives")[1] if s.group == "dew.rewards"}
    assert set(rewards) == {"brightness", "exact_match", "format", "length", "model", "regex_format", "weighted"}
    for name, subject in rewards.items():
        found = checks_of(subject)
        if name == "model":  # a trained reward-model run is its one required field: no kit can make it
            assert subject.kit is None
            assert [(c.check, c.result) for c in found] == [("it loads", "passed"),
                                                            ("has a conformance kit", "unchecked")]
            assert "cannot be built without fields" in found[1].message and "run: Field required" in found[1].message
            continue
        assert subject.kit is not None, name
        assert [c.result for c in found] == ["passed"] * 3, [(c.check, c.result, c.message) for c in found]


WRONG_KITS = '''
from dew import models
from dew.testing import ModelKit


def _quiet(kit):
    """Only the identity check runs: every inherited test is a no-op here."""
    for name in [n for n in dir(ModelKit) if n.startswith("test_")]:
        setattr(kit, name, lambda self: None)
    return kit


@_quiet
class DiTKit(ModelKit):
    def model(self):
        return models.build("dit", emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                            image_size=8, patch_size=4, channels=1, num_classes=2)


@_quiet
class GemmaKit(ModelKit):
    def model(self):
        return models.build("gemma", preset=None, vocab_size=64, emb_features=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_features=16, mlp_features=64)


def plain_builder(**fields):
    return models.build("causal_transformer", **fields)
'''


def test_a_kit_is_matched_to_the_class_a_builder_function_declares(tmp_path, monkeypatch):
    """The identity check ran only for entry points that are classes: a DiT's kit certified
    dew-core's gemma (a function, dew.families.gemma:build) as passing."""
    from dew.testing.certify import Component, checks_of

    (tmp_path / "wrong_kits.py").write_text(WRONG_KITS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def identity(kit: str, value: str = "dew.families.gemma:build"):
        found = [c for c in checks_of(Component("dew.models", "gemma", value, kit))
                 if c.check == "kit builds the registered component"]
        assert len(found) == 1, found
        return found[0]

    wrong = identity("wrong_kits:DiTKit")
    assert wrong.result == "failed" and "not the CausalTransformer" in wrong.message, wrong
    assert identity("wrong_kits:GemmaKit").result == "passed"
    undeclared = identity("wrong_kits:GemmaKit", "wrong_kits:plain_builder")
    assert undeclared.result == "unchecked" and "annotate its return type" in undeclared.message, undeclared


def test_a_reward_without_a_kit_the_default_inputs_cannot_feed_is_unchecked_not_failed():
    """The default kit scores text with an empty context: exact_match (which reads 'answer') and
    brightness (which scores images) were called failed, blaming correct rewards."""
    from dew.testing.certify import Component, checks_of

    for name, value, raised in (("exact_match", "dew.rewards:ExactMatch", "RewardContextError"),
                                ("brightness", "dew.rewards:Brightness", "ValueError")):
        found = checks_of(Component("dew.rewards", name, value, None))
        assert [(c.check, c.result) for c in found] == [("it loads", "passed"),
                                                        ("has a conformance kit", "unchecked")], found
        assert raised in found[1].message and "context() give what it reads" in found[1].message
