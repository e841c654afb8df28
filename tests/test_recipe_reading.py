"""Hostile recipes are refused within bounds: one `dew train:` message, exit 2, bounded time and memory.

Each file is given to the real ``dew train`` command in a child process whose
address space is capped (so a reader that expands an alias bomb dies instead
of finishing), and the recipe reader is fuzzed: every input yields a valid
RunConfig or a RecipeError, quickly.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dew.recipes.config import RunConfig, shipped
from dew.recipes.errors import RecipeError
from dew.recipes.reading import MAX_BYTES, RecipeFileError, read_recipe_file, read_yaml

MEMORY_LIMIT = 1 << 30  # 1 GiB of address space: `dew train --check tiny-lm` needs far less
TIME_LIMIT = 60.0
TINY = shipped()["tiny-lm"].read_text()


def _bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        name, previous = chr(ord("a") + i), chr(ord("a") + i - 1)
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "billion_laughs": (_bomb(), "once its aliases are expanded"),
    "many_values": ("a: [" + ",".join(["1"] * 100_000) + "]\n", "more than 20000 values"),
    "binary_garbage": (bytes(range(128, 256)) * 8 + os.urandom(512), "not UTF-8"),
    "nul_bytes": (b"trainer:\x00\x00\x01 {steps: 1}\n", "not valid YAML"),
    "deep_lists": ("a: " + "[" * 20000 + "]" * 20000 + "\n", "deeper than"),
    "deep_mappings": ("a: " + "{b: " * 5000 + "1" + "}" * 5000 + "\n", "deeper than"),
    "deep_through_aliases": (
        "a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: &b " + "[" * 30 + "*a" + "]" * 30 + "\n",
        "once its aliases are expanded",
    ),
    "cyclic_alias": ("a: &x [1, *x]\n", "refers to a node containing it"),
    "duplicate_top_key": (TINY + "\nseed: 3\nseed: 4\n", "repeats the key 'seed'"),
    "duplicate_nested_key": ("trainer:\n  steps: 1\n  steps: 2\n", "repeats the key 'steps'"),
    "oversized": ("description: '" + "x" * (MAX_BYTES + 10) + "'\n", "at most"),
    "python_tag": ("seed: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    "not_a_mapping": ("- 1\n- 2\n", "must be a mapping"),
}


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_dew_train_refuses_hostile_recipe_with_one_message(case, tmp_path):
    content, expected = HOSTILE[case]
    recipe = tmp_path / "recipe.yaml"
    if isinstance(content, bytes):
        recipe.write_bytes(content)
    else:
        recipe.write_text(content)
    dew = Path(sys.executable).with_name("dew")
    started = time.monotonic()
    result = subprocess.run(
        [str(dew), "train", str(recipe)], capture_output=True, text=True, errors="replace",
        preexec_fn=_bounded, timeout=TIME_LIMIT, cwd=tmp_path,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("dew train: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert sum(line.startswith("dew train:") for line in lines) == 1
    assert expected in result.stderr, result.stderr[-2000:]
    assert str(recipe) in lines[0]
    assert elapsed < TIME_LIMIT


def test_merge_keys_may_override_but_plain_keys_may_not():
    text = "base: &base {steps: 1, log_every: 2}\ntrainer:\n  <<: *base\n  steps: 5\n"
    assert read_yaml(text)["trainer"] == {"steps": 5, "log_every": 2}
    with pytest.raises(RecipeFileError, match="repeats the key 'steps'"):
        read_yaml("trainer:\n  <<: {log_every: 2}\n  steps: 5\n  steps: 6\n")


@pytest.mark.parametrize(("text", "value"), [
    ("0123", 123),  # YAML 1.1: octal 83
    ("1:30", "1:30"),  # YAML 1.1: 90, in base 60
    ("no", "no"), ("on", "on"), ("Yes", "Yes"),  # YAML 1.1: booleans (a prompt, a mixture source named no)
    ("2026-12-05", "2026-12-05"),  # YAML 1.1: a date
    ("1e-3", 0.001), ("-.5", -0.5), ("1_000", 1000), ("0x1F", 31), ("0o17", 15), ("-7", -7),
    ("true", True), ("False", False), ("~", None), ("'0123'", "0123"),
])
def test_plain_values_read_as_yaml_1_2_reads_them(text, value):
    """YAML 1.2's core schema, which a person writing a recipe today expects (and JSON agrees with),
    not PyYAML's YAML 1.1: a seed of 0123 was read as 83, steps: 1:30 as 90, prompt: no as false."""
    read = read_yaml(f"key: {text}\n")["key"]
    assert read == value and type(read) is type(value), read


@pytest.mark.parametrize("text", ["0x_", "0o_", "._", "-._", "+.__", "0x", "0o", "."])
def test_underscores_without_a_digit_are_text_not_a_crash(text):
    """The number patterns took a run of underscores for digits: `seed=0x_` or a prompt of `._`
    reached int('') or float('.') and printed a traceback; with no digit they are text."""
    assert read_yaml(f"key: {text}\n")["key"] == text
    assert read_yaml("key: 0x_1f\n")["key"] == 31 and read_yaml("key: ._5\n")["key"] == 0.5


@pytest.mark.parametrize(("text", "hint"), [
    ("trainer:\n\tsteps: 5\n", "Indent with spaces"),
    ("seed: 1\n---\nseed: 2\n", "A recipe is one document"),
])
def test_a_yaml_mistake_names_the_file_and_how_to_mend_it(text, hint):
    with pytest.raises(RecipeFileError) as caught:
        read_yaml(text, "my-recipe.yaml")
    assert 'in "my-recipe.yaml", line 2' in str(caught.value) and hint in str(caught.value)
    assert "<unicode string>" not in str(caught.value)


def test_the_shipped_recipes_read_the_same_as_a_plain_safe_load():
    for path in shipped().values():
        assert read_recipe_file(path) == yaml.safe_load(path.read_text())


def test_dew_recipes_reads_through_the_same_reader(monkeypatch):
    from dew.cli import recipes as listing
    from dew.recipes import reading

    calls = []
    real = reading.read_recipe_file
    monkeypatch.setattr(reading, "read_recipe_file", lambda path: calls.append(path) or real(path))
    described = listing.describe()
    assert set(described) == set(shipped()) and len(calls) == len(shipped())


# -- fuzz ------------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=20),
)
_TREES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
_SECTIONS = st.sampled_from(
    ["model", "objective", "data", "trainer", "optimizer", "trackers", "seed", "quantization",
     "description", "name", "steps", "batch", "fields"]
)


def _recipe_text(base: dict, edits: list[tuple[list[str], object]]) -> str:
    for path, value in edits:
        node = base
        for part in path[:-1]:
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[path[-1]] = value
    return yaml.safe_dump(base, allow_unicode=True)


def _check_one(text: str, tmp_path: Path) -> None:
    recipe = tmp_path / "fuzz.yaml"
    recipe.write_text(text, encoding="utf-8", errors="surrogatepass")
    started = time.monotonic()
    try:
        config = RunConfig.load(recipe)
    except RecipeError as error:
        assert str(error).startswith("The recipe ") or "override" in str(error), str(error)
    else:
        assert isinstance(config, RunConfig)
    assert time.monotonic() - started < 10.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab:-[]{},&*!<>|'\"#\n \t?%@`1.e_xo") + ["\x00", "\ufeff"]),
                    max_size=200))
def test_fuzz_yaml_punctuation(text, tmp_path):
    _check_one(text, tmp_path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(TINY)), insert=st.text(max_size=30))
def test_fuzz_spliced_real_recipe(cut, insert, tmp_path):
    _check_one(TINY[:cut] + insert + TINY[cut:], tmp_path)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300))
def test_fuzz_bytes_through_the_file_reader(data, tmp_path_factory):
    recipe = tmp_path_factory.mktemp("bytes") / "fuzz.yaml"
    recipe.write_bytes(data)
    try:
        read_recipe_file(recipe)
    except RecipeFileError as error:
        assert str(recipe) in str(error)


@pytest.mark.parametrize("text", ["seed: " + "1" * 5000, "a: 0o" + "7" * 100_000, "? " + "9" * 5000 + "\n: 1"])
def test_an_integer_longer_than_any_recipe_value_is_refused_in_one_line(text, tmp_path, capsys):
    """Past 4300 digits Python refuses int() with a ValueError, which reached the command as a traceback;
    an octal one was read whole and failed as it was printed."""
    from dew.cli import main
    from dew.recipes.reading import RecipeFileError, read_yaml

    with pytest.raises(RecipeFileError, match=r"holds an integer of \d+ characters .* past the 64 any recipe"):
        read_yaml(text, "given")
    recipe = tmp_path / "big.yaml"
    recipe.write_text(text + "\n")
    assert main(["train", str(recipe), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dew train: ") and "Traceback" not in err and "holds an integer of" in err
