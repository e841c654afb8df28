"""A user's path: train the shipped recipe, then generate, evaluate and export its run;
and fine-tune, through a recipe, a model that transformers initialized.

The commands of a user's path run through ``dew.cli.main`` in this process (the function the
``dew`` console script calls: tests/test_recipe_matrix.py checks they agree, exit codes
included), each in the directory it is typed in, its stdout and stderr read as a terminal
shows them; a refusal before training runs the console script itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dew.testing.processes import device_env, shared_compilation_cache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DEW = Path(sys.executable).parent / "dew"


def _dew(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # One device; the commands of one test share their compiled programs (dew eval and dew
    # generate load what dew train and the first of them compiled for the same model).
    env = device_env(1, compilation_cache=shared_compilation_cache(cwd / ".xla-cache"))
    return subprocess.run([str(DEW), *args], capture_output=True, text=True, timeout=400,
                          cwd=cwd, env=env)


def _journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_trained_run_generates_evaluates_and_exports(tmp_path, dew_command):
    trained = dew_command("train", "tiny-lm", "trainer.steps=4", "trainer.log_every=2",
                   "trainer.checkpoint_every=2", "data.files={stdlib}/a*.py",
                   "data.load.val_fraction=0.1", "objective.ema={decay: 0.5}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout + trained.stderr[-4000:]
    (run,) = (tmp_path / "runs" / "tiny-lm").iterdir()
    # The console says where the run keeps what it wrote.
    assert f"Run: {run} (its recipe in {run / 'run.json'})" in trained.stdout
    assert f"checkpoints: {run}" in trained.stdout
    assert f"tracking: {run.relative_to(tmp_path)}" in trained.stdout
    assert f"dew generate {run} PROMPT" in trained.stdout
    assert (run / "run.json").is_file() and (run / "scalars.jsonl").is_file()

    # dew eval recomputes the validation the run itself logged at its last step.
    logged = [row for row in _journal(run / "scalars.jsonl") if "val/loss" in row][-1]
    evaluated = dew_command("eval", str(run), "--json", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    scores = json.loads(evaluated.stdout)
    assert scores["step"] == 4 and logged["step"] == 4
    assert scores["val/loss"] == pytest.approx(logged["val/loss"], rel=1e-6)
    assert scores["val/perplexity"] == pytest.approx(np.exp(logged["val/loss"]), rel=1e-6)
    assert scores["val_ema/loss"] != scores["val/loss"]  # the EMA copy scores too
    earlier = dew_command("eval", str(run), "--step", "2", "--json", cwd=tmp_path)
    assert earlier.returncode == 0, earlier.stderr[-4000:]
    assert json.loads(earlier.stdout)["val/loss"] != scores["val/loss"]

    # dew export writes what transformers loads, with the logits dew computes from the
    # checkpoint's parameters read directly.
    exported = dew_command("export", str(run), str(tmp_path / "out"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-4000:]
    import jax
    import jax.numpy as jnp

    from dew.recipes.opening import open_run

    opened = open_run(run)
    # The commands use the EMA copy the run kept: the live parameters with the averages in place.
    from dew.training.initializers import ParamsFrom

    live = ParamsFrom(run, step=4)(opened.variables)
    averaged = ParamsFrom(run, step=4, field="ema")(opened.variables)
    assert jax.tree.structure(averaged) == jax.tree.structure(opened.variables)
    for used, ema in zip(jax.tree.leaves(opened.variables), jax.tree.leaves(averaged),
                         strict=True):
        assert np.array_equal(used, ema)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(averaged),
                                                        jax.tree.leaves(live), strict=True))
    ids = np.random.default_rng(0).integers(0, 257, (2, 24))
    ours = np.asarray(opened.model.apply(opened.variables, jnp.asarray(ids, jnp.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4

    # dew generate continues the prompt as generate does with those parameters.
    generated = dew_command("generate", str(run), "def f(", "--max-new-tokens", "12", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr[-4000:]
    from dew.sampling import Sampling, generate

    tokenizer = opened.tokenizer
    expected = generate(opened.model, opened.variables, [tokenizer.encode("def f(")], 12,
                        jax.random.key(0), Sampling(temperature=0.0), eos_id=tokenizer.eos_id)
    assert generated.stdout == "def f(" + tokenizer.decode(expected.new_tokens[0]) + "\n"
    from_export = dew_command("generate", str(tmp_path / "out"), "def f(", "--max-new-tokens", "12",
                       cwd=tmp_path)
    assert from_export.stdout == generated.stdout

    # A run without a checkpoint says so, naming where it looked.
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "run.json", empty / "run.json")
    missing = dew_command("generate", str(empty), "x", cwd=tmp_path)
    assert missing.returncode == 2
    assert "has no checkpoint" in missing.stderr and f"looked in {empty}" in missing.stderr


@pytest.mark.slow
def test_a_run_reads_its_tokenizer_file_from_any_directory(tmp_path, dew_command):
    """A recipe's relative paths (here data.tokenizer) name what they named when the run trained,
    wherever dew generate, eval or export is typed: the run is used by its folder alone."""
    from dew.data import ByteTokenizer
    from dew.pretrained.tokenizers import write_tokenizer

    trained_in, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (trained_in / "tok").mkdir(parents=True)
    elsewhere.mkdir()
    write_tokenizer(ByteTokenizer(), trained_in / "tok")  # a tokenizer.json the recipe names relatively
    trained = dew_command("train", "tiny-lm", "trainer.steps=2", "trainer.log_every=1", "trainer.eval_every=null",
                   "trainer.checkpoint_dir=runs/t", "trackers.0.directory=runs/t", "model.num_layers=1",
                   "model.emb_features=16", "model.num_heads=2", "model.mlp_features=32",
                   "data.files={stdlib}/a*.py", "data.tokenizer=tok/tokenizer.json", "objective.prompt=null",
                   cwd=trained_in)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-4000:]
    run = trained_in / "runs" / "t"
    there = dew_command("generate", "runs/t", "def ", "--max-new-tokens", "4", cwd=trained_in)
    assert there.returncode == 0, there.stderr[-3000:]
    here = dew_command("generate", str(run), "def ", "--max-new-tokens", "4", cwd=elsewhere)
    assert (here.returncode, here.stdout) == (0, there.stdout), here.stderr[-3000:]
    scored = dew_command("eval", str(run), "--json", cwd=elsewhere)
    assert scored.returncode == 0 and json.loads(scored.stdout)["step"] == 2, scored.stderr[-3000:]
    exported = dew_command("export", str(run), str(elsewhere / "out"), cwd=elsewhere)
    assert exported.returncode == 0, exported.stderr[-3000:]


def test_a_tokenizer_larger_than_the_model_is_refused_before_training(tmp_path):
    refused = _dew("train", "tiny-lm", "model.vocab_size=200", "data.files={stdlib}/abc.py",
                   "trainer.steps=1", f"trainer.checkpoint_dir={tmp_path}/run", cwd=tmp_path)
    assert refused.returncode != 0
    assert "VocabularyMismatchError" in refused.stderr
    assert "vocab_size is 200" in refused.stderr and "257" in refused.stderr
    assert "step 1" not in refused.stdout


@pytest.mark.slow
def test_a_model_transformers_initialized_fine_tunes_in_dew(tmp_path):
    from dew.data.base import DataPartition
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")

    recipe = RunConfig.load("tiny-lm", overrides=[
        "model.emb_features=32", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_features=64", f"init.pretrained={tmp_path}/hf", "data.files={stdlib}/abc.py",
        "data.load.val_fraction=0", "trainer.eval_every=null", "trainer.steps=3", "trainer.log_every=1", f"trainer.checkpoint_dir={tmp_path}/run",
        f"trackers.0.directory={tmp_path}/run", "objective.prompt=null",
    ])
    state = recipe.train()
    losses = [row["train/loss"] for row in _journal(tmp_path / "run" / "scalars.jsonl")
              if "train/loss" in row]
    assert int(state.step) == 3 and len(losses) == 3

    # Step 1's loss is transformers' own cross-entropy of the first batch.
    first = next(build_parts(recipe).dataset.train(DataPartition()))["text"]
    with torch.no_grad():
        logits = hf(torch.tensor(np.asarray(first[:, :-1]), dtype=torch.long)).logits
        reference = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 257), torch.tensor(np.asarray(first[:, 1:]), dtype=torch.long
                                                  ).reshape(-1)).item()
    assert losses[0] == pytest.approx(reference, abs=1e-4)
    assert losses[-1] < losses[0]


def test_every_shipped_recipe_keeps_its_run_in_one_directory():
    from dew.recipes.config import RunConfig, shipped

    for name in shipped():
        config = RunConfig.load(name, overrides=["trainer.steps=1"])
        directory = config.trainer.checkpoint_dir
        assert directory is not None, f"{name} keeps no checkpoints"
        journals = [t.fields.get("directory") for t in config.trackers if t.name == "local"]
        assert journals == [directory], f"{name}: journal {journals} beside checkpoints {directory}"


@pytest.mark.slow
def test_a_pretrained_start_is_sharded_by_the_layout(tmp_path, python_in_subprocess):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    out = python_in_subprocess(f"""
        import jax, numpy as np
        from dew.pretrained import Pretrained
        from dew.recipes.config import RunConfig
        from dew.recipes.run import build_parts, initial_variables, run_optimizer
        from dew.training.trainer import Trainer
        recipe = RunConfig.load("tiny-lm", overrides=[
            "model.emb_features=32", "model.num_layers=1", "model.num_kv_heads=2",
            "model.mlp_features=64", "init.pretrained={tmp_path}/hf",
            "data.files={{stdlib}}/abc.py", "trainer.mesh.fsdp=2", "trainer.layout.min_shard=0"])
        objective = build_parts(recipe, with_data=False).objective
        trainer = Trainer.from_config(recipe.trainer, objective, run_optimizer(recipe, 10),
                                      key=jax.random.key(0),
                                      initializer=initial_variables(recipe, objective))
        state, placement, _ = trainer.place()
        table = state.params["params"]["embed"]["embedding"]
        assert "fsdp" in str(table.sharding.spec), table.sharding
        assert {{s.data.shape for s in table.addressable_shards}} == {{(257, 16)}}
        loaded = Pretrained.load("{tmp_path}/hf")
        for a, b in zip(jax.tree.leaves(loaded.variables), jax.tree.leaves(state.params),
                        strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        print("sharded", table.sharding.spec)
    """, devices=2)
    assert "sharded" in out


def test_a_pretrained_start_with_another_rope_theta_is_refused(tmp_path):
    from dew.pretrained import ConfigurationMismatchError
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts, initial_variables

    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    recipe = RunConfig.load("tiny-lm", overrides=[
        "model.emb_features=32", "model.num_layers=1", "model.num_kv_heads=2",
        "model.mlp_features=64", f"init.pretrained={tmp_path}/hf", "data.files={stdlib}/abc.py"])
    objective = build_parts(recipe, with_data=False).objective
    with pytest.raises(ConfigurationMismatchError,
                       match=r"rope_base=500000.0 \(rope_theta in its config.json\).*"
                             r"has 10000.0. Set model.rope_base=500000.0"):
        initial_variables(recipe, objective)
