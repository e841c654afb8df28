"""What `dew describe`, `dew check-plugin` and a run say of a third party's plugin that is wrong.

Each test writes throwaway distributions (a ``*.dist-info`` with real entry points, beside the
package it names) into a folder of its own, which the command's interpreter sees on its path:
a hook module or a constant registered where a class belongs, a name another distribution
registers too, an entry point whose module or object is missing, a kit named after no
component, a hook taking an argument its hook does not pass. Each is named in one line, with
what to do, and never as a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dew.cli import TRACEBACK
from dew.plugins import AUTOLOAD_VARIABLE, BLOCK_VARIABLE

HOOKS = """
    \"\"\"Hooks that log each step.

    More about them.\"\"\"
    from dew.plugins import hookimpl


    @hookimpl
    def dew_step_end(step, metrics):
        pass


    @hookimpl
    def dew_run_end(step):
        pass


    class Counter:
        @hookimpl
        def dew_run_start(self, trainer, steps):
            pass
"""

BAD_HOOKS = """
    from dew.plugins import hookimpl


    @hookimpl
    def dew_step_end(step, metricz):
        pass
"""

PARTS = """
    THRESHOLD = 42


    class Thing:
        def __init__(self, scale: float = 1.0):
            self.scale = scale
"""


def distribution(site: Path, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """An installed-looking distribution in site: its metadata, its entry points and its modules."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points).lstrip())
    for module, text in modules.items():
        path = site / Path(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(site).parents:
            if folder != Path("."):
                (site / folder / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))


def dew(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`dew ARGS` in a fresh interpreter that sees the distributions in site."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    for variable in (TRACEBACK, AUTOLOAD_VARIABLE, BLOCK_VARIABLE):
        env.pop(variable, None)
    return subprocess.run([sys.executable, "-m", "dew.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def refused(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed to stderr."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


def test_describe_shows_a_hook_plugin_and_the_hooks_it_implements(tmp_path):
    site = tmp_path / "site"
    distribution(site, "probe-hooks", """
        [dew.plugins]
        probe_log = probe_hooks.log
        probe_counter = probe_hooks.log:Counter
        probe_wrong = probe_hooks.wrong
        probe_none = probe_hooks.parts
    """, {"probe_hooks.log": HOOKS, "probe_hooks.wrong": BAD_HOOKS, "probe_hooks.parts": PARTS})

    done = dew(site, "describe", "probe_log", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "probe_log (plugins, from probe-hooks): probe_hooks.log",
        "",
        "Hooks that log each step.",
        "",
        "hooks it implements (a hook plugin has no fields; every run loads it):",
        "  dew_run_end(step)",
        "  dew_step_end(step, metrics)",
    ]
    done = dew(site, "describe", "plugins/probe_counter", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        "hooks it implements (a hook plugin has no fields; every run loads it):",
        "  dew_run_start(trainer, steps)",
    ]
    # A hook a run would refuse is flagged where it is listed.
    done = dew(site, "describe", "probe_wrong", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "  dew_step_end(step, metricz)  <- dew_step_end passes step, metrics, not metricz; a run refuses this plugin")
    done = dew(site, "describe", "probe_none", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "hooks: none (no function in it is marked with dew.plugins.hookimpl)"


def test_describe_refuses_an_entry_point_that_names_no_class_or_function_in_one_line(tmp_path):
    site = tmp_path / "site"
    distribution(site, "probe-parts", """
        [dew.rewards]
        probe_threshold = probe_parts.parts:THRESHOLD
        probe_hooks_here = probe_parts.log
        [dew.objectives]
        probe_thing = probe_parts.parts:Thing
    """, {"probe_parts.parts": PARTS, "probe_parts.log": HOOKS})

    assert refused(dew(site, "describe", "probe_threshold", cwd=tmp_path)) == (
        "dew describe: 'probe_threshold' from probe-parts is the entry point probe_threshold = "
        "'probe_parts.parts:THRESHOLD' in dew.rewards, which names the int 42, not a class or function: a reward "
        "entry point names the class (or function) that builds one, as 'package.module:ClassName'; fix it in "
        "probe-parts's pyproject.toml and reinstall it.")
    assert refused(dew(site, "describe", "rewards/probe_hooks_here", cwd=tmp_path)) == (
        "dew describe: 'probe_hooks_here' from probe-parts is the entry point probe_hooks_here = 'probe_parts.log' "
        "in dew.rewards, which names the module probe_parts.log, not a class or function (a module of hook "
        "implementations belongs in dew.plugins): a reward entry point names the class (or function) that builds "
        "one, as 'package.module:ClassName'; fix it in probe-parts's pyproject.toml and reinstall it.")
    done = dew(site, "describe", "probe_thing", cwd=tmp_path)  # a class is described as before
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "probe_thing (objectives, from probe-parts): probe_parts.parts:Thing"
    assert "scale" in done.stdout


def _check(site: Path, name: str, cwd: Path) -> tuple[int, dict[tuple[str, str], tuple[str, str]]]:
    done = dew(site, "check-plugin", name, "--json", cwd=cwd)
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)
    return done.returncode, {(c["subject"], c["check"]): (c["result"], c["message"]) for c in report["checks"]}


def test_check_plugin_fails_a_name_another_distribution_registers_naming_both(tmp_path):
    site = tmp_path / "site"
    distribution(site, "probe-first", """
        [dew.objectives]
        shared_thing = probe_first.parts:Thing
        own_thing = probe_first.parts:Thing
    """, {"probe_first.parts": PARTS})
    distribution(site, "probe-second", """
        [dew.objectives]
        shared_thing = probe_second.parts:Thing
    """, {"probe_second.parts": PARTS})

    code, checks = _check(site, "probe-first", tmp_path)
    assert code == 1
    assert checks[("objective `shared_thing`", "no other distribution registers its name")] == (
        "failed",
        "probe-second registers 'shared_thing' in dew.objectives too (probe_second.parts:Thing), so while both are "
        "installed every recipe naming 'shared_thing' fails with NameConflictError: rename the entry point "
        "shared_thing = probe_first.parts:Thing in probe-first's pyproject.toml (a name of its own, such as one "
        "starting with the package's name) and reinstall it.")
    assert ("objective `own_thing`", "no other distribution registers its name") not in checks
    # The Markdown report counts it among the failures.
    text = dew(site, "check-plugin", "probe-first", cwd=tmp_path).stdout
    assert "probe-first 0.1 **does not pass**" in text
    assert "| objective `shared_thing` | no other distribution registers its name | failed |" in text


def test_check_plugin_loads_a_component_without_a_kit_and_flags_a_kit_named_after_none(tmp_path):
    site = tmp_path / "site"
    distribution(site, "probe-loads", """
        [dew.objectives]
        bad_import = probe_loads.broken:Thing
        bad_attr = probe_loads.parts:NoSuchClass
        [dew.trackers]
        good_thing = probe_loads.parts:Thing
        [dew.rewards]
        a_constant = probe_loads.parts:THRESHOLD
        [dew.conformance]
        good_thnig = probe_loads.parts:Thing
        [dew.plugins]
        needs_path = probe_loads.hooks:NeedsPath
    """, {"probe_loads.parts": PARTS,
          "probe_loads.broken": "import probe_missing_dependency_xyz\n\nclass Thing: pass\n",
          # A hooks class is made with no arguments by every run: one that needs some passed the check.
          "probe_loads.hooks": "from dew.plugins import hookimpl\n\nclass NeedsPath:\n"
                               "    def __init__(self, path):\n        self.path = path\n\n"
                               "    @hookimpl\n    def dew_step_end(self, step, metrics):\n        pass\n"})

    code, checks = _check(site, "probe-loads", tmp_path)
    assert code == 1
    assert {key: result for key, (result, _) in checks.items()} == {
        ("kit `good_thnig`", "names a component of the distribution"): "failed",
        ("objective `bad_import`", "it loads"): "failed",
        ("objective `bad_attr`", "it loads"): "failed",
        ("tracker `good_thing`", "it loads"): "passed",
        ("tracker `good_thing`", "has a conformance kit"): "unchecked",
        ("reward `a_constant`", "it names a class or function"): "failed",
        ("hooks `needs_path`", "it loads"): "failed",
    }
    assert checks[("hooks `needs_path`", "it loads")][1].startswith(
        "its entry point needs_path = probe_loads.hooks:NeedsPath failed to load: TypeError: ")
    assert checks[("reward `a_constant`", "it names a class or function")][1] == (  # it was a bare TypeError
        "its entry point a_constant = probe_loads.parts:THRESHOLD names a value of type int, not the class (or function) that "
        "builds the component; point it at that class as 'package.module:ClassName' and reinstall the distribution.")
    assert checks[("objective `bad_import`", "it loads")][1] == (
        "its entry point bad_import = probe_loads.broken:Thing failed to load: ModuleNotFoundError: No module named "
        "'probe_missing_dependency_xyz'. Fix the entry point (or install what its module imports, declared in the "
        "distribution's dependencies) and reinstall the distribution.")
    assert checks[("objective `bad_attr`", "it loads")][1].startswith(
        "its entry point bad_attr = probe_loads.parts:NoSuchClass failed to load: AttributeError: ")
    assert checks[("kit `good_thnig`", "names a component of the distribution")][1] == (
        "the dew.conformance entry point good_thnig = probe_loads.parts:Thing of probe-loads names no component of "
        "it, so it checks nothing (did you mean 'good_thing'?): register the kit under the name of the component "
        "it checks (its components: a_constant, bad_attr, bad_import, good_thing, needs_path).")


def test_a_hook_with_an_argument_its_hook_lacks_names_the_distribution_and_the_switch(tmp_path):
    site = tmp_path / "site"
    distribution(site, "probe-bad-hooks", """
        [dew.plugins]
        bad_hook_args = probe_bad_hooks.hooks
    """, {"probe_bad_hooks.hooks": BAD_HOOKS})

    done = dew(site, "train", "tiny-lm", "trainer.steps=1", f"trainer.checkpoint_dir={tmp_path / 'run'}",
               cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        "dew train: HookImplementationError: Plugin 'bad_hook_args' implements hook 'dew_step_end' with argument(s) "
        "'metricz' that the hook does not pass. dew_step_end passes: step, metrics; an implementation may take any "
        "subset of them. The plugin is the entry point bad_hook_args = probe_bad_hooks.hooks in group 'dew.plugins' "
        "of the distribution probe-bad-hooks; every run loads installed plugins, so fix or uninstall "
        "probe-bad-hooks, or skip this plugin with DEW_BLOCK_PLUGINS=bad_hook_args "
        "(DEW_DISABLE_PLUGIN_AUTOLOAD=1 skips them all).\n") in done.stderr
    # dew train --check passed while every run was refused: it loads the installed plugins too
    checked = dew(site, "train", "tiny-lm", "--check", cwd=tmp_path)
    assert checked.returncode == 2 and "HookImplementationError: Plugin 'bad_hook_args'" in checked.stderr, \
        checked.stderr


EVALUATION = """
    import jax.numpy as jnp

    from dew.testing import EvaluationTaskKit

    print("probe_eval: hello from import")  # a plugin that talks as it is imported


    class MeanLogit:
        \"\"\"The mean logit over a few fixed id sequences.\"\"\"

        def __init__(self, rows: int = 3):
            self.rows = rows

        def evaluate(self, subject, *, mesh=None):
            ids = jnp.arange(self.rows * 4, dtype=jnp.int32).reshape(self.rows, 4) % 8
            logits = subject.model.apply(subject.variables, ids)
            return {"mean_logit": float(jnp.mean(logits)), "records": float(self.rows)}


    class TestMeanLogit(EvaluationTaskKit):
        def task(self):
            return MeanLogit()

        def subject(self):
            import jax

            from dew import registry
            from dew.evaluations.base import Subject

            model = registry.models.build("causal_transformer", vocab_size=16, emb_features=8, num_layers=1,
                                          num_heads=2, mlp_features=16, max_seq_len=8)
            return Subject(model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), None)
"""


def test_an_evaluation_task_is_checked_by_its_kit_and_a_plugins_import_print_leaves_stdout_parseable(tmp_path):
    """check-plugin said a distribution of evaluation tasks registered no component (its kit, a
    stray); a plugin that prints as it is imported put its line before dew train --check's JSON."""
    site = tmp_path / "site"
    distribution(site, "probe-eval", """
        [dew.evaluations]
        probe_mean_logit = probe_eval.tasks:MeanLogit
        [dew.conformance]
        probe_mean_logit = probe_eval.tasks:TestMeanLogit
    """, {"probe_eval.tasks": EVALUATION})
    code, checks = _check(site, "probe-eval", tmp_path)
    assert code == 0, checks
    assert checks[("evaluation task `probe_mean_logit`", "kit builds the registered component")][0] == "passed"
    assert checks[("evaluation task `probe_mean_logit`", "follows the protocol")][0] == "passed"
    checked = dew(site, "train", "tiny-sft", "--check", "trainer.evaluate=[{task: probe_mean_logit, every: 5}]",
                  cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-2000:]
    json.loads(checked.stdout)  # nothing but the check's JSON
    assert "probe_eval: hello from import" in checked.stderr


def test_a_broken_plugin_does_not_stop_the_export_of_a_model_it_has_nothing_to_do_with(tmp_path):
    """A saved directory names its model by the name its class is registered under; that name was found
    by importing every registered model in turn, so one plugin whose module fails to import (sorting
    before dit) made every later model's export fail, naming that plugin as what to reinstall."""
    import flax.linen as nn
    import jax

    from dew.nn.dit import DiT
    from dew.objectives.diffusion import DiffusionObjective

    site = tmp_path / "site"
    distribution(site, "probe-broken", """
        [dew.models]
        aaa_broken = probe_broken.parts:Model

        [dew.objectives]
        aaa_broken = probe_broken.parts:Objective
    """, {"probe_broken.parts": "import a_module_nobody_installed\n"})
    dit = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
              mlp_features=32, num_classes=10)
    objective = DiffusionObjective(dit, sample_steps=2)
    objective.pipeline(nn.meta.unbox(objective.init(jax.random.key(0)))).save(tmp_path / "dit")
    done = dew(site, "export", str(tmp_path / "dit"), str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0 and "probe-broken" not in done.stderr, done.stderr
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (tmp_path / "out" / "model.safetensors").is_file(), saved


def test_a_name_registered_in_two_groups_takes_a_kit_for_each_by_its_group(tmp_path):
    """A model and an objective both named twin could share one dew.conformance name only: the one kit was
    taken for both, and one of them always failed as "not a subclass" with no way to give it its own."""
    site = tmp_path / "site"
    distribution(site, "probe-twin", """
        [dew.models]
        twin = probe_twin.parts:Thing

        [dew.objectives]
        twin = probe_twin.parts:Thing

        [dew.conformance]
        models/twin = probe_twin.kits:ModelCheck
        objectives/twin = probe_twin.kits:ObjectiveCheck
    """, {"probe_twin.parts": PARTS})
    script = ("import json; from dew.testing.certify import stray_kits, subjects\n"
              "_, listed = subjects('probe-twin')\n"
              "print(json.dumps({'kits': sorted((s.group, s.kit) for s in listed), "
              "'stray': [c.message for c in stray_kits('probe-twin', listed)]}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found == {"kits": [["dew.models", "probe_twin.kits:ModelCheck"],
                              ["dew.objectives", "probe_twin.kits:ObjectiveCheck"]], "stray": []}
