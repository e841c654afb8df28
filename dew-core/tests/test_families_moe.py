"""The mixture-of-experts families (Mixtral, Qwen 3 MoE, DeepSeek-V3) against transformers' own.

As for the dense families (test_families): transformers builds each family's tiny
preset with every weight redrawn (norm scales in [0.5, 1.5), DeepSeek's score-correction
bias included), saves it, and dew must read it and compute the same logits (fp32, within
1e-4; routing included, so a wrong choice of expert would show); dew's export must load
in transformers as that family with the same logits, and transformers' own save of it
must come back to dew bitwise. The presets exercise what the published checkpoints use:
a sliding window (Mixtral's tiny), a dense layer between routed ones and unnormalized
gates (Qwen's mlp_only_layers, norm_topk_prob false), and DeepSeek's compressed queries,
interleaved rotary features, YaRN with its mscale, sigmoid group-limited routing, the
correction bias, shared experts and a first dense layer.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.families import family
from dew.pretrained import NoExactCounterpartError, Pretrained, TensorMismatchError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from against_transformers import (  # noqa: E402
    PROMPTS,
    check_exports_back,
    check_tokenizer_reads,
    check_tokenizer_written,
    flat,
    hf_logits,
    hf_model,
)
from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)

NAMES = ["mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe"]




@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dew_computes_what_transformers_computes_and_exports_it_back(tmp_path, name):
    source = write_checkpoint(name, tmp_path / "source", seed=NAMES.index(name), redrawn=True)
    theirs = hf_logits(hf_model(source))
    loaded = Pretrained.load(source)
    assert loaded.format == name and loaded.model.mlp_block == "routed"
    mine = np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(PROMPTS, jnp.int32)))
    assert mine.shape == theirs.shape == (3, 19, 512)
    assert np.abs(mine - theirs).max() <= 1e-4, np.abs(mine - theirs).max()

    check_exports_back(loaded, theirs, name, tmp_path)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")  # torch, building them
@pytest.mark.parametrize("name, none", [("deepseek_v3", {"n_shared_experts": 0}),
                                        ("qwen2_moe", {"shared_expert_intermediate_size": 0})])
def test_a_checkpoint_without_shared_experts_computes_what_transformers_computes(tmp_path, name, none):
    """transformers stores the shared experts of a config that has none, with no elements (Qwen 2 MoE
    also their gate, which scales zero): dew refused them as tensors of another architecture."""
    source = write_checkpoint(name, tmp_path / "source", redrawn=True, overrides=none)
    theirs = hf_logits(hf_model(source))
    loaded = Pretrained.load(source)
    assert loaded.model.routing.shared_features == 0
    mine = np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(PROMPTS, jnp.int32)))
    assert np.abs(mine - theirs).max() <= 1e-4, np.abs(mine - theirs).max()


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_writes_a_config_transformers_reads_as_that_size(name):
    fam = family(name)
    config_class = getattr(transformers, fam.architecture).config_class
    for preset in fam.presets:
        model = fam.build(preset)
        config = fam.config(model)
        theirs = config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        assert theirs.num_hidden_layers == model.num_layers and theirs.vocab_size == model.vocab_size
        experts = getattr(theirs, "num_local_experts", getattr(theirs, "num_experts", None))  # Qwen2-MoE: no alias
        assert experts == model.experts, preset
        assert theirs.num_experts_per_tok == model.experts_per_token


def test_moe_families_build_by_name_with_their_routing():
    from dew import models

    deepseek = models.build("deepseek_v3", preset="671b", num_layers=4, max_seq_len=128)
    assert (deepseek.attention_block, deepseek.latent.kv_lora_rank, deepseek.latent.q_lora_rank) == ("latent", 512, 1536)
    assert deepseek.dense_layers == (0, 1, 2) and deepseek.experts == 256
    routing = deepseek.routing
    assert (routing.scoring, routing.groups, routing.groups_per_token, routing.routed_scale) == ("sigmoid", 8, 4, 2.5)
    assert routing.score_correction and routing.shared_features == 2048
    assert deepseek.rope_scaling.kind == "yarn" and deepseek.rope_scaling.mscale_all_dim == 1.0
    qwen = models.build("qwen3_moe", preset="30b-a3b", num_layers=2)
    assert (qwen.experts, qwen.experts_per_token, qwen.routing.hidden_features, qwen.qk_norm) == (128, 8, 768, "head")
    mixtral = models.build("mixtral", preset="8x7b", num_layers=2)
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.mlp_features) == (8, 2, 14336)


def test_a_capacity_on_a_dropless_family_is_refused_when_built():
    """model.expert_capacity=0.25 on qwen3_moe passed and trained bitwise as without it: the
    published MoE families route every token (no capacity). An optimizer's default leaves
    DeepSeek's routing bias undecayed: weight decay shrank it, and with it the experts chosen."""
    from dew import models
    from dew.training.optim import DEFAULT_NO_DECAY, build_optimizer

    for name in ("qwen3_moe", "mixtral", "deepseek_v3"):
        with pytest.raises(ValueError, match=r"expert_capacity=0.25 sizes capacity routing, and this model routes dropless"):
            models.build(name, preset="tiny", expert_capacity=0.25)
    assert models.build("mixtral", preset="tiny").expert_capacity == 1.25  # the default is no choice
    assert "*score_correction" in DEFAULT_NO_DECAY
    model = models.build("deepseek_v3", preset="tiny")
    import flax.linen as nn

    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    params = jax.tree.map(lambda leaf: jnp.full(leaf.shape, 0.5, leaf.dtype), params)
    from dew.training.optim import OptimizerConfig

    optimizer = build_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5))
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params), params)
    moved = {jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]
             if float(jnp.abs(leaf).max()) > 0}
    biases = [p for p in moved if "score_correction" in p]
    assert not biases and moved  # decay moved the kernels, never the routing bias


def test_routing_a_family_cannot_express_is_refused_by_name(tmp_path):
    model = family("mixtral").build("tiny")
    sigmoid = model.clone(routing=model.routing.__class__(scoring="sigmoid"))
    variables = jax.eval_shape(sigmoid.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(NoExactCounterpartError, match=r"CausalTransformer\.routing=.*sigmoid.*MixtralForCausalLM"):
        Pretrained(sigmoid, variables).save(tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, settings", [
    ("mixtral", {"router_aux_loss_coef": 0.001, "output_router_logits": True, "router_jitter_noise": 0.1}),
    ("qwen3_moe", {"router_aux_loss_coef": 0.01, "output_router_logits": True, "initializer_range": 0.01}),
])
def test_a_checkpoints_training_settings_survive_dews_layout_and_its_export(tmp_path, name, settings):
    """How transformers trains the weights further (the router's balance-loss weight, whether it returns
    router logits) was overwritten on save by the family's defaults (Mixtral's 0.001 came back 0.02)."""
    source = write_checkpoint(name, tmp_path / "source", overrides=settings)
    Pretrained.load(source).save(tmp_path / "native", format="dew")  # through dew's own layout too
    Pretrained.load(tmp_path / "native").save(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {key: written[key] for key in settings} == settings
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert all(getattr(config, key) == value for key, value in settings.items())


@pytest.mark.slow
def test_a_qwen3_moe_sliding_window_covers_every_layer_as_in_transformers(tmp_path):
    """transformers' Qwen 3 MoE windows every layer when use_sliding_window is set (it has no
    max_window_layers, unlike dense Qwen); a model windowing some layers only cannot be written."""
    source = write_checkpoint("qwen3_moe", tmp_path / "source", seed=5, redrawn=True, overrides={
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    theirs = hf_logits(hf_model(source))  # the prompts' 19 positions reach past the window of 8
    loaded = Pretrained.load(source)
    assert [window for window, _, _ in loaded.model._layer_parts()] == [8, 8, 8]
    mine = np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(PROMPTS, jnp.int32)))
    assert np.abs(mine - theirs).max() <= 1e-4, np.abs(mine - theirs).max()

    some = family("qwen3_moe").build("tiny", sliding_window=8, sliding_layers=(1, 2))
    variables = jax.eval_shape(some.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(NoExactCounterpartError, match=r"sliding.*Qwen3MoeForCausalLM"):
        Pretrained(some, variables).save(tmp_path / "partial")


@pytest.mark.slow
def test_on_eight_devices_with_an_expert_axis_every_moe_family_computes_what_transformers_does(tmp_path):
    """fsdp 2 x tensor 2 x expert 2, every weight sharded (the experts' stacks over the expert
    axis): each family's logits are still transformers' own."""
    from dew.testing.processes import run_python

    directories = {}
    for name in NAMES:
        directories[name] = str(write_checkpoint(name, tmp_path / name, seed=NAMES.index(name), redrawn=True))
        np.save(tmp_path / f"{name}.npy", hf_logits(hf_model(directories[name])))
    done = run_python(f"""
        import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        from dew.pretrained import Pretrained
        from dew.training import Layout, MeshSpec, build_mesh
        mesh = build_mesh(MeshSpec(fsdp=2, tensor=2, expert=2))
        layout = Layout(min_shard=0)  # shard even the tiny weights
        ids = jnp.asarray({PROMPTS.tolist()!r}, jnp.int32)
        for name, directory in {directories!r}.items():
            model = Pretrained.load(directory).model
            abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
            loaded = Pretrained.load(directory, shardings=layout.shardings(mesh, abstract))
            stacks = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(loaded.variables)[0]
                      if jax.tree_util.keystr(path).endswith("['moe']['wi']")]
            assert stacks and all(leaf.sharding.spec[0] == "expert" for leaf in stacks), [
                leaf.sharding.spec for leaf in stacks]
            with jax.set_mesh(mesh), nn.logical_axis_rules(layout.axis_rules):
                logits = jax.jit(model.apply)(loaded.variables, ids)
            reference = np.load({str(tmp_path)!r} + f"/{{name}}.npy")
            print(name, float(np.abs(np.asarray(logits) - reference).max()))
    """, devices=8, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    differences = dict(line.split() for line in done.stdout.strip().splitlines())
    assert set(differences) == set(NAMES)
    for name, difference in differences.items():
        assert float(difference) <= 1e-4, (name, difference)


def _add_tensors(directory, tensors: dict[str, np.ndarray], shard: str) -> None:
    """Write tensors beside a checkpoint's own, in a shard its index names (as a published one is)."""
    from safetensors.numpy import save_file

    save_file(tensors, str(directory / shard))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
    else:  # the single file becomes the first shard: a folder with model.safetensors is read from it alone
        from safetensors import safe_open

        (directory / "model.safetensors").rename(directory / "model-base.safetensors")
        with safe_open(str(directory / "model-base.safetensors"), framework="numpy") as opened:
            data = {"metadata": {}, "weight_map": dict.fromkeys(opened.keys(), "model-base.safetensors")}
    data["weight_map"].update(dict.fromkeys(tensors, shard))
    index.write_text(json.dumps(data))


def test_a_deepseek_checkpoint_keeps_its_multi_token_prediction_layer_unread(tmp_path):
    """Published DeepSeek-V3 directories hold num_nextn_predict_layers layers after the last; the
    model computes none of them (nor does transformers), so they are left unread, and only they."""
    source = write_checkpoint("deepseek_v3", tmp_path / "source", seed=2, redrawn=True)
    plain = Pretrained.load(source)
    config = json.loads((source / "config.json").read_text())
    after = config["num_hidden_layers"]
    _add_tensors(source, {f"model.layers.{after}.eh_proj.weight": np.ones((64, 128), np.float32),
                          f"model.layers.{after}.enorm.weight": np.ones((64,), np.float32)}, "mtp.safetensors")
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(TensorMismatchError, match=f"model.layers.{after}.eh_proj.weight"):
        Pretrained.load(source)  # the config says the checkpoint holds no such layer
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))  # as saved
    loaded = Pretrained.load(source)
    original, again = flat(plain.variables), flat(loaded.variables)
    assert original.keys() == again.keys() and all(np.array_equal(again[k], v) for k, v in original.items())
    _add_tensors(source, {f"model.layers.{after + 1}.enorm.weight": np.ones((64,), np.float32)}, "more.safetensors")
    with pytest.raises(TensorMismatchError, match=f"model.layers.{after + 1}.enorm.weight"):
        Pretrained.load(source)  # one prediction layer declared: a second is no part of it




@pytest.mark.parametrize("name", NAMES)
def test_the_tokenizer_encodes_as_autotokenizer_does_and_keeps_its_chat_template(tmp_path, name):
    # DeepSeek's full-width specials are no dense family's: its tokenizer is checked here.
    directory = write_checkpoint(name, tmp_path / "source", seed=NAMES.index(name))
    loaded, theirs = check_tokenizer_reads(directory)
    loaded.save(tmp_path / "dew")
    check_tokenizer_written(tmp_path / "dew", theirs)  # with the specials the tokenizer adds itself (DeepSeek's and Mistral's bos)
