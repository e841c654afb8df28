"""A third party's distribution, installed beside dew, is found by name and used in a run.

tests/third_party/ is a separate distribution (``dew-example-plugin``) that
registers a model, an objective, a tracker, a reward and a hook implementation through
entry points only. It is built and installed into a fresh venv beside dew-core's
wheel; nothing in dew names it.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest

import fresh_venv as fv  # every test folder is on sys.path (conftest.py)

pytestmark = pytest.mark.slow


PLUGIN = Path(__file__).with_name("third_party")

_RUN = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np, optax
import dew.plugins
from dew import registry
from dew.data.base import Dataset
from dew.training import Trainer

out = {{
    "names": {{g: registry.registry(g).names() for g in ("models", "objectives", "trackers", "plugins", "rewards")}},
    "plugin_module_loaded_early": "dew_example_plugin.hooks" in sys.modules,
}}
model = registry.models.build("example_regressor", features=1)
objective = registry.objectives.build("example_regression", inputs=4, features=1)
tracker = registry.trackers.build("example_jsonl", path={tracker!r})
out["classes"] = [type(x).__module__ + "." + type(x).__name__ for x in (model, objective, tracker)]
out["reward"] = [float(v) for v in registry.rewards.build("example_shout", scale=2.0)(["ABc", "ab", "1"], {{}})]
try:
    registry.rewards.load("exact_match")  # dew's own rewards ship with dew-objectives, not installed here
except registry.UnknownNameError as error:
    out["unknown_reward"] = str(error)
out["hooks"] = [n for n, p in dew.plugins.manager().list_name_plugin() if p is not None]

def rows(index):
    rng = np.random.default_rng(index)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    return {{"x": x, "y": (x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1).astype(np.float32)}}

def stream(partition):
    index = 0
    while True:
        yield rows(index)
        index += 1

trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0), tracker=tracker)
trainer.fit(Dataset(train=stream, val=None, records=None, batch=8), steps=3, log_every=1)

# The same three steps by hand: zero-initialized Dense, plain optax SGD.
params = {{"params": {{"Dense_0": {{"kernel": jnp.zeros((4, 1)), "bias": jnp.zeros((1,))}}}}}}
optimizer = optax.sgd(0.1)
opt_state = optimizer.init(params)
expected = []
for index in range(3):
    batch = rows(index)
    loss_fn = lambda p: jnp.mean((batch["x"] @ p["params"]["Dense_0"]["kernel"]
                                  + p["params"]["Dense_0"]["bias"][None, :] - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    expected.append(float(loss))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
out["expected"] = expected
print(json.dumps(out))
"""


def test_third_party_components_are_found_by_name_and_used_in_a_run(tmp_path, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    wheels = fv.session_wheels(base)
    plugin_wheel = fv.build_wheels(tmp_path / "plugin-wheel", PLUGIN)["dew-example-plugin"]
    python = fv.create(tmp_path / "venv", fv.session_dependencies(base))
    fv.install(python, wheels["dew-core"], plugin_wheel)

    tracker_file, hook_file = tmp_path / "tracker.jsonl", tmp_path / "hooks.jsonl"
    out = fv.probe(python, _RUN.format(tracker=str(tracker_file)),
                   env={"DEW_EXAMPLE_PLUGIN_LOG": str(hook_file)})

    plugin = "dew-example-plugin"
    assert out["names"]["models"]["example_regressor"] == plugin
    assert out["names"]["objectives"]["example_regression"] == plugin
    assert out["names"]["trackers"]["example_jsonl"] == plugin
    assert out["names"]["plugins"] == {"example_step_log": plugin}
    assert out["names"]["rewards"] == {"example_shout": plugin}
    # The reward found by name scores as its own code says: 2 x the share of capitals.
    assert out["reward"] == pytest.approx([2 * 2 / 3, 0.0, 0.0])
    # An unknown reward names what exists and what to install.
    assert "example_shout (dew-example-plugin)" in out["unknown_reward"]
    assert "pip install dew-objectives" in out["unknown_reward"]
    assert out["plugin_module_loaded_early"] is False
    assert out["classes"] == [
        "dew_example_plugin.model.Regressor",
        "dew_example_plugin.objective.RegressionObjective",
        "dew_example_plugin.tracker.JsonLinesTracker",
    ]
    assert out["hooks"] == ["example_step_log"]

    expected = np.asarray(out["expected"])
    tracked = [json.loads(line) for line in tracker_file.read_text().splitlines()]
    tracked_losses = {r["step"]: r["scalars"]["train/loss"] for r in tracked if "train/loss" in r["scalars"]}
    hooked = [json.loads(line) for line in hook_file.read_text().splitlines()]
    hooked_losses = {r["step"]: r["loss"] for r in hooked if r["hook"] == "dew_step_end"}
    assert sorted(tracked_losses) == sorted(hooked_losses) == [1, 2, 3]
    np.testing.assert_allclose([tracked_losses[s] for s in (1, 2, 3)], expected, rtol=1e-5)
    np.testing.assert_allclose([hooked_losses[s] for s in (1, 2, 3)], expected, rtol=1e-5)
    assert expected[2] < expected[0]  # the run learned something
    assert hooked[-1] == {"hook": "dew_run_end", "step": 3}


def test_the_plugins_own_suite_passes_dews_conformance_kits(tmp_path, tmp_path_factory):
    """The plugin's tests/ subclass dew.testing's kits; installed beside dew-core's wheel only,
    they run with pytest from the plugin's own directory and every inherited test passes."""
    base = tmp_path_factory.getbasetemp()
    wheels = fv.session_wheels(base)
    plugin_wheel = fv.build_wheels(tmp_path / "plugin-wheel", PLUGIN)["dew-example-plugin"]
    python = fv.create(tmp_path / "venv", fv.session_dependencies(base))
    fv.install(python, wheels["dew-core"], plugin_wheel)
    checkout = tmp_path / "checkout"  # the plugin's repository, outside dew's
    shutil.copytree(PLUGIN, checkout, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    report = tmp_path / "report.xml"
    fv.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
           cwd=checkout, timeout=600)

    outcomes: dict[str, dict[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes.setdefault(case.get("classname").split(".")[-1], {})[case.get("name")] = kind
    assert set(outcomes) == {"TestRegressor", "TestRegressionObjective", "TestJsonLinesTracker"}
    assert outcomes["TestRegressor"]["test_layout_check_passes_on_fake_devices"] == "passed"
    assert outcomes["TestRegressionObjective"]["test_mean_totals_add_up_over_microbatches"] == "passed"
    assert outcomes["TestJsonLinesTracker"]["test_non_finite_values_are_logged"] == "passed"
    # The objective declares no EMA and no frozen leaves: only those two tests skip.
    skipped = {(c, n) for c, tests in outcomes.items() for n, kind in tests.items() if kind == "skipped"}
    assert skipped == {("TestRegressionObjective", "test_ema_selects_leaves_that_exist"),
                       ("TestRegressionObjective",
                        "test_frozen_leaves_get_no_optimizer_state_and_do_not_move")}
    assert all(kind in ("passed", "skipped") for tests in outcomes.values() for kind in tests.values())
