"""Recipes parsed against the registered components: errors that name the path, the value and
what exists, all at once, before anything runs. The recipes name dew-objectives' ``lm``
objective, so these tests need more than dew-core (moved from dew-core/tests/test_config.py)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re

import numpy as np
import pytest

from dew import registry
from dew.data.base import Dataset
from dew.recipes.config import RunConfig, shipped
from dew.recipes.errors import RecipeError

# -- a tiny registered reader, so recipes can be checked without the data distribution --


@dataclasses.dataclass(frozen=True)
class Repeated:
    """One sentence, tokenized as bytes, in every row of every batch."""

    text: str = "dew trains jax models. "
    seq_len: int = 16

    def text_tokenizer(self):  # dew.data.base.TextReader: the recipe hands it to the objective
        from dew.data.tokenizers import ByteTokenizer

        return ByteTokenizer()

    def load(self, batch: int) -> Dataset:
        ids = np.frombuffer((self.text * 40).encode(), np.uint8)[: self.seq_len + 1]
        rows = np.tile(ids.astype(np.int32), (batch, 1))
        return Dataset(train=lambda part: itertools.repeat({"text": rows[: part.rows(batch)]}),
                       val=None, records=64, batch=batch)


@pytest.fixture(autouse=True)
def repeated_reader():
    with registry.datasets.temporary("repeated", Repeated):
        yield


RECIPE = {
    "description": "a test run",
    "seed": 3,
    "model": {"name": "causal_transformer", "vocab_size": 257, "emb_features": 16,
              "num_layers": 1, "num_heads": 2, "mlp_features": 32, "max_seq_len": 32},
    "objective": {"name": "lm", "seq_len": 16},
    "data": {"name": "repeated", "batch": 4, "seq_len": 16},
    "optimizer": {"learning_rate": 0.003},
    "trainer": {"steps": 3, "log_every": 1},
}


def recipe(**sections) -> dict:
    data = copy.deepcopy(RECIPE)
    data.update(sections)
    return data


def problems(data: dict) -> str:
    with pytest.raises(RecipeError) as caught:
        RunConfig.parse(data, "test.yaml")
    return str(caught.value)



# -- parsing and errors ---------------------------------------------------------------------


def test_a_shipped_recipe_exists():
    assert "tiny-lm" in shipped()


def test_unknown_field_names_the_path_and_what_exists():
    text = problems(recipe(trainer={"steps": 3, "mesh": {"fsdpp": 2}}))
    assert "trainer.mesh.fsdpp: unknown field (given 2)" in text
    assert "fsdp, expert, tensor, sequence, stage, microbatches, replicas" in text
    assert "did you mean 'fsdp'" in text


def test_a_misspelled_key_inside_a_dataclass_field_is_unknown_not_dropped():
    # pydantic alone drops a key a plain dataclass does not declare: the run would sample at
    # the default temperature while the recipe says otherwise.
    text = problems(recipe(objective={"name": "lm", "seq_len": 16, "preview_sampling": {"temprature": 1.0}}))
    assert "objective.preview_sampling.temprature: unknown field (given 1.0)" in text
    assert "Allowed: temperature, top_k, top_p, min_p; did you mean 'temperature'?" in text
    assert RunConfig.parse(recipe(objective={"name": "lm", "seq_len": 16, "preview_sampling": {"temperature": 1.0}}),
                           "test.yaml").objective.fields["preview_sampling"] == {"temperature": 1.0}


def test_a_shipped_recipes_problems_are_fixed_by_overrides_not_in_its_installed_file():
    with pytest.raises(RecipeError) as caught:
        RunConfig.load("tiny-lm", ["trainer.stepz=3"])
    assert "trainer.stepz: unknown field" in str(caught.value)
    assert "Fix them with key=value overrides, or in a copy of this shipped recipe" in str(caught.value)
    assert "Fix them in the file or with key=value overrides" in problems(recipe(seed="x"))  # the user's own file


def test_wrong_type_names_the_path_and_the_value():
    text = problems(recipe(trainer={"steps": 3, "mesh": {"fsdp": "two"}}))
    assert re.search(r"trainer\.mesh\.fsdp: Input should be a valid integer.*given 'two'", text)


def test_unknown_registered_name_lists_the_registered_ones():
    text = problems(recipe(model={"name": "causal_transformr"}))
    assert "model.name: no model named 'causal_transformr'" in text
    assert "Did you mean 'causal_transformer'" in text
    assert "causal_transformer (dew-core)" in text
    text = problems(recipe(trackers=[{"name": "local", "directory": "/tmp/x"}, {"name": "nope"}]))
    assert "trackers.1.name: no tracker named 'nope'" in text and "local (dew-core)" in text


def test_every_problem_is_reported_at_once():
    text = problems(recipe(optimizer={"solver": "adam"}, seed="x", extra=1))
    assert "optimizer.solver: Input should be 'adamw', 'lion', 'sgd' or 'adafactor' (given 'adam')" in text
    assert "seed: Input should be a valid integer" in text
    assert "extra: unknown field (given 1)" in text


def test_bad_recipe_fails_before_anything_runs(tmp_path, python_in_subprocess):
    """Parsing a bad recipe opens no JAX backend and builds nothing."""
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: causal_transformer}\nobjective: {name: lm, seq_len: 8}\n"
                    "data: {name: nope, batch: 2}\ntrainer: {steps: 2, mesh: {fsdp: two}}\n")
    out = python_in_subprocess(f"""
        from jax._src import xla_bridge
        from dew.recipes import RunConfig, RecipeError
        try:
            RunConfig.load({str(path)!r})
        except RecipeError as error:
            print(error)
        print("backend opened:", xla_bridge.backends_are_initialized())
    """)
    assert "trainer.mesh.fsdp" in out and "data.name: no dataset named 'nope'" in out
    assert "backend opened: False" in out


def test_load_keywords_are_checked_against_the_readers_load():
    text = problems(recipe(data={"name": "repeated", "batch": 4, "load": {"val_fracton": 0.1}}))
    assert "data.load.val_fracton: repeated.load takes no 'val_fracton'" in text
    text = problems(recipe(data={"name": "repeated", "batch": 4, "load": {"batch": 2}}))
    assert "data.load.batch: give the batch as data.batch" in text


def test_the_journal_follows_the_run_folder_when_only_checkpoint_dir_is_overridden():
    """A shipped recipe writes its local tracker into its checkpoint_dir (a run is one folder);
    overriding checkpoint_dir alone left the journal in the recipe's own folder, so `dew report`
    on the run found no scalars.jsonl."""
    from dew.recipes.config import RunConfig

    def folders(overrides):
        config = RunConfig.load("tiny-lm", overrides)
        return config.trainer.checkpoint_dir, config.trackers[0].fields["directory"]

    assert folders([]) == ("runs/tiny-lm/{timestamp}", "runs/tiny-lm/{timestamp}")
    assert folders(["trainer.checkpoint_dir=runs/a"]) == ("runs/a", "runs/a")
    assert folders(["trainer.checkpoint_dir=runs/a", "trackers.0.directory=logs/b"]) == ("runs/a", "logs/b")
    assert folders(["trackers.0.directory=logs/b"]) == ("runs/tiny-lm/{timestamp}", "logs/b")
    assert folders(["trainer.checkpoint_dir=null"])[1] == "runs/tiny-lm/{timestamp}"  # no run folder to follow
    # another of the tracker's fields changed with it: the journal still follows the run
    assert folders(["trainer.checkpoint_dir=runs/a", "trackers.0.plots=false"]) == ("runs/a", "runs/a")
    assert folders(["trainer.checkpoint_dir=runs/a", "trackers+={name: local, directory: logs/c}"]) == (
        "runs/a", "runs/a")
    assert folders(["trainer.checkpoint_dir=runs/a", "trackers.0={name: local, directory: logs/b}"])[1] == "logs/b"


def test_an_override_of_an_aliased_section_changes_that_place_alone(tmp_path):
    """PyYAML hands every use of an alias the same dict, and an override edited it in place: a
    teacher written as *model shrank with model.num_layers=1, and a tracker list of [&t {...}, *t]
    moved both trackers with trackers.1.directory."""
    from dew.recipes.config import apply_overrides
    from dew.recipes.reading import read_yaml

    data = read_yaml("model: &m {name: causal_transformer, num_layers: 2}\nobjective: {teacher: *m}\n"
                     "trackers: [&t {name: local, directory: runs/x}, *t]\n")
    apply_overrides(data, ["model.num_layers=1", "trackers.1.directory=runs/copy"])
    assert data["model"]["num_layers"] == 1 and data["objective"]["teacher"]["num_layers"] == 2
    assert [t["directory"] for t in data["trackers"]] == ["runs/x", "runs/copy"]


def test_an_empty_run_folder_is_refused_rather_than_the_working_directory_used():
    from dew.recipes.config import RunConfig
    from dew.recipes.errors import RecipeError

    for field in ("checkpoint_dir", "local_checkpoint_dir"):
        with pytest.raises(RecipeError, match=rf"trainer\.{field}"):
            RunConfig.load("tiny-lm", [f"trainer.{field}="])


def test_each_mismatch_hint_pasted_as_printed_brings_the_recipe_closer_until_it_starts():
    """Starting a recipe from another family's checkpoint: the first refusal names the family (not
    one of its many fields), and every later one names an override that, pasted into a shell as
    printed and read as a recipe reads it, fixes that field (a YaRN scaling as a mapping, the
    windowed layers as a list), until the weights are accepted."""
    import shlex

    from dew import models
    from dew.families import family
    from dew.nn.rotary import RopeScaling
    from dew.pretrained import ConfigurationMismatchError, check_same_function
    from dew.recipes.config import RunConfig

    published = family("qwen2").build("tiny", tie_embeddings=False, sliding_layers=(2,), rope_scaling=RopeScaling(
        "yarn", 4.0, original_max_len=64))  # a window on the last layer (its preset: the last two)
    overrides: list[str] = []
    messages = []
    for _ in range(8):
        config = RunConfig.load("qwen3-sft", overrides)
        model = models.build(config.model.name, **config.model.fields)
        try:
            check_same_function(model, published, "init.pretrained ck/qwen2")
            break
        except ConfigurationMismatchError as error:
            message = str(error)
        assert message not in messages, message  # each hint moved the recipe on
        messages.append(message)
        asked = message.split(" Set ", 1)[1].split(" so the weights", 1)[0]
        if asked.startswith("model.name=qwen2 and model.preset to the checkpoint's size"):
            overrides += ["model.name=qwen2", "model.preset=tiny"]  # its size is the user's to know
            continue
        overrides += [w.rstrip(",") for w in shlex.split(asked) if w != "and"]
    else:
        raise AssertionError(messages)
    assert "holds a Qwen2ForCausalLM checkpoint (the qwen2 family)" in messages[0]
    assert "'model.rope_scaling={kind: yarn, factor: 4.0, original_max_len: 64}'" in "".join(messages)
    assert "'model.sliding_layers=[2]'" in "".join(messages)


def test_an_index_into_a_list_the_recipe_lacks_says_how_to_add_an_entry():
    """trackers.0.directory=... on a recipe without trackers made a mapping {'0': ...} and pydantic said
    only "Input should be a valid list"."""
    from dew.recipes.config import apply_overrides
    from dew.recipes.errors import RecipeError

    for override, where in (("trackers.0.directory=runs/a", "trackers"), ("trainer.evaluate.0.task=x", "trainer.evaluate"),
                            ("trackers.1=x", "trackers")):
        with pytest.raises(RecipeError, match=rf"indexes {where}, which the recipe does not hold; "
                                              rf"add an entry with {where}\+=\[\{{\.\.\.\}}\]"):
            apply_overrides({"trainer": {}}, [override])
    assert apply_overrides({"trainer": {}}, ["a.b.c=1"]) == {"trainer": {}, "a": {"b": {"c": 1}}}  # a key: made
