"""Lifecycle hooks: specs, checked registration, entry-point autoloading and its switches."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dew import plugins
from dew.plugins import HookImplementationError, hookimpl, registered


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def dew_step_end(self, step, metrics):
        self.calls.append(("step_end", step, dict(metrics)))

    @hookimpl
    def dew_run_end(self, step):  # a subset of the spec's arguments is fine
        self.calls.append(("run_end", step))


def test_registered_plugin_receives_the_hooks_for_the_block_only():
    recorder = Recorder()
    with registered(recorder) as plugin:
        assert plugin is recorder
        plugins.hook().dew_step_end(step=5, metrics={"loss": 1.5})
        plugins.hook().dew_run_end(step=7, state=None)
        plugins.hook().dew_checkpoint(step=7, path="/tmp/x")  # not implemented: ignored
    plugins.hook().dew_step_end(step=6, metrics={"loss": 1.0})
    assert recorder.calls == [("step_end", 5, {"loss": 1.5}), ("run_end", 7)]


class Broken:
    @hookimpl
    def dew_step_end(self, step):
        if step >= 2:
            raise ValueError("hook failing on purpose")


def test_a_plugins_own_error_in_a_fit_is_named_with_the_plugin_and_the_switch(capsys, tmp_path, python_in_subprocess):
    """A hook that raised mid-run printed pluggy's traceback (exit 1, "a bug in dew"); a plugin's
    error is now named, and dew's own errors and non-plugin code pass through unchanged. A plugin
    the program registered itself (a notebook's) was named by a number, with advice to uninstall
    a distribution that does not exist."""
    import jax
    import optax

    from dew import Trainer
    from dew.testing.doubles import Regression, regression_dataset

    with registered(Broken()), pytest.raises(plugins.PluginHookError) as refused:
        Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0)).fit(regression_dataset(), steps=3, log_every=1)
    assert str(refused.value).startswith("The plugin 'Broken' raised ValueError: hook failing on purpose in its "
                                         "dew_step_end hook. Fix it (this program registered it, "
                                         "dew.plugins.registered); a run with checkpoints resumes")
    assert isinstance(refused.value.__cause__, ValueError)
    with pytest.raises(ZeroDivisionError), plugins.blamed("dew_step_end"):  # not a plugin's frame
        _ = 1 / 0
    _plugin_site(tmp_path, """
        @hookimpl
        def dew_step_end(step, metrics):
            raise ValueError("hook failing on purpose")
    """, name="failing")
    out = python_in_subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from dew import plugins
        try:
            with plugins.blamed("dew_step_end"):
                plugins.hook().dew_step_end(step=3, metrics={{}})
        except plugins.PluginHookError as error:
            print("refused:", error)
    """)
    assert ("refused: The plugin 'failing' raised ValueError: hook failing on purpose in its dew_step_end hook. Fix "
            "or uninstall the distribution that ships it, or skip it with DEW_BLOCK_PLUGINS=failing") in out, out


def test_every_lifecycle_hook_has_a_documented_spec():
    relay = plugins.hook()
    expected = {
        "dew_run_start": ("trainer", "start", "steps"),
        "dew_step_end": ("step", "metrics"),
        "dew_evaluation": ("step", "evaluation"),
        "dew_checkpoint": ("step", "path"),
        "dew_preempted": ("step",),
        "dew_run_end": ("step", "state"),
    }
    for name, arguments in expected.items():
        caller = getattr(relay, name)
        assert caller.spec is not None and tuple(caller.spec.argnames) == arguments
        assert getattr(plugins.Hooks, name).__doc__.strip()
    assert plugins.hook() is relay  # built once


def test_an_argument_the_spec_lacks_is_refused_naming_plugin_hook_and_argument():
    class Greedy:
        @hookimpl
        def dew_step_end(self, step, metrics, learning_rate):
            pass

    with pytest.raises(HookImplementationError) as caught:
        with registered(Greedy(), name="greedy"):
            pass
    message = str(caught.value)
    assert "'greedy'" in message and "'dew_step_end'" in message and "'learning_rate'" in message
    assert "step, metrics" in message
    assert not plugins.manager().has_plugin("greedy")


def test_an_unknown_hook_is_refused_with_a_suggestion():
    class Typo:
        @hookimpl
        def dew_step_ends(self, step):
            pass

    with pytest.raises(HookImplementationError, match="Did you mean 'dew_step_end'"):
        with registered(Typo(), name="typo"):
            pass


def _plugin_site(root: Path, body: str, name: str = "recorder") -> None:
    """A distribution registering module dewtest_hooks_<name> in the dew.plugins group."""
    module = f"dewtest_hooks_{name}"
    info = root / f"dewtest_{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dewtest-{name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[dew.plugins]\n{name} = {module}\n")
    (root / f"{module}.py").write_text(
        "from dew.plugins import hookimpl\nCALLS = []\n" + textwrap.dedent(body)
    )


_RECORD = """
    @hookimpl
    def dew_step_end(step, metrics):
        CALLS.append([step, metrics["train/loss"]])
"""

_PROBE = """
    import json, sys
    sys.path.insert(0, {root!r})
    import dew.plugins
    imported_at_import = "dewtest_hooks_recorder" in sys.modules or "dew.registry" in sys.modules
    relay = dew.plugins.hook()
    relay.dew_step_end(step=3, metrics={{"train/loss": 0.25}})
    module = sys.modules.get("dewtest_hooks_recorder")
    print(json.dumps({{
        "imported_at_import": imported_at_import,
        "loaded": module is not None,
        "calls": module.CALLS if module else None,
        "names": [n for n, p in dew.plugins.manager().list_name_plugin() if p is not None],
    }}))
"""


def _probe(python_in_subprocess, root: Path, **env: str) -> dict:
    out = python_in_subprocess(_PROBE.format(root=str(root)), env=env)
    return json.loads(out.splitlines()[-1])


def test_installed_plugins_autoload_on_first_hook_call(tmp_path, python_in_subprocess):
    _plugin_site(tmp_path, _RECORD)
    result = _probe(python_in_subprocess, tmp_path)
    assert result["imported_at_import"] is False
    assert result["loaded"] is True and result["calls"] == [[3, 0.25]]
    assert "recorder" in result["names"]


def test_autoload_can_be_switched_off(tmp_path, python_in_subprocess):
    _plugin_site(tmp_path, _RECORD)
    result = _probe(python_in_subprocess, tmp_path, DEW_DISABLE_PLUGIN_AUTOLOAD="1")
    assert result["loaded"] is False and "recorder" not in result["names"]


def test_a_plugin_can_be_blocked_by_name(tmp_path, python_in_subprocess):
    _plugin_site(tmp_path, _RECORD)
    _plugin_site(tmp_path, _RECORD, name="other")
    result = _probe(python_in_subprocess, tmp_path, DEW_BLOCK_PLUGINS="unrelated, recorder")
    assert result["loaded"] is False and "recorder" not in result["names"]
    assert "other" in result["names"]
    refused = python_in_subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import dewtest_hooks_recorder
        from dew.plugins import HookImplementationError, registered
        try:
            with registered(dewtest_hooks_recorder, name="recorder"):
                pass
        except HookImplementationError as error:
            print("refused:", error)
    """, env={"DEW_BLOCK_PLUGINS": "recorder"})
    assert "refused: Plugin 'recorder' is blocked" in refused


def test_an_installed_plugin_with_a_bad_argument_fails_on_load(tmp_path, python_in_subprocess):
    _plugin_site(tmp_path, """
        @hookimpl
        def dew_checkpoint(step, path, bytes_written):
            pass
    """, name="bad")
    out = python_in_subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import dew.plugins
        try:
            dew.plugins.hook()
        except dew.plugins.HookImplementationError as error:
            print("refused:", error)
    """)
    assert "refused: Plugin 'bad' implements hook 'dew_checkpoint'" in out
    assert "'bytes_written'" in out


def test_hook_is_a_cached_relay(monkeypatch):
    relay = plugins.hook()
    monkeypatch.setattr(plugins, "manager", lambda: pytest.fail("hook() rebuilt the manager"))
    assert all(plugins.hook() is relay for _ in range(1000))


def test_a_plugin_that_raises_at_import_is_named_with_its_distribution_and_the_switch(
    tmp_path, python_in_subprocess
):
    _plugin_site(tmp_path, _RECORD)
    _plugin_site(tmp_path, "raise ZeroDivisionError('plugin bug at import')\n", name="broken")
    probe = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import dew.plugins
        for attempt in range(2):  # every later use fails the same way, never half-loaded
            try:
                dew.plugins.hook()
            except dew.plugins.PluginLoadError as error:
                print("refused:", error, "| cause:", type(error.__cause__).__name__)
            else:
                print("loaded:", [n for n, p in dew.plugins.manager().list_name_plugin() if p])
    """
    out = python_in_subprocess(probe)
    lines = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2, out
    message = lines[0]
    assert "'broken'" in message and "broken = dewtest_hooks_broken" in message
    assert "dewtest-broken" in message  # the distribution that ships it
    assert "DEW_BLOCK_PLUGINS=broken" in message and "DEW_DISABLE_PLUGIN_AUTOLOAD=1" in message
    assert "ZeroDivisionError: plugin bug at import" in message
    assert message.endswith("| cause: ZeroDivisionError")
    # The switch the message names does what it says: the other plugin still loads.
    out = python_in_subprocess(probe, env={"DEW_BLOCK_PLUGINS": "broken"})
    assert "loaded: " in out and "'recorder'" in out and "refused" not in out
