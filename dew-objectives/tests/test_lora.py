"""LoRA through qwix: adapters start at zero, train alone, and resume bitwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dew import Checkpoints, Trainer, models
from dew.adapters.lora import Lora, LoraError, adapters_only, apply_lora, is_adapter, merge_lora
from dew.data import Dataset
from dew.objectives.lm import LMObjective
from dew.training import trees

pytest.importorskip("qwix")

SEQ = 8


def tiny():
    return models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1,
                        num_heads=2, mlp_features=32, max_seq_len=16)


def windows(rows=4):
    def make(index):
        return {"text": np.random.default_rng(index).integers(0, 32, (rows, SEQ + 1)).astype(np.int32)}

    class Counting:
        def __init__(self):
            self.index = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.index += 1
            return make(self.index - 1)

        def get_state(self):
            return str(self.index).encode()

        def set_state(self, state):
            self.index = int(state)

    return Dataset(train=lambda partition: Counting(), batch=rows)


@pytest.fixture(scope="module")
def lora_model():
    model = tiny()
    wrapped = apply_lora(model, Lora(rank=2, alpha=4.0, targets=("attention", "mlp")))
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    return model, wrapped, jax.jit(wrapped.init)(jax.random.key(0), tokens)


def test_adapters_sit_beside_each_targeted_weight_and_start_as_the_base_model(lora_model):
    model, wrapped, variables = lora_model
    adapters = [p for p in trees.paths(variables) if is_adapter(tuple(p.split("/")), None)]
    assert sorted(adapters) == sorted(f"params/layers_0/{module}/{name}_lora_{ab}"
                                      for module, names in (("attention", ("query", "key", "value", "out")),
                                                            ("mlp", ("wi", "wo")))
                                      for name in names for ab in "ab")
    base = trees.select(variables, lambda path, leaf: not is_adapter(path, leaf))
    tokens = jax.random.randint(jax.random.key(3), (2, SEQ), 0, 32)
    np.testing.assert_array_equal(np.asarray(jax.jit(wrapped.apply)(variables, tokens)),
                                  np.asarray(jax.jit(model.apply)(base, tokens)))


@pytest.mark.parametrize("name, fields, targets, inputs", [
    ("causal_transformer", dict(vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
                                max_seq_len=16), ("attention", "mlp"), lambda: (jnp.zeros((1, SEQ), jnp.int32),)),
    ("token_denoiser", dict(vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
                            max_seq_len=16), (r"attention_\d+",), lambda: (jnp.zeros((1, SEQ), jnp.int32),)),
    ("dit", dict(image_size=8, channels=1, patch_size=2, emb_features=16, num_layers=2, num_heads=2,
                 mlp_features=32, num_classes=10), (r"blocks_\d+/attention",),
     lambda: (jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))),
])
def test_a_fresh_adapted_model_draws_its_base_weights_as_the_model_without_adapters(name, fields, targets, inputs):
    """qwix drew each adapter's A from its module's next key, so the weights the module made after it
    (the attention's out, a layer's value) started elsewhere than in the same run without LoRA."""
    model = models.build(name, **fields)
    wrapped = apply_lora(model, Lora(rank=2, alpha=4.0, targets=targets))
    adapted = wrapped.init(jax.random.key(0), *inputs())
    base = trees.select(nn.meta.unbox(adapted), lambda path, leaf: not is_adapter(path, leaf))
    plain = nn.meta.unbox(model.init(jax.random.key(0), *inputs()))
    flat = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(base)}
    assert flat.keys() == {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(plain)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(plain):
        np.testing.assert_array_equal(flat[jax.tree_util.keystr(path)], leaf, err_msg=jax.tree_util.keystr(path))


def test_only_the_adapters_train_and_hold_optimizer_state(lora_model):
    _, wrapped, variables = lora_model
    objective = adapters_only(LMObjective(model=wrapped, seq_len=SEQ))
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), initializer=variables)
    state = trainer.fit(windows(), steps=3, log_every=3)
    final = jax.device_get(state.params)
    start = jax.device_get(variables)
    changed = []
    for path in trees.paths(start):
        keys = path.split("/")
        before, after = start, final
        for key in keys:
            before, after = before[key], after[key]
        before = before.unbox() if hasattr(before, "unbox") else before
        after = after.unbox() if hasattr(after, "unbox") else after
        if not np.array_equal(np.asarray(before), np.asarray(after)):
            changed.append(path)
    assert changed and all(is_adapter(tuple(p.split("/")), None) for p in changed)
    assert any(p.endswith("_lora_b") for p in changed)  # B leaves zero, so the adapters learn
    adapter_elements = sum(np.size(x) for x in jax.tree.leaves(
        trees.select(start, lambda path, leaf: is_adapter(path, leaf))))
    moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x)]
    assert sum(np.size(x) for x in moments) == 2 * adapter_elements  # Adam's two moments, adapters only


def test_a_lora_run_resumes_bitwise(lora_model, tmp_path):
    _, wrapped, variables = lora_model

    def trainer(checkpoints=None):
        return Trainer(adapters_only(LMObjective(model=wrapped, seq_len=SEQ)), optax.adam(1e-2),
                       key=jax.random.key(0), initializer=variables, checkpoints=checkpoints)

    expected = jax.device_get(trainer().fit(windows(), steps=4, log_every=4).params)
    trainer(Checkpoints(tmp_path)).fit(windows(), steps=2, log_every=2)
    resumed = jax.device_get(trainer(Checkpoints(tmp_path)).fit(windows(), steps=4, log_every=4).params)
    jax.tree.map(np.testing.assert_array_equal, resumed, expected)


def test_the_embedding_of_a_tied_model_is_refused_though_its_head_multiplies_by_it():
    """Tied, the embedding is also the head, which qwix adapts: the run trained an adapter that no
    export could merge into the table or hand to PEFT ('Export the merged model instead', which failed)."""
    from dew.nn.backbones import CausalTransformer

    tied = CausalTransformer(vocab_size=64, emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                             max_seq_len=SEQ, position_embedding="rotary", tie_embeddings=True)
    wrapped = apply_lora(tied, Lora(rank=2, targets=(r"embed",)))
    with pytest.raises(LoraError, match=r"match embed/embedding, where no adapter can sit"):
        wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def test_a_target_that_matches_no_module_is_refused_naming_it():
    wrapped = apply_lora(tiny(), Lora(rank=2, targets=("attention", r".*feedforward")))
    with pytest.raises(LoraError, match=r"'\.\*feedforward'.*matches no module.*which are: .*layers_\\d\+/attention, "):
        wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))



def test_a_target_that_matches_no_module_lists_the_repeated_blocks_as_patterns():
    # A video DiT's blocks are space_k and time_k: the first six names alphabetically were final,
    # final_modulation, label, noise/fc1, noise/fc2, patch, and none a target could adapt.
    video = models.build("video_dit", frames=2, image_size=8, channels=1, patch_size=4, emb_features=16,
                         num_layers=2, num_heads=2, mlp_features=32, num_classes=3)
    with pytest.raises(LoraError, match=r"'attention'.*matches no module") as refused:
        apply_lora(video, Lora(rank=2, targets=("attention",))).init(
            jax.random.key(0), jnp.zeros((1, 2, 8, 8, 1)), jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))
    listed = str(refused.value).rsplit("which are: ", 1)[1].rstrip(".").split(", ")
    assert {r"space_\d+/attention", r"time_\d+/attention", r"noise/fc\d+"} <= set(listed), listed
    assert "space_0/attention" not in listed and "space_1/attention" not in listed

@pytest.mark.parametrize("targets, named", [
    ((r".*embed",), "embed/embedding"),  # a lookup, not a matmul: qwix placed no adapter, and nothing trained
    (("attention", r".*embed"), "embed/embedding"),  # mixed in, the embedding was dropped without a word
    ((r".*",), "embed/embedding, position"),  # lookups both; ".*" reaching the head was a traceback before
])
def test_a_target_matching_weights_no_adapter_can_sit_on_is_refused_in_one_line(targets, named):
    wrapped = apply_lora(tiny(), Lora(rank=2, targets=targets))
    with pytest.raises(LoraError, match=rf"match {named}.*where no adapter can sit.* Name the projections") as refused:
        wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    assert "\n" not in str(refused.value)
    # The head alone is no module's weight: it is named among the modules the model has.
    with pytest.raises(LoraError, match=r"'\.\*head'.*matches no module"):
        apply_lora(tiny(), Lora(rank=2, targets=(r".*head",))).init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def test_a_rank_wider_than_a_layer_is_refused_naming_the_layer():
    wrapped = apply_lora(tiny(), Lora(rank=17, targets=("mlp",)))
    with pytest.raises(LoraError, match=r"rank 17 .* layer layers_0/mlp/wi .*at most 16"):
        wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def test_an_unknown_base_dtype_is_refused_naming_the_choices():
    with pytest.raises(LoraError, match="'int4' is not a base dtype.*float32, int8, nf4"):
        Lora(base="int4")


def test_merged_weights_give_the_adapted_models_logits(lora_model):
    model, wrapped, variables = lora_model
    # Trained adapters: B no longer zero, so the merge has something to add.
    keys = iter(jax.random.split(jax.random.key(7), 64))

    def perturb(path, leaf):
        names = [str(getattr(p, "key", "")) for p in path]
        return 0.3 * jax.random.normal(next(keys), leaf.shape) if any(
            n.endswith("_lora_b") for n in names) else leaf

    trained = jax.tree_util.tree_map_with_path(perturb, jax.device_get(variables))
    merged = merge_lora(trained, Lora(rank=2, alpha=4.0))
    assert not [p for p in trees.paths(merged) if "lora" in p]
    tokens = jax.random.randint(jax.random.key(3), (2, SEQ), 0, 32)
    adapted = np.asarray(jax.jit(wrapped.apply)(trained, tokens))
    base_only = trees.select(trained, lambda path, leaf: not is_adapter(path, leaf))
    assert not np.allclose(np.asarray(jax.jit(model.apply)(base_only, tokens)), adapted, atol=1e-3)
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(merged, tokens)), adapted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recipe, overrides, head", [
    ("tiny-jepa", ["lora={rank: 2, targets: [mlp]}"], "predictor"),
    ("tiny-distill", ["lora={rank: 2}", "objective.hidden=1.0"], "projection"),
])
def test_an_objectives_own_part_trains_in_full_beside_the_adapters(recipe, overrides, head):
    """JEPA's predictor and distillation's hidden-state projection are parts the objective adds beside its
    model: under LoRA the predictor stayed frozen at its random draw (the encoder learned to serve it),
    and a distillation matching hidden states was refused for starting weights lacking the projection."""
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts

    objective = build_parts(RunConfig.load(recipe, overrides), with_data=False).objective
    fresh = jax.device_get(objective.init(jax.random.key(0)))
    given = {**fresh, "params": {k: v for k, v in fresh["params"].items() if k != head}}  # a start without it
    started = objective.init(jax.random.key(1), given)
    assert head in started["params"]  # drawn fresh where the start lacks it
    leaves = jax.tree_util.tree_leaves_with_path({"params": started["params"]})  # as the trainer names them
    trained = {jax.tree_util.keystr(path) for path, leaf in leaves
               if not objective.frozen(tuple(k.key for k in path), leaf)}
    ours = f"['params']['{head}']"
    assert trained and all(name.startswith(ours) or "_lora_" in name for name in trained), trained
    assert any(name.startswith(ours) for name in trained) and any("_lora_" in name for name in trained)
