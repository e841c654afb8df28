"""LoRA on a scanned layer stack: the numbered model's targets, stacked adapters, the same training,
and the merged and PEFT exports that transformers and peft read."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.adapters.lora import (
    Lora,
    LoraError,
    adapters_only,
    apply_lora,
    base_digest,
    is_adapter,
    merge_lora,
    with_base,
)
from dew.adapters.lora_stack import unstack_tree
from dew.nn.backbones import CausalTransformer
from dew.nn.pipeline import PipelineSchedule, pipeline, stack_layers, unstack_layers
from dew.objectives.lm import LMObjective
from test_lora_base import windows  # the same tiny token stream (SEQ is 8 in both files)

pytest.importorskip("qwix")

SEQ = 8
LAYERS = 2
FIELDS = dict(vocab_size=32, emb_features=16, num_layers=LAYERS, num_heads=2, num_kv_heads=1,
              mlp_features=32, max_seq_len=16, position_embedding="rotary", mlp_activation="swiglu")
SPEC = Lora(rank=2, alpha=4.0, targets=("attention", "mlp"))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, SEQ)), jnp.int32)


def numbered(variables):
    return {"params": unstack_layers(variables["params"], LAYERS)}


def trained_adapters(variables, seed=7):
    """variables with every adapter's B drawn away from zero, as training leaves it."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: 0.3 * jax.random.normal(next(keys), leaf.shape)
        if str(getattr(path[-1], "key", "")).endswith("_lora_b") else leaf, variables)


@pytest.fixture(scope="module")
def adapted():
    """The scanned and the numbered model adapted by SPEC, and the scanned one's variables."""
    scanned = apply_lora(CausalTransformer(**FIELDS, scan_layers=True), SPEC)
    flat = apply_lora(CausalTransformer(**FIELDS), SPEC)
    base = nn.meta.unbox(CausalTransformer(**FIELDS).init(jax.random.key(1), TOKENS))
    variables = with_base(nn.meta.unbox(scanned.init(jax.random.key(0), TOKENS)), base)
    return scanned, flat, base, trained_adapters(variables)


@pytest.mark.slow
def test_the_numbered_targets_put_stacked_adapters_on_every_layer(adapted):
    scanned, flat, _, variables = adapted
    boxed = scanned.init(jax.random.key(0), TOKENS)
    stack = boxed["params"]["layers"]
    names = {f"{module}/{name}" for module in ("attention", "mlp") for name in stack[module]
             if name.endswith(("_lora_a", "_lora_b"))}
    assert names == {f"{module}/{weight}_lora_{ab}" for module, weights in
                     (("attention", ("query", "key", "value", "out")), ("mlp", ("wi", "wi_gate", "wo")))
                     for weight in weights for ab in "ab"}
    specs = nn.get_partition_spec(boxed)["params"]["layers"]
    assert specs["attention"]["query_lora_a"][0] == "layers"  # the stage axis splits them with the layers
    assert specs["mlp"]["wo_lora_b"][0] == "layers"
    # The same tree as the numbered model's, once unstacked.
    fresh = nn.meta.unbox(flat.init(jax.random.key(0), TOKENS))
    assert jax.tree.map(jnp.shape, numbered(variables)) == jax.tree.map(jnp.shape, fresh)


@pytest.mark.slow
def test_the_stack_computes_the_numbered_adapted_model(adapted):
    scanned, flat, base, variables = adapted
    ours = scanned.apply(variables, TOKENS)
    theirs = flat.apply(numbered(variables), TOKENS)
    assert float(jnp.abs(ours - CausalTransformer(**FIELDS).apply(base, TOKENS)).max()) > 1e-2  # adapted
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5, rtol=0)
    with pipeline(PipelineSchedule(stages=2, microbatches=4)):
        piped = scanned.apply(variables, TOKENS)
    np.testing.assert_allclose(np.asarray(piped), np.asarray(ours), atol=1e-5, rtol=0)
    merged = merge_lora(variables, SPEC)
    assert not [key for key in jax.tree_util.tree_flatten_with_path(merged)[0] if "lora" in str(key[0])]
    np.testing.assert_allclose(
        np.asarray(CausalTransformer(**FIELDS, scan_layers=True).apply(merged, TOKENS)),
        np.asarray(ours), atol=1e-5, rtol=0)
    assert base_digest(variables) == base_digest(numbered(variables))  # one base, either layout


@pytest.mark.slow
def test_training_the_stack_is_training_the_numbered_layers(adapted):
    scanned, flat, _, variables = adapted

    def fit(model, start):
        trainer = Trainer(adapters_only(LMObjective(model=model, seq_len=SEQ)), optax.adam(1e-2),
                          key=jax.random.key(0), initializer=start)
        return jax.device_get(nn.meta.unbox(trainer.fit(windows(), steps=3, log_every=3).params))

    ours, theirs = fit(scanned, variables), fit(flat, numbered(variables))
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
             zip(jax.tree.leaves(ours), jax.tree.leaves(variables), strict=True)]
    assert max(moved) > 1e-3  # the adapters trained: the comparison can fail
    got = jax.tree.leaves(numbered(ours))
    for a, b in zip(got, jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)


@pytest.mark.slow
def test_adapter_gradients_are_the_same_under_pipeline_stages(adapted):
    scanned, _, _, variables = adapted

    def loss(v):
        logits = scanned.apply(v, TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    def adapter_grads():
        grads = jax.grad(loss)(variables)
        return [g for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                if is_adapter(tuple(str(getattr(k, "key", k)) for k in path), None)]

    plain = adapter_grads()
    with pipeline(PipelineSchedule(stages=2, microbatches=2)):
        piped = adapter_grads()
    assert plain and max(float(jnp.abs(g).max()) for g in plain) > 0
    for a, b in zip(piped, plain, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_a_target_picking_some_layers_of_the_stack_is_refused_naming_them():
    model = CausalTransformer(**FIELDS, scan_layers=True)
    with pytest.raises(LoraError, match=r"picks layers/attention in layers \[1\] of 2.*scan_layers=False"):
        apply_lora(model, Lora(rank=2, targets=(r"layers_1/attention",)))
    with pytest.raises(LoraError, match=r"'.\*feedforward'.*matches no module.*which are: .*layers_\\d\+/attention, "):
        apply_lora(model, Lora(rank=2, targets=(r".*feedforward",)))
    with pytest.raises(LoraError, match=r"rank 17 .* layer layers/mlp/wi .*at most 16"):
        apply_lora(model, Lora(rank=17, targets=("mlp",))).init(jax.random.key(0), TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_qlora_quantizes_each_layer_of_the_stack_as_the_numbered_model_does(adapted, base):
    _, _, weights, _ = adapted
    spec = Lora(rank=2, alpha=4.0, targets=("attention", "mlp"), base=base)
    scanned = apply_lora(CausalTransformer(**FIELDS, scan_layers=True), spec)
    flat = apply_lora(CausalTransformer(**FIELDS), spec)
    ours = trained_adapters(with_base(scanned.init(jax.random.key(0), TOKENS), weights))
    own = with_base(flat.init(jax.random.key(0), TOKENS), weights)  # the numbered model's own codes
    query = ours["params"]["layers"]["attention"]["query"]
    # One scale per layer and output channel, as each numbered layer holds its own.
    assert query.array.scale.shape == (LAYERS, 1, 2, 8)
    for i in range(LAYERS):
        single = own["params"][f"layers_{i}"]["attention"]["query"].array
        np.testing.assert_array_equal(np.asarray(query.array.qvalue[i]), np.asarray(single.qvalue))
        np.testing.assert_array_equal(np.asarray(query.array.scale[i]), np.asarray(single.scale))
    theirs = {"params": unstack_tree(ours["params"])}  # the same codes and adapters, numbered
    logits = scanned.apply(ours, TOKENS)
    # The stack and the numbered layers sum in other orders: float32's rounding, relative to the logit.
    np.testing.assert_allclose(np.asarray(logits), np.asarray(flat.apply(theirs, TOKENS)), atol=1e-5, rtol=1e-5)
    merged = merge_lora(ours, spec)  # float weights: the codes' values plus each layer's product
    np.testing.assert_allclose(
        np.asarray(CausalTransformer(**FIELDS, scan_layers=True).apply(merged, TOKENS)),
        np.asarray(logits), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_merged_and_peft_exports_of_the_stack_load_in_transformers_and_peft(adapted, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    from dew.pretrained import Pretrained
    from dew.pretrained.peft import load_adapters, save_adapters

    scanned, _, base, variables = adapted
    model = CausalTransformer(**FIELDS, scan_layers=True)
    ours = np.asarray(scanned.apply(variables, TOKENS))

    def logits(hf):
        with torch.no_grad():
            return hf(torch.tensor(np.array(TOKENS), dtype=torch.long)).logits.numpy()

    Pretrained(model, merge_lora(variables, SPEC)).save(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(logits(merged.eval()), ours, atol=1e-4, rtol=0)

    Pretrained(CausalTransformer(**FIELDS), base).save(tmp_path / "base")
    save_adapters(tmp_path / "adapters", model, variables, SPEC)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    np.testing.assert_allclose(logits(PeftModel.from_pretrained(hf_base, tmp_path / "adapters").eval()),
                               ours, atol=1e-4, rtol=0)

    # Read back onto the stack (its base stacked from the numbered directory): the same adapters.
    loaded_base = Pretrained.load(tmp_path / "base", scan_layers=True)
    assert loaded_base.model == model
    fresh = with_base(scanned.init(jax.random.key(9), TOKENS), loaded_base.variables)
    back = load_adapters(tmp_path / "adapters", model, fresh)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert stack_layers(numbered(back)["params"], LAYERS).keys() == back["params"].keys()


@pytest.mark.slow
def test_a_scanned_lora_recipe_starts_from_a_numbered_export_and_exports_again(tmp_path, dew_command):
    """`dew train` with model.scan_layers=true: init.pretrained is stacked into the stack, the
    adapters train on it, and `dew export` writes a merged Llama transformers computes alike (the
    commands through ``dew.cli.main`` in this process, the function the console script calls)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dew import models
    from dew.pretrained import Pretrained
    from dew.recipes.opening import open_run

    base = models.build("causal_transformer", vocab_size=257, emb_features=32, num_layers=2, num_heads=4,
                        mlp_features=64, max_seq_len=128, position_embedding="rotary", mlp_activation="swiglu")
    Pretrained(base, base.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "exported")
    run = tmp_path / "run"

    def call(*args):
        done = dew_command(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]

    call("train", "tiny-lm-qlora", "model.emb_features=32", "model.num_layers=2", "model.mlp_features=64",
         "model.scan_layers=true", "lora.rank=4", "lora.base=float32", "data.files={stdlib}/abc.py",
         "data.load.val_fraction=0", "trainer.eval_every=null", "trainer.steps=4", "trainer.log_every=2", "objective.prompt=null", "optimizer.learning_rate=5.0e-2",
         "optimizer.warmup_steps=0", f"init.pretrained={tmp_path}/exported", f"trainer.checkpoint_dir={run}",
         f"trackers.0.directory={run}")
    opened = open_run(run)
    assert "layers" in opened.variables["params"]  # trained as a stack
    exported = Pretrained.load(tmp_path / "exported", scan_layers=True).variables["params"]["layers"]
    for module, weight in (("attention", "query"), ("mlp", "wo")):  # the frozen base: the export's, stacked
        np.testing.assert_array_equal(np.asarray(nn.meta.unbox(opened.variables["params"]["layers"][module][weight])),
                                      np.asarray(exported[module][weight]))
    tokens = np.random.default_rng(0).integers(0, 257, (2, 12)).astype(np.int32)
    ours = np.asarray(opened.model.apply(opened.variables, jnp.asarray(tokens)))
    call("export", str(run), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        before = hf_base(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(before - ours).max() > 1e-3  # the adapters trained on the numbered export's weights
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


STAGED = """
import json
import jax, numpy as np, optax
import jax.numpy as jnp
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training.placement.layout import Layout
from dew.adapters.lora import Lora, adapters_only, apply_lora
from dew.training.placement.mesh import MeshSpec

class Losses:
    def __init__(self): self.values = []
    def log(self, scalars, step): self.values.append(float(scalars["train/loss"]))
    def artifact(self, value, step): pass
    def close(self): pass

def batches():
    index = 0
    while True:
        yield {{"text": np.random.default_rng(index).integers(0, 64, (8, 9)).astype(np.int32)}}
        index += 1

model = CausalTransformer(vocab_size=64, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
                          max_seq_len=8, position_embedding="rotary", mlp_activation="swiglu", scan_layers=True)
base = model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))
losses = Losses()
wrapped = apply_lora(model, Lora(rank=2, alpha=4.0, targets=("attention", "mlp")))
trainer = Trainer(adapters_only(LMObjective(model=wrapped, seq_len=8)), optax.adam(1e-2), key=jax.random.key(0),
                  mesh=MeshSpec(**{mesh!r}), layout=Layout(min_shard=0, tolerance=1.0), tracker=losses,
                  initializer=base)
state = trainer.fit(Dataset(train=lambda partition: batches(), batch=8), steps=4, log_every=1)
adapter = state.params["params"]["layers"]["attention"]["query_lora_a"]
print("RESULT" + json.dumps({{"losses": losses.values, "spec": [str(a) for a in adapter.sharding.spec],
                             "sites": list(trainer.bank_sites),
                             "moved": float(jnp.abs(state.params["params"]["layers"]["mlp"]["wo_lora_b"]).max())}}))
"""


@pytest.mark.slow
def test_stage_split_adapters_train_as_on_one_device(python_in_subprocess):
    """stage=2 splits the stacked adapters with the layers and trains to the single-device losses."""
    import json

    def run(mesh, devices):
        flags = (f"--xla_force_host_platform_device_count={devices} "
                 "--xla_cpu_collective_call_terminate_timeout_seconds=600")  # load, not a hang
        out = python_in_subprocess(STAGED.format(mesh=mesh), devices=devices, env={"XLA_FLAGS": flags},
                                   timeout=900)
        return json.loads(out.split("RESULT", 1)[1])

    single = run({}, 1)
    staged = run({"stage": 2, "microbatches": 4}, 8)
    assert staged["spec"][0] == "stage"  # the adapters' layers axis is split with the layers
    assert staged["sites"] == ["params/layers"]
    assert len(single["losses"]) == 4 and single["moved"] > 1e-3  # B left zero: the adapters trained
    np.testing.assert_allclose(staged["losses"], single["losses"], atol=1e-5, rtol=0)
