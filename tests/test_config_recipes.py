"""Recipes that name the objectives' and data's components: shipped recipes parse, fields are checked and built, run.json reads back, a recipe trains (they need every distribution)."""

from __future__ import annotations

import json

import pytest

from dew import registry
from dew.recipes.config import RunConfig, shipped
from dew.recipes.errors import RecipeError
from test_config import _find_config  # every test folder is on sys.path (conftest.py)
from test_recipe_config import (
    RECIPE,
    problems,
    recipe,
    repeated_reader,  # noqa: F401 - the autouse fixture registering "repeated"
)


@pytest.mark.parametrize("name", sorted(shipped()))
def test_every_shipped_recipe_parses(name):
    config = RunConfig.load(name)
    assert config.description, f"{name} needs a one-line description for `dew recipes`"


@pytest.mark.parametrize("name", sorted(shipped()))
def test_every_shipped_recipe_validates_on_a_cadence_before_its_last_step(name):
    # The recipe matrix shows each run keeps a held-out split (`dew eval RUN` with no flags);
    # this shows training reports on it while it runs, not only once the last step is done.
    trainer = RunConfig.load(name).trainer
    assert trainer.eval_every is not None and trainer.eval_every < trainer.steps, (
        f"{name}: trainer.eval_every={trainer.eval_every} with steps={trainer.steps} validates at the end only")


def test_component_fields_are_checked_against_the_component():
    model = dict(RECIPE["model"], emb_features="wide", dropout=0.1)
    del model["num_layers"]
    text = problems(recipe(model=model, objective={"name": "lm", "seq_len": 16, "model": "x"}))
    assert "model.emb_features: Input should be a valid integer" in text and "'wide'" in text
    assert "model.dropout: model 'causal_transformer' has no field 'dropout'" in text
    assert "model.num_layers: model 'causal_transformer' requires this field" in text
    assert "objective.model: the run supplies" in text
    assert "4 problem(s)" in text


def test_quantization_is_read_and_checked():
    from dew.adapters.quantization import Quantization

    config = RunConfig.parse(recipe(quantization={"dtype": "int8", "backward": "int8"}))
    assert config.quantization == Quantization("int8", backward="int8")
    text = problems(recipe(quantization={"dtyp": "int8"}))
    assert "quantization.dtyp: unknown field" in text and "dtype, activations" in text


def test_component_mappings_become_their_dataclasses():
    from dew import models
    from dew.sampling import Sampling

    model = models.build("causal_transformer", vocab_size=8, emb_features=8, num_layers=1,
                         num_heads=1, mlp_features=8, max_seq_len=16)
    fields = {"model": model, "seq_len": 16, "preview_sampling": {"temperature": 0.5, "top_k": 3}}
    built = registry.objectives.build("lm", **fields)  # the one place fields are checked and coerced
    assert built.preview_sampling == Sampling(0.5, 3) and built.seq_len == 16 and built.model is model
    text = problems(recipe(objective={"name": "lm", "seq_len": 16,
                                      "preview_sampling": {"temperature": "hot"}}))
    assert "objective.preview_sampling.temperature: Input should be a valid number" in text


def test_load_applies_overrides_then_validates(tmp_path):
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump(RECIPE))
    config = RunConfig.load(path, ["trainer.steps=7", "optimizer.solver=lion"])
    assert config.trainer.steps == 7 and config.optimizer.solver == "lion"
    with pytest.raises(RecipeError, match=r"trainer\.stepz: unknown field"):
        RunConfig.load(path, ["trainer.stepz=7"])


def test_save_writes_run_json_that_reads_back(tmp_path):
    config = RunConfig.parse(recipe(trackers=[{"name": "local", "directory": str(tmp_path)}]))
    path = config.save(tmp_path / "run")
    assert path.name == "run.json"
    written = json.loads(path.read_text())
    assert written["trainer"]["steps"] == 3 and written["model"]["emb_features"] == 16
    # Read back, it is the same recipe, the model's defaults now written out (what it trained as).
    again = RunConfig.read(path.parent)
    assert again.recorded() == config.recorded() and again.model_copy(update={"model": config.model}) == config
    assert "rope_base" not in config.model.fields and again.model.fields["rope_base"] == 10000.0
    assert {k: again.model.fields[k] for k in config.model.fields} == config.model.fields


@pytest.mark.slow
def test_train_runs_the_recipe_and_prints_a_sample(tmp_path, capsys):
    config = RunConfig.parse(recipe(
        objective={"name": "lm", "seq_len": 16, "prompt": "dew", "preview_tokens": 8},
        trackers=[{"name": "local", "directory": str(tmp_path / "track")}],
        trainer={"steps": 3, "log_every": 1, "checkpoint_dir": str(tmp_path / "ckpt"),
                 "checkpoint_every": 3}))
    state = config.train()
    assert int(state.step) == 3
    assert RunConfig.read(tmp_path / "ckpt").recorded() == config.recorded()  # the model's defaults written out
    out = capsys.readouterr().out
    assert "Sample (sample):\ndew" in out
    scalars = (tmp_path / "track" / "scalars.jsonl").read_text()
    assert '"train/loss"' in scalars and '"train/lr"' in scalars
    rows = [json.loads(line) for line in (tmp_path / "track" / "records.jsonl").read_text().splitlines()]
    started = next(row for row in rows if "run_started" in json.dumps(row))
    assert config.recorded() == _find_config(started)


def test_docstring_examples_run():
    import doctest

    import dew.recipes.config
    import dew.training.config

    for module in (dew.training.config, dew.recipes.config):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_init_ignore_starts_the_named_leaves_fresh_and_reads_the_rest(tmp_path):
    """A recipe's init.ignore: the other run lacks the head and holds a leaf this model lacks;
    the named leaves start as the run's own init makes them, every other leaf is read bitwise."""
    import flax.linen as nn
    import jax
    import numpy as np

    from dew.checkpoints.manager import Checkpoints
    from dew.data.base import DataPartition
    from dew.recipes.run import build_parts, initial_variables
    from dew.training.state import Scaler, TrainState, stream

    config = RunConfig.load("tiny-lm", [f"init.run={tmp_path}/other", "seed=3",
                                        "init.ignore=[params/head*, params/value_head*]"])
    objective = build_parts(config, with_data=False).objective
    fresh = jax.device_get(nn.meta.unbox(objective.init(stream(jax.random.key(3), "init"))))
    other = jax.device_get(nn.meta.unbox(objective.init(jax.random.key(11))))
    saved = {"params": {**{k: v for k, v in other["params"].items() if k != "head"},
                        "value_head": {"kernel": np.ones((4, 1), np.float32)}}}
    state = TrainState(params=saved, opt_state=(), key=jax.random.key_data(jax.random.key(0)),
                       step=np.int32(1), microstep=np.int32(0), updates=np.int32(1), ema=None,
                       scaler=Scaler.create(), window=None)
    checkpoints = Checkpoints(tmp_path / "other")
    checkpoints.save(1, state, position=b"", partition=DataPartition(), meta={})
    checkpoints.wait()
    checkpoints.close()

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), fresh)
    read = initial_variables(config, objective)(abstract)
    assert sorted(read["params"]) == sorted(fresh["params"])  # the value head is not read
    np.testing.assert_array_equal(read["params"]["head"], fresh["params"]["head"])
    jax.tree.map(np.testing.assert_array_equal, read["params"]["embed"], other["params"]["embed"])
    jax.tree.map(np.testing.assert_array_equal, read["params"]["layers_1"], other["params"]["layers_1"])


def test_init_ignore_starts_named_leaves_of_a_published_checkpoint_fresh(tmp_path):
    """init.ignore beside init.pretrained: the named leaves start as the run's own init makes them,
    the rest are the checkpoint's (the ignore is applied before the objective narrows what it reads)."""
    import flax.linen as nn
    import jax
    import numpy as np

    from dew.families.examples import main
    from dew.pretrained import Pretrained
    from dew.recipes.run import build_parts, initial_variables
    from dew.training.state import stream

    assert main(["qwen3", str(tmp_path / "qwen3-tiny"), "--seed", "1"]) == 0
    config = RunConfig.load("tiny-lm", ["model={name: qwen3, preset: tiny, max_seq_len: 32}", "seed=3", "objective.seq_len=32",
                                        f"init={{pretrained: {tmp_path / 'qwen3-tiny'}}}",
                                        f"data.tokenizer={tmp_path / 'qwen3-tiny'}", "init.ignore=[params/layers_0/attention/query*]"])
    objective = build_parts(config, with_data=False).objective
    fresh = jax.device_get(nn.meta.unbox(objective.init(stream(jax.random.key(3), "init"))))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), fresh)
    read = initial_variables(config, objective)(abstract)
    checkpoint = Pretrained.load(tmp_path / "qwen3-tiny", max_seq_len=32).variables
    query = read["params"]["layers_0"]["attention"]["query"]
    jax.tree.map(np.testing.assert_array_equal, query, fresh["params"]["layers_0"]["attention"]["query"])
    assert not np.array_equal(jax.tree.leaves(query)[0],
                              jax.tree.leaves(checkpoint["params"]["layers_0"]["attention"]["query"])[0])
    jax.tree.map(np.testing.assert_array_equal, read["params"]["embed"], checkpoint["params"]["embed"])


def test_init_within_starts_from_the_student_a_distillation_run_kept_beside_its_teacher(tmp_path):
    """A distilled student is a starting point (fine-tune it next); its run keeps params/student
    and params/teacher, and init.within=student reads the student alone, bitwise."""
    import flax.linen as nn
    import jax
    import numpy as np

    from dew.checkpoints.manager import Checkpoints
    from dew.data.base import DataPartition
    from dew.recipes.run import build_parts, initial_variables
    from dew.training.initializers import InitializerMismatchError
    from dew.training.state import Scaler, TrainState

    objective = build_parts(RunConfig.load("tiny-lm"), with_data=False).objective
    student = jax.device_get(nn.meta.unbox(objective.init(jax.random.key(5))))
    teacher = {"head": np.ones((3, 257), np.float32)}
    state = TrainState(params={"params": {"student": student["params"], "teacher": teacher}}, opt_state=(),
                       key=jax.random.key_data(jax.random.key(0)), step=np.int32(1), microstep=np.int32(0),
                       updates=np.int32(1), ema=None, scaler=Scaler.create(), window=None)
    checkpoints = Checkpoints(tmp_path / "distilled")
    checkpoints.save(1, state, position=b"", partition=DataPartition(), meta={})
    checkpoints.wait()
    checkpoints.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), student)
    config = RunConfig.load("tiny-lm", [f"init.run={tmp_path}/distilled", "init.within=student"])
    read = initial_variables(config, objective)(abstract)
    jax.tree.map(np.testing.assert_array_equal, read, student)
    whole = RunConfig.load("tiny-lm", [f"init.run={tmp_path}/distilled"])
    with pytest.raises(InitializerMismatchError, match="init.within=student"):
        initial_variables(whole, objective)(abstract)
    with pytest.raises(RecipeError, match="init.within picks a model inside init.run"):
        RunConfig.load("tiny-lm", [f"init.pretrained={tmp_path}", "init.within=student"])


def test_init_ema_starts_from_the_runs_ema_copy_in_the_models_dtypes(tmp_path):
    """init.run read the live weights alone, while the run's export, dew generate and dew eval use its
    EMA: a FlowGRPO run started from a diffusion run that drew other samples than it was said to."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew.checkpoints.manager import Checkpoints
    from dew.data.base import DataPartition
    from dew.recipes.run import build_parts, initial_variables
    from dew.training.initializers import InitializerMismatchError
    from dew.training.state import Scaler, TrainState

    objective = build_parts(RunConfig.load("tiny-lm"), with_data=False).objective
    live = jax.device_get(nn.meta.unbox(objective.init(jax.random.key(5))))
    averaged = {"embed": jax.tree.map(lambda x: np.full(x.shape, 0.25, np.float32), live["params"]["embed"])}

    def save(where, ema):
        state = TrainState(params=live, opt_state=(), key=jax.random.key_data(jax.random.key(0)), step=np.int32(1),
                           microstep=np.int32(0), updates=np.int32(1), ema=ema, scaler=Scaler.create(), window=None)
        checkpoints = Checkpoints(tmp_path / where)
        checkpoints.save(1, state, position=b"", partition=DataPartition(), meta={})
        checkpoints.wait()
        checkpoints.close()

    save("averaged", {"params": averaged})
    save("plain", None)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.bfloat16), live)  # a bfloat16 model
    read = initial_variables(RunConfig.load("tiny-lm", [f"init.run={tmp_path}/averaged", "init.ema=true"]),
                             objective)(abstract)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(read))
    assert np.all(np.asarray(read["params"]["embed"]["embedding"], np.float32) == 0.25)  # the EMA's leaves
    for name in set(live["params"]) - {"embed"}:  # the rest, which the EMA does not hold: the live weights
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                                np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32)),
                     read["params"][name], live["params"][name])
    unchanged = initial_variables(RunConfig.load("tiny-lm", [f"init.run={tmp_path}/averaged"]), objective)(abstract)
    assert not np.any(np.asarray(unchanged["params"]["embed"]["embedding"], np.float32) == 0.25)
    with pytest.raises(InitializerMismatchError, match="kept no EMA .* unset init.ema"):
        initial_variables(RunConfig.load("tiny-lm", [f"init.run={tmp_path}/plain", "init.ema=true"]), objective)(abstract)
    with pytest.raises(RecipeError, match="init.ema reads init.run's EMA copy"):
        RunConfig.load("tiny-lm", [f"init.pretrained={tmp_path}", "init.ema=true"])


def test_a_lora_base_that_does_not_fit_is_not_advised_init_ignore(tmp_path):
    """Under lora, init.ignore is refused (the adapters freeze every base weight, so an ignored one
    would stay random), yet a base of other shapes was advised to name leaves for init.ignore."""
    import flax.linen as nn
    import jax
    import numpy as np

    from dew.checkpoints.manager import Checkpoints
    from dew.data.base import DataPartition
    from dew.recipes.run import build_parts, initial_variables
    from dew.training.initializers import InitializerMismatchError
    from dew.training.state import Scaler, TrainState

    other = build_parts(RunConfig.load("tiny-lm", ["model.emb_features=64"]), with_data=False).objective
    saved = jax.device_get(nn.meta.unbox(other.init(jax.random.key(5))))
    state = TrainState(params=saved, opt_state=(), key=jax.random.key_data(jax.random.key(0)), step=np.int32(1),
                       microstep=np.int32(0), updates=np.int32(1), ema=None, scaler=Scaler.create(), window=None)
    checkpoints = Checkpoints(tmp_path / "run")
    checkpoints.save(1, state, position=b"", partition=DataPartition(), meta={})
    checkpoints.wait()
    checkpoints.close()
    for name in ("tiny-lm-lora", "tiny-lm"):
        config = RunConfig.load(name, [f"init.run={tmp_path}/run"])
        objective = build_parts(config, with_data=False).objective
        abstract = jax.eval_shape(lambda built=objective: nn.meta.unbox(built.init(jax.random.key(0))))
        with pytest.raises(InitializerMismatchError, match="shape") as refused:
            initial_variables(config, objective)(abstract)
        said = str(refused.value)
        assert ("init.ignore" in said) == (name == "tiny-lm"), said
        assert ("A LoRA run trains adapters over its base as read" in said) == (name == "tiny-lm-lora"), said


def test_a_value_of_braces_alone_is_the_text_typed():
    """YAML reads {timestamp} as a mapping with no values: trainer.checkpoint_dir={timestamp} was
    refused as 'Input should be a valid string (given {'timestamp': None})', and so was a task's
    template of one field, --set template={question}."""
    config = RunConfig.load("tiny-lm", ["trainer.checkpoint_dir={timestamp}", "objective.prompt={question}",
                                        "trainer.evaluate+={task: perplexity, file: x.jsonl}"])
    assert config.trainer.checkpoint_dir == "{timestamp}" and config.objective.fields["prompt"] == "{question}"
    assert config.trainer.evaluate[0].fields["file"] == "x.jsonl"  # a flow mapping with values is still one


def test_a_tokenizer_past_the_embedding_of_the_starting_weights_is_told_that_dew_does_not_grow_it(tmp_path,
                                                                                                 capsys):
    """A checkpoint whose embedding holds its tokenizer's ids exactly, and that tokenizer with a chat
    marker added: the refusal said to raise model.vocab_size, which the init then refused as another
    vocab_size than the checkpoint's, and that refusal said to set it back."""
    import shutil

    import torch
    import transformers

    from dew.cli import main as dew
    from dew.families.examples import main

    assert main(["qwen3", str(tmp_path / "qwen3-tiny")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3-tiny", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen3-tiny")
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "exact")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(tmp_path / "added")
    shutil.copy(tmp_path / "qwen3-tiny" / "chat_template.jinja", tmp_path / "added")
    size = len(tokenizer) - 1
    assert dew(["train", "qwen3-sft", f"init.pretrained={tmp_path / 'exact'}", f"data.tokenizer={tmp_path / 'added'}",
                f"model.vocab_size={size}", "--check"]) == 2
    err = capsys.readouterr().err
    assert (f"The tokenizer has {size + 1} ids but the model's vocab_size is {size}, and the weights the run starts "
            f"from ({tmp_path / 'exact'}, the recipe's init) keep that many embedding rows: dew does not grow") in err, err
    assert "model.vocab_size in a recipe" not in err
