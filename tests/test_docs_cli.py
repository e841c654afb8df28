"""docs/cli.md: its commands work as written, every shipped recipe is described, and the CLI
features it documents (describe, --version, += overrides, colon-free run folders, the
schedule warning, objectives without a model) behave as it says."""

from __future__ import annotations

import json
import re
import shlex
import warnings
from importlib import metadata
from pathlib import Path

import pytest

from dew import registry
from dew.cli import main
from dew.recipes import RecipeError, RunConfig, shipped
from dew.recipes.run import ScheduleReshapedWarning, expand, warn_if_schedule_reshaped

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _commands() -> list[list[str]]:
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("dew ")]


COMMANDS = _commands()


@pytest.fixture(scope="module")
def page_folder(tmp_path_factory):
    """A folder holding what the page has a reader make before its commands: the tiny family
    checkpoints (`python -m dew.families.examples`) and an exported tiny-lm, the distillation teacher."""
    import jax
    import jax.numpy as jnp

    from dew.families.examples import main as write_checkpoint
    from dew.pretrained import Pretrained
    from dew.recipes.run import build_parts

    folder = tmp_path_factory.mktemp("page")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for family in ("qwen3", "gemma2"):
            assert write_checkpoint([family, f"checkpoints/{family}-tiny"]) == 0
        parts = build_parts(RunConfig.load("tiny-lm"), with_data=False)
        variables = parts.model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        Pretrained(parts.model, variables, parts.tokenizer).save("exported/tiny-lm")
    return folder


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_every_command_on_the_page_runs(argv, capsys, page_folder, monkeypatch):
    monkeypatch.chdir(page_folder)  # as a reader runs them, after the page's own preparations
    if argv[0] == "train" or (argv[0] == "launch" and "--print" not in argv):
        # resolved and checked in full, not trained (a launch prints its ranks' commands)
        argv = [*argv, "--check"] if "--check" not in argv else argv
    try:
        code = main(argv)
    except SystemExit as stop:  # --version exits through argparse
        code = stop.code
    output = capsys.readouterr()
    assert code == 0, output.err
    if argv[0] == "train" and "--check" in argv:
        json.loads(output.out)


def test_every_command_kind_is_on_the_page():
    assert {c[0] for c in COMMANDS} >= {"--version", "recipes", "describe", "train", "launch"}


def test_the_cluster_examples_on_the_page_are_what_launch_prints(capsys):
    """The sbatch script and the JobSet manifest shown under `dew launch` are the command's output."""
    text = PAGE.read_text()
    for kind, language in (("slurm", "bash"), ("jobset", "yaml")):
        command = re.search(rf"^`dew launch (--print {kind} .*?)`$", text, flags=re.M).group(1)
        assert main(["launch", *shlex.split(command)]) == 0
        printed = capsys.readouterr().out
        assert f"```{language}\n{printed}```" in text, f"docs/cli.md shows a stale --print {kind}"


def test_every_shipped_recipe_is_described():
    headings = set(re.findall(r"^### (\S+)$", PAGE.read_text(), flags=re.M))
    assert set(shipped()) <= headings, f"describe {set(shipped()) - headings} in docs/cli.md"


def test_version_names_every_installed_distribution(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name in ("dew-core", "dew-objectives", "dew-trackers", "dew-data"):
        assert f"{name} {metadata.version(name)}" in out


def test_describe_lists_fields_with_types_and_defaults(capsys):
    assert main(["describe", "causal_transformer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("causal_transformer (models, from dew-core): "
                          "dew.nn.backbones:CausalTransformer")
    fields = registry.models.fields("causal_transformer")
    rows = dict(re.findall(r"^  (\w+) .*?  (required|= .+)$", out, flags=re.M))
    assert set(rows) == set(fields)  # every declared field, nothing else
    assert rows["vocab_size"] == "required" and rows["tie_embeddings"] == "= False"
    assert re.search(r"^  position_embedding +'learned' \| 'rotary' += 'learned'$", out, re.M)
    assert main(["describe", "lm"]) == 0
    assert re.search(r"^  model +\S+ +supplied by the recipe", capsys.readouterr().out, re.M)
    assert main(["describe", "token_windows"]) == 0
    assert re.search(r"^  val_fraction +float += 0.0$", capsys.readouterr().out, re.M)


def test_describe_of_an_unknown_or_ambiguous_name_says_what_to_type(capsys):
    assert main(["describe", "causal_transformr"]) == 2
    assert "`dew describe` with no name lists every name" in capsys.readouterr().err
    with registry.datasets.temporary("local", dict):
        assert main(["describe", "local"]) == 2
        assert "dew describe trackers/local" in capsys.readouterr().err
        assert main(["describe", "trackers/local"]) == 0


def test_append_override_extends_lists_and_refuses_other_values():
    config = RunConfig.load("tiny-lm", overrides=[
        "trackers+={name: local, directory: runs/b}", "trainer.xla_flags+=[--a, --b]",
        "trainer.xla_flags+=--c"])
    assert [(t.name, t.fields["directory"]) for t in config.trackers] == [
        ("local", "runs/tiny-lm/{timestamp}"), ("local", "runs/b")]
    assert list(config.trainer.xla_flags) == ["--a", "--b", "--c"]
    with pytest.raises(RecipeError, match=r"appends with \+=, but seed holds 0, not a list"):
        RunConfig.load("tiny-lm", overrides=["seed+=1"])


def test_timestamp_placeholder_names_folders_without_colons():
    from dew.training.runtime.process import run_timestamp

    stamp = run_timestamp()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d", stamp)  # the spec's format, kept
    folder = expand("runs/{timestamp}", stamp)
    assert ":" not in folder and folder == "runs/" + stamp.replace(":", "-")


def _saved(tmp_path, *overrides):
    config = RunConfig.load("tiny-lm", overrides=list(overrides))
    config.save(tmp_path)
    return config


def test_resuming_with_other_steps_warns_that_the_schedule_changes(tmp_path):
    _saved(tmp_path, "trainer.steps=600")
    longer = RunConfig.load("tiny-lm", overrides=["trainer.steps=1000"])
    with pytest.warns(ScheduleReshapedWarning, match=r"decay_steps=600\.$"):
        warn_if_schedule_reshaped(longer, 1000, None, tmp_path, 300)
    # A finished run trained further: the advice to keep the old schedule trains at its end rate
    with pytest.warns(ScheduleReshapedWarning, match=r"decay_steps=600 \(the old schedule had ended at update "
                                                     r"600: kept, every further step trains at its end rate, 0 x"):
        warn_if_schedule_reshaped(longer, 1000, None, tmp_path, 600)
    # With accumulation 4, step 600 is update 150 of 150: ended; step 300 is update 75, where the old decay
    # goes on (the step was compared with decay_steps' updates, and said the schedule had ended)
    _saved(tmp_path, "trainer.steps=600", "trainer.accumulation=4")
    accumulating = RunConfig.load("tiny-lm", overrides=["trainer.steps=1000", "trainer.accumulation=4"])
    with pytest.warns(ScheduleReshapedWarning, match=r"decay_steps=150 \(the old schedule had ended at update 150"):
        warn_if_schedule_reshaped(accumulating, 1000, None, tmp_path, 600)
    with pytest.warns(ScheduleReshapedWarning, match=r"decay_steps=150\.$"):
        warn_if_schedule_reshaped(accumulating, 1000, None, tmp_path, 300)
    _saved(tmp_path, "trainer.steps=600")
    with warnings.catch_warnings():  # same steps, or a fixed decay length: nothing changes
        warnings.simplefilter("error")
        warn_if_schedule_reshaped(RunConfig.load("tiny-lm"), 600, None, tmp_path, 300)
        _saved(tmp_path, "trainer.steps=600", "optimizer.decay_steps=600")
        fixed = RunConfig.load("tiny-lm", overrides=["trainer.steps=1000",
                                                     "optimizer.decay_steps=600"])
        warn_if_schedule_reshaped(fixed, 1000, None, tmp_path, 300)


def test_resuming_with_fewer_steps_inside_the_warmup_does_not_warn(tmp_path):
    from dew.training.optim import build_schedule

    # Stopped at step 30 of 200 and resumed for 50, with a warmup of 50: the decay is 200 updates long
    # before and 51 after, but every update still to come is inside the warmup, where both agree.
    _saved(tmp_path, "trainer.steps=200", "optimizer.warmup_steps=50")
    shorter = RunConfig.load("tiny-lm", overrides=["trainer.steps=50", "optimizer.warmup_steps=50"])
    before = shorter.optimizer.model_copy(update={"decay_steps": 200})
    after = shorter.optimizer.model_copy(update={"decay_steps": 51})
    assert all(build_schedule(before)(u) == build_schedule(after)(u) for u in range(30, 51))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_schedule_reshaped(shorter, 50, None, tmp_path, 30)
    # Resumed for 60 instead, update 51 onwards decays on the new schedule and not on the old: it warns.
    assert build_schedule(before)(55) != build_schedule(after.model_copy(update={"decay_steps": 60}))(55)
    longer = RunConfig.load("tiny-lm", overrides=["trainer.steps=60", "optimizer.warmup_steps=50"])
    with pytest.warns(ScheduleReshapedWarning, match=r"decay_steps=200\."):
        warn_if_schedule_reshaped(longer, 60, None, tmp_path, 30)


def test_a_model_section_exactly_when_the_objective_takes_a_model():
    from dew.objectives.base import Objective

    class OwnNetwork(Objective):
        pass

    base = {"objective": {"name": "own"}, "data": {"name": "token_windows", "batch": 2},
            "trainer": {"steps": 1}}
    with registry.objectives.temporary("own", OwnNetwork):
        assert RunConfig.parse(base).model is None
        model = {"name": "causal_transformer", "vocab_size": 8, "emb_features": 8,
                 "num_layers": 1, "num_heads": 1, "mlp_features": 8, "max_seq_len": 8}
        with pytest.raises(RecipeError, match="builds its own network and takes no model"):
            RunConfig.parse({**base, "model": model})
    with pytest.raises(RecipeError, match="objective 'lm' trains a model: add a model section"):
        RunConfig.parse({**base, "objective": {"name": "lm", "seq_len": 4}})


SMALL = """
model: {name: causal_transformer, vocab_size: 257, emb_features: 16, num_layers: 1,
        num_heads: 2, mlp_features: 32, max_seq_len: 16}
objective: {name: lm, seq_len: 8}
data: {name: token_windows, files: "{stdlib}/abc.py", length: 8, tokenizer: byte, batch: 4}
optimizer: {learning_rate: 1.0e-3, schedule: cosine}
trainer: {steps: 2, log_every: 1, checkpoint_every: 2}
"""


@pytest.mark.slow  # two short trainings through the recipe path
def test_dew_train_warns_when_a_resume_reshapes_the_schedule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "small.yaml"
    recipe.write_text(SMALL)
    checkpoints = f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleReshapedWarning)
        assert main(["train", str(recipe), checkpoints]) == 0  # a fresh run: nothing to warn
    with pytest.warns(ScheduleReshapedWarning, match="resumes at step 2 of checkpoints trained "
                                                     "for 2 steps.*decay_steps=2"):
        assert main(["train", str(recipe), checkpoints, "trainer.steps=4"]) == 0
    assert json.loads((tmp_path / "ckpt" / "run.json").read_text())["trainer"]["steps"] == 4


@pytest.mark.parametrize("name", ["dew.cli.describe", "dew.cli.run_page"])
def test_docstring_examples_of_the_cli_modules_run(name):
    # tests/test_docstrings.py leaves dew.cli.* out; these two have examples of their own
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- what cannot drift: the recipe table, the descriptions, the placeholders, the statuses ---------

def _between_markers(text: str, command: str) -> str:
    found = re.search(rf"<!-- {re.escape(command)} -->\n(.*?)\n<!-- end -->", text, flags=re.S)
    assert found, f"the page has no block generated by {command}"
    return found.group(1)


def test_the_recipe_table_is_what_dew_recipes_markdown_prints(capsys):
    assert main(["recipes", "--markdown"]) == 0
    printed = capsys.readouterr().out.strip()
    assert _between_markers(PAGE.read_text(), "dew recipes --markdown") == printed, (
        "docs/cli.md shows a stale recipe table: paste `dew recipes --markdown` over it")
    for name in shipped():  # one row per recipe, linked to its section
        assert f"| [{name}](#{name}) |" in printed


def test_each_recipe_section_opens_with_the_recipe_files_own_description():
    from dew.cli.recipes import describe

    text = PAGE.read_text()
    for name, description in describe().items():
        section = re.search(rf"^### {re.escape(name)}\n\n(.*?)\n\n", text, flags=re.M | re.S)
        assert section, f"no section for {name}"
        assert " ".join(section.group(1).split()) == description, (
            f"the {name} section does not open with its recipe's description")


def test_the_recipe_table_names_each_model_as_its_recipe_builds_it():
    """The drift the table prevents: positions and activation are the built model's, defaults included."""
    table = {row.split("|")[1].strip(): row for row in _between_markers(PAGE.read_text(), "dew recipes --markdown").splitlines()[2:]}
    for name in shipped():
        config = RunConfig.load(name)
        if config.model is None or config.model.name != "causal_transformer":
            continue
        from dew import models

        built = models.build(config.model.name, **config.model.fields)
        row = table[f"[{name}](#{name})"]
        assert f"{built.position_embedding} positions, {built.mlp_activation}" in row, row
        assert f"{built.num_layers} layer" in row and f"{built.emb_features} wide" in row, row


def test_the_needs_first_column_names_every_other_folder_a_recipe_reads():
    """Read from the recipe files by hand: every runs/, exported/ or checkpoints/ path a recipe names,
    other than its own run folder, is in its row's last column (or inside a folder listed there)."""
    from dew.recipes.reading import read_recipe_file

    def paths(node, key=""):
        if isinstance(node, dict):
            for name, value in node.items():
                yield from paths(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from paths(value, f"{key}.{index}")
        elif isinstance(node, str) and node.split("/")[0] in ("runs", "exported", "checkpoints"):
            yield key, node

    table = {row.split("|")[1].strip(): row.split("|")[-2] for row in
             _between_markers(PAGE.read_text(), "dew recipes --markdown").splitlines()[2:]}
    for name, path in shipped().items():
        data = read_recipe_file(path) or {}
        own = (data.get("trainer") or {}).get("checkpoint_dir")
        read = {value for key, value in paths(data) if value != own and not key.startswith("trackers.")
                and not key.startswith("trainer.")}
        needs = table[f"[{name}](#{name})"]
        listed = re.findall(r"`([^`]+)`", needs)
        assert all(any(value == x or value.startswith(x + "/") for x in listed) for value in read), (
            name, read, needs)


def test_every_placeholder_expand_replaces_is_documented():
    import inspect

    from dew.recipes import run as module

    replaced = set(re.findall(r'"\{(\w+)\}"', inspect.getsource(module.expand)))
    text = PAGE.read_text()
    section = text[text.index("placeholders are replaced"):text.index("## Overrides")]
    documented = set(re.findall(r"^- `\{(\w+)\}`", section, flags=re.M))
    assert replaced == documented == {"stdlib", "recipes", "timestamp"}, (replaced, documented)
    for name in documented:
        assert expand(f"{{{name}}}", "2026-01-01_00:00:00") != f"{{{name}}}"


# Each exit status the page documents, and the test that makes a real `dew` process end with it.
EXIT_STATUSES = {
    0: "tests/test_docs_cli.py::test_every_command_on_the_page_runs",
    1: "tests/test_docs_cli.py::test_an_unexpected_error_keeps_its_traceback_and_exits_1",
    2: "tests/test_after_a_run.py::test_a_missing_prerequisite_is_one_message_and_no_folder",
    75: "tests/test_launch_pool.py::test_a_process_whose_peer_died_exits_75_naming_the_collective_that_lost_it",
    130: "tests/test_after_a_run.py::test_ctrl_c_and_sigterm_print_the_command_that_resumes_one_folder",
    141: "tests/test_cli_errors.py::test_a_reader_that_closes_the_pipe_ends_the_command_without_a_traceback",
    143: "tests/test_after_a_run.py::test_ctrl_c_and_sigterm_print_the_command_that_resumes_one_folder",
}


def test_every_documented_exit_status_is_tested():
    text = PAGE.read_text()
    table = text[text.index("### Errors and exit status"):text.index("## `dew launch")]
    documented = {int(s) for s in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    assert documented == set(EXIT_STATUSES), documented
    root = PAGE.parents[1]
    for status, test in EXIT_STATUSES.items():
        path, name = test.split("::")
        assert f"def {name}(" in (root / path).read_text(), f"status {status}: {test} is gone"
    # The error table of docs/training.md says the same: dew's own errors exit 2 (a crash after a
    # checkpoint, NonFiniteLossError, exits 2 in test_a_crash_after_a_checkpoint_prints_the_command_that_resumes).
    training = " ".join((PAGE.parent / "training.md").read_text().split())
    said = re.search(r"`dew train` prints any of these as one message .*? exits with status (\d+)", training)
    assert said and int(said.group(1)) == 2, "docs/training.md gives another exit status for dew's errors"


PLANTED = """
import sys
from dew import registry
from dew.cli import main
from dew.objectives.base import Objective


class Broken(Objective):
    def init(self, key, variables=None):
        raise RuntimeError("a bug in a plugin's init")


with registry.objectives.temporary("broken", Broken):
    sys.exit(main(["train", sys.argv[1]]))
"""


def test_an_unexpected_error_keeps_its_traceback_and_exits_1(tmp_path):
    """An error that is not dew's is a bug: Python's own status 1, with the whole traceback."""
    from dew.testing.processes import run_python

    recipe = tmp_path / "broken.yaml"
    recipe.write_text("objective: {name: broken}\n"
                      "data: {name: token_windows, files: '{stdlib}/abc.py', length: 8, batch: 2}\n"
                      "trainer: {steps: 1}\n")
    result = run_python(PLANTED.replace("sys.argv[1]", repr(str(recipe))), timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: a bug in a plugin's init" in result.stderr, result.stderr[-2000:]
    assert "dew train:" not in result.stderr  # no one-line message dressing up a bug
    assert not (tmp_path / "runs").exists()
