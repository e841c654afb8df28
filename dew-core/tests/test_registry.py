"""The registries: names from entry points, errors that say how to fix them, lazy loading.

Distributions here are real metadata: tiny ``*.dist-info`` directories with an
``entry_points.txt``, placed on a temporary ``sys.path`` entry, which
``importlib.metadata`` reads exactly as it reads an installed wheel.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import flax.linen as nn
import pytest

from dew import MissingDistributionError
from dew import registry as registry_module
from dew.registry import InvalidFieldsError, NameConflictError, Registry, UnknownNameError

GROUP = "dewtest.things"


def make_distribution(root: Path, name: str, entry_points: dict[str, dict[str, str]],
                      modules: dict[str, str] | None = None, metadata: str = "") -> None:
    """Write an installed-looking distribution (dist-info plus modules) into root."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{metadata}"
    )
    lines = []
    for group, names in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in names.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A temporary sys.path entry that distributions can be written into."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


def test_unknown_name_lists_every_name_with_its_distribution_and_suggests(site):
    make_distribution(site, "dewtest-alpha", {GROUP: {"causal_lm": "m:A", "conv_net": "m:B"}})
    make_distribution(site, "dewtest-beta", {GROUP: {"vision_tower": "n:C"}})
    things = Registry(GROUP, "thing")
    with pytest.raises(UnknownNameError) as caught:
        things.load("causal_ln")
    message = str(caught.value)
    for listed in ("causal_lm (dewtest-alpha)", "conv_net (dewtest-alpha)",
                   "vision_tower (dewtest-beta)"):
        assert listed in message
    assert "Did you mean 'causal_lm'?" in message
    assert isinstance(caught.value, KeyError)  # callers catching KeyError still work
    assert things.names() == {
        "causal_lm": "dewtest-alpha", "conv_net": "dewtest-alpha", "vision_tower": "dewtest-beta",
    }


def test_dew_builtins_register_through_entry_points():
    assert registry_module.models.names()["causal_transformer"] == "dew-core"
    assert registry_module.trackers.names()["local"] == "dew-core"
    assert registry_module.registry("models") is registry_module.models
    assert registry_module.registry("dew.trackers") is registry_module.trackers
    with pytest.raises(UnknownNameError, match="dew.models, dew.objectives"):
        registry_module.registry("dew.modles")


class Tiny(nn.Module):
    """A real Flax module: its dataclass fields are what build() accepts."""

    features: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


class Sink:
    """A plain class: its constructor's parameters are what build() accepts."""

    def __init__(self, directory: str, *, every: int = 1) -> None:
        self.directory = directory
        self.every = every


@pytest.mark.parametrize(
    ("component", "kwargs", "expected"),
    [
        (Tiny, {"featurs": 4}, ["'featurs' (did you mean 'features'?)", "features, dropout"]),
        (Tiny, {"dropout": 0.5}, ["features: Field required", "features, dropout"]),
        (Tiny, {"features": "four"}, ["features: Input should be a valid integer", "'four'"]),
        (Sink, {"directory": "runs", "evry": 2}, ["'evry' (did you mean 'every'?)", "directory, every"]),
        (Sink, {}, ["directory: Field required", "directory, every"]),
        (Sink, {"directory": "runs", "every": "often"}, ["every: Input should be a valid integer"]),
    ],
)
def test_bad_fields_are_named_with_the_valid_fields(component, kwargs, expected):
    things = Registry(GROUP, "thing")
    with things.temporary("it", component):
        with pytest.raises(InvalidFieldsError) as caught:
            things.build("it", **kwargs)
    for text in expected:
        assert text in str(caught.value)
    assert "thing 'it'" in str(caught.value)


def test_build_constructs_after_validation():
    import jax
    import jax.numpy as jnp

    things = Registry(GROUP, "thing")
    with things.temporary("tiny", Tiny), things.temporary("sink", Sink):
        model = things.build("tiny", features=3)
        variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
        assert variables["params"]["Dense_0"]["kernel"].shape == (5, 3)
        sink = things.build("sink", directory="runs", every=4)
        assert (sink.directory, sink.every) == ("runs", 4)
        assert things.validate("sink", {"directory": "x"}) == {"directory": "x"}


def test_import_failure_names_the_distribution_and_extra(site):
    make_distribution(
        site, "dewtest-fancy",
        {GROUP: {"fancy": "dewtest_fancy_tracker:Tracker", "broken": "dewtest_absent:Thing"}},
        modules={"dewtest_fancy_tracker": "import dewtest_fancy_backend\nclass Tracker: ...\n"},
        metadata=(
            "Provides-Extra: fancy-backend\n"
            'Requires-Dist: dewtest-fancy-backend>=1; extra == "fancy-backend"\n'
        ),
    )
    things = Registry(GROUP, "tracker")
    with pytest.raises(MissingDistributionError) as caught:
        things.load("fancy")
    message = str(caught.value)
    assert "dewtest-fancy" in message and "'dewtest_fancy_backend' is missing" in message
    assert "pip install 'dewtest-fancy[fancy-backend]'" in message
    # An entry point naming a module the distribution lacks was blamed on the install alone, which
    # reinstalling does not fix: the entry point itself is named first.
    with pytest.raises(MissingDistributionError, match=r"module 'dewtest_absent' is missing. Its entry point names "
                       r"that module, which dewtest-fancy does not hold: the entry point is wrong \(fix it in "
                       r"dewtest-fancy's pyproject.toml and reinstall\), or the install is incomplete"):
        things.load("broken")


def test_two_distributions_claiming_one_name_is_an_error_naming_both(site):
    make_distribution(site, "dewtest-one", {GROUP: {"shared": "dewtest_one:Thing", "solo": "dewtest_one:Thing"}},
                      modules={"dewtest_one": "class Thing: ...\n"})
    make_distribution(site, "dewtest-two", {GROUP: {"shared": "dewtest_two:Thing"}},
                      modules={"dewtest_two": "class Thing: ...\n"})
    things = Registry(GROUP, "thing")
    for attempt in (things.load, things.provider, lambda n: things.build(n)):
        with pytest.raises(NameConflictError) as caught:
            attempt("shared")
        message = str(caught.value)
        assert "dewtest-one (dewtest_one:Thing)" in message
        assert "dewtest-two (dewtest_two:Thing)" in message
    assert things.names()["shared"] == "dewtest-one and dewtest-two"
    assert things.load("solo").__module__ == "dewtest_one"  # the rest of the group still works


def _scan_site(root: Path) -> None:
    make_distribution(
        root, "dewtest-lazy",
        {GROUP: {"one": "dewtest_lazy_one:One", "two": "dewtest_lazy_two:Two"}},
        modules={"dewtest_lazy_one": "class One: ...\n", "dewtest_lazy_two": "class Two: ...\n"},
    )


def test_scanning_imports_nothing(tmp_path, python_in_subprocess):
    _scan_site(tmp_path)
    out = python_in_subprocess(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from dew import registry
        before = set(sys.modules)
        names = {{group: registry.registry(group).names() for group in registry.GROUPS}}
        names["test"] = registry.Registry({GROUP!r}, "thing").names()
        new = sorted(set(sys.modules) - before)
        print(json.dumps({{"names": names, "new": new}}))
    """)
    result = json.loads(out.splitlines()[-1])
    assert result["names"]["test"] == {"one": "dewtest-lazy", "two": "dewtest-lazy"}
    assert "causal_transformer" in result["names"]["models"]
    targets = {"dew.nn", "dew.training", "dew.objectives", "dew.trackers", "dew.data",
               "dewtest_lazy", "jax", "flax", "optax", "grain", "wandb", "mlflow", "tensorboard"}
    imported = [m for m in result["new"] if any(m == t or m.startswith(t) for t in targets)]
    assert imported == []


def test_load_imports_exactly_one_module_and_caches(tmp_path, python_in_subprocess):
    _scan_site(tmp_path)
    out = python_in_subprocess(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from dew.registry import Registry
        things = Registry({GROUP!r}, "thing")
        things.names()
        before = set(sys.modules)
        first = things.load("one")
        new = sorted(set(sys.modules) - before)
        again = things.load("one")
        print(json.dumps({{"new": new, "same": first is again, "name": first.__name__}}))
    """)
    result = json.loads(out.splitlines()[-1])
    assert result == {"new": ["dewtest_lazy_one"], "same": True, "name": "One"}


def test_scan_is_cached(site, monkeypatch):
    make_distribution(site, "dewtest-cached", {GROUP: {"a": "m:A"}})
    calls = []
    real = registry_module.importlib_metadata.entry_points

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(registry_module.importlib_metadata, "entry_points", counting)
    things = Registry(GROUP, "thing")
    assert things.names() == things.names() == {"a": "dewtest-cached"}
    assert "a" in things
    assert len(calls) == 1
    things.refresh()
    things.names()
    assert len(calls) == 2


def test_temporary_registers_for_the_block_only(site):
    make_distribution(site, "dewtest-temp", {GROUP: {"installed": "dewtest_temp:Thing"}},
                      modules={"dewtest_temp": "class Thing: ...\n"})
    things = Registry(GROUP, "thing")
    assert "extra" not in things
    with things.temporary("extra", Sink) as component:
        assert component is Sink
        assert things.names() == {"extra": "<test>", "installed": "dewtest-temp"}
        assert things.build("extra", directory="d").directory == "d"
        with things.temporary("extra", Tiny, distribution="inner"):
            assert things.load("extra") is Tiny
            assert things.names()["extra"] == "inner"
        assert things.load("extra") is Sink
    assert "extra" not in things
    with pytest.raises(UnknownNameError):
        things.load("extra")
    assert things.load("installed").__module__ == "dewtest_temp"


def test_a_flag_for_a_number_is_refused_and_a_number_as_text_is_read_as_that_number():
    """pydantic reads true as 1 and lets "4" or 4.0 pass for an int while the component got the
    text or the float; now a flag is refused by name and the others arrive as the int."""
    from dew import registry

    fields = {"vocab_size": 256, "emb_features": 32, "num_layers": 1, "mlp_features": 64, "max_seq_len": 16}
    with pytest.raises(registry.InvalidFieldsError, match=r"num_heads: a number is wanted, not a flag \(given True\)"):
        registry.models.build("causal_transformer", num_heads=True, **fields)
    for given in ("4", 4.0, 4):
        model = registry.models.build("causal_transformer", num_heads=given, **fields)
        assert model.num_heads == 4 and type(model.num_heads) is int, given
    assert registry.models.build("causal_transformer", num_heads=4, rope_base=500000, **fields).rope_base == 500000
