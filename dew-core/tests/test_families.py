"""Every dense family against transformers' own model of it.

For each family, transformers builds its model at a tiny size (two or three
layers, so sliding-window patterns alternate; prompts longer than the
window), every weight redrawn (norm scales in [0.5, 1.5), biases around
zero), and saves it with save_pretrained. dew reads that directory and must
compute the same logits (fp32, within 1e-4); what dew writes must load in
transformers as the same family with the same logits, and come back bitwise;
the tokenizer must encode as AutoTokenizer does and keep its chat template.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.families import FAMILIES, family
from dew.pretrained import (
    NoExactCounterpartError,
    Pretrained,
    TensorMismatchError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
)

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

# The mixture-of-experts families have their own file (test_families_moe): these are the dense ones.
NAMES = [name for name in FAMILIES if name not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]
# Options the published checkpoints use (or allow), exercised here on top of each tiny preset:
# biases in Llama, every rope variant (llama3 in llama's preset, linear, YaRN, Gemma 3's
# scaled global layers), partial rotary (phi3's preset), sliding windows (mistral, qwen2,
# gemma2/3 and phi3 presets, window 8 < the prompts' 19 positions), and a query scale
# (query_pre_attn_scalar) other than the head width's 16, as Gemma 2 27B's 144 is beside its
# 128: at 16 a model that ignored it would compute the same logits.
OVERRIDES = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "mistral": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "qwen2": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}},
    "gemma2": {"query_pre_attn_scalar": 24},
    "gemma3": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24},
}



def _dew_logits(loaded, ids=PROMPTS) -> np.ndarray:
    return np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(ids, jnp.int32)))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each family's tiny checkpoint as transformers saved it, with transformers' logits."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for seed, name in enumerate(NAMES):
        directory = write_checkpoint(name, root / name, overrides=OVERRIDES.get(name), seed=seed,
                                     redrawn=True)
        out[name] = (directory, hf_logits(hf_model(directory)))
    return out


@pytest.fixture(scope="module")
def ours(written):
    """dew's logits of each family's checkpoint, computed once (each is a compile) and shared."""
    cache: dict[str, np.ndarray] = {}

    def logits(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = _dew_logits(Pretrained.load(written[name][0]))
        return cache[name]

    return logits



@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dew_computes_what_transformers_computes(written, ours, name):
    directory, theirs = written[name]
    loaded = Pretrained.load(directory)
    assert loaded.format == name and loaded.model.position_embedding == "rotary"
    assert ours(name).shape == theirs.shape == (3, 19, 512)
    assert np.abs(ours(name) - theirs).max() <= 1e-4, np.abs(ours(name) - theirs).max()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_an_export_loads_in_transformers_as_its_family_and_comes_back_bitwise(written, tmp_path, name):
    directory, theirs = written[name]
    check_exports_back(Pretrained.load(directory), theirs, name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_tokenizer_encodes_as_autotokenizer_does_and_keeps_its_chat_template(written, tmp_path, name):
    directory, _ = written[name]
    loaded, theirs = check_tokenizer_reads(directory)
    Pretrained(loaded.model, loaded.variables, loaded.tokenizer, tokenizer_files=loaded.tokenizer_files).save(
        tmp_path)
    check_tokenizer_written(tmp_path, theirs)  # with the specials the tokenizer adds itself (a bos in Llama's, Gemma's)
    config = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((directory / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config.get(key) == original.get(key), key


@pytest.mark.slow
def test_sharded_bf16_checkpoints_load_and_dew_writes_shards_transformers_reads(written, tmp_path):
    directory, theirs = written["qwen3"]
    fp32 = Pretrained.load(directory)
    hf = hf_model(directory).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16", max_shard_size="60KB")  # an index and several shards
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    bf16 = Pretrained.load(tmp_path / "bf16")
    assert bf16.model.param_dtype == jnp.bfloat16
    cast = flat(jax.tree.map(lambda a: a.astype(jnp.bfloat16), fp32.variables))
    for key, value in flat(bf16.variables).items():  # torch and ml_dtypes round alike
        assert value.dtype == jnp.bfloat16 and np.array_equal(value, cast[key]), key

    fp32.save(tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    assert np.abs(hf_logits(hf_model(tmp_path / "sharded")) - theirs).max() <= 1e-4
    again = Pretrained.load(tmp_path / "sharded")
    for key, value in flat(fp32.variables).items():
        assert np.array_equal(flat(again.variables)[key], value), key
    fp32.save(tmp_path / "sharded")  # saved again whole: the stale index and shards go
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*")) == ["model.safetensors"]


def _as_transformers_4(config: dict) -> dict:
    """config.json as transformers 4 wrote it: top-level rope keys and torch_dtype, no layer_types."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype", "layer_types")}
    old["torch_dtype"] = config["dtype"]
    params = dict(config["rope_parameters"])
    if "full_attention" in params:  # Gemma 3: global and local bases, the pattern as a period
        full, local = dict(params["full_attention"]), params["sliding_attention"]
        old["rope_theta"], old["rope_local_base_freq"] = full.pop("rope_theta"), local["rope_theta"]
        old["rope_scaling"] = None if full["rope_type"] == "default" else full
        old["sliding_window_pattern"] = 2
        return old
    old["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params:
        old["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    old["rope_scaling"] = None if params["rope_type"] == "default" else params
    return old


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_4_config_layout_reads_as_the_same_model(written, tmp_path, name):
    # The dense families from the shared fixture, the MoE families written here.
    directory = written[name][0] if name in written else write_checkpoint(name, tmp_path / "source")
    config = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in config and "dtype" in config  # transformers 5 wrote it
    old = _as_transformers_4(config)
    if name == "deepseek_v3":  # its published config.json names the rope type with the older "type" key
        old["rope_scaling"]["type"] = old["rope_scaling"].pop("rope_type")
    (tmp_path / "old").mkdir()
    for file in directory.iterdir():
        (tmp_path / "old" / file.name).write_bytes(file.read_bytes())
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert Pretrained.load(tmp_path / "old").model == Pretrained.load(directory).model


def _scores_at_every_position(loaded, ids) -> np.ndarray:
    """dew's reward-model score by hand: the score kernel over the final norm's output, at each position."""
    params = dict(loaded.variables["params"])
    kernel = params.pop("reward_head")["dense"]["kernel"]
    _, state = loaded.model.apply({"params": params}, jnp.asarray(ids, jnp.int32), capture_intermediates=True)
    return np.asarray(state["intermediates"]["final_norm"]["__call__"][0] @ kernel)[..., 0]


def _hf_scores(model, ids) -> np.ndarray:
    with torch.no_grad():
        hidden = getattr(model, model.base_model_prefix)(torch.tensor(ids)).last_hidden_state
        return model.score(hidden)[..., 0].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma", "phi3", "gemma3", "mixtral", "deepseek_v3"])
def test_a_reward_model_of_the_family_scores_as_transformers_and_exports_as_one(tmp_path, name):
    """transformers' one-label sequence-classification model of the family (a published reward
    model's layout), every weight redrawn: dew reads it as a reward model computing the same score at
    every position, writes it back as that class, and transformers' own save of that comes back bitwise."""
    from dew.families import scoring
    from dew.families.examples import redraw

    config = transformers.AutoConfig.from_pretrained(write_checkpoint(name, tmp_path / "lm"), num_labels=1)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    redraw(model, seed=5)
    assert type(model).__name__ == scoring.architecture(family(name).architecture)
    model.save_pretrained(tmp_path / "rm")
    theirs = _hf_scores(model, PROMPTS)
    loaded = Pretrained.load(tmp_path / "rm")
    assert loaded.task["name"] == "reward_model" and loaded.format == name
    assert np.abs(_scores_at_every_position(loaded, PROMPTS) - theirs).max() <= 1e-4
    loaded.save(tmp_path / "dew")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "dew").eval()
    assert type(back).__name__ == type(model).__name__ and back.config.num_labels == 1
    assert np.abs(_hf_scores(back, PROMPTS) - theirs).max() <= 1e-4
    back.save_pretrained(tmp_path / "hf")
    again = Pretrained.load(tmp_path / "hf")
    assert flat(again.variables).keys() == flat(loaded.variables).keys()
    assert all(np.array_equal(flat(again.variables)[k], v) for k, v in flat(loaded.variables).items())


def test_a_reward_model_exports_its_tokenizers_pad_id_so_transformers_scores_a_batch(tmp_path):
    """Llama 3's config names no pad id though its tokenizer has a pad token: the export left it out, and
    transformers refused to score a batch ("Cannot handle batch sizes > 1 if no padding token")."""
    from dew.families.examples import redraw, tokenizer

    config = transformers.AutoConfig.from_pretrained(write_checkpoint("llama", tmp_path / "lm"), num_labels=1)
    config.pad_token_id = None
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    redraw(model, 2)
    model.save_pretrained(tmp_path / "rm")
    tokenizer("llama").save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "config.json").read_text()).get("pad_token_id") is None
    Pretrained.load(tmp_path / "rm").save(tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == theirs.pad_token_id
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    texts = ["the plus is 12 plus 30", "hi"]
    with torch.no_grad():
        batched = back(**theirs(texts, padding=True, return_tensors="pt")).logits[:, 0].numpy()
        alone = [float(back(**theirs([text], return_tensors="pt")).logits[0, 0]) for text in texts]
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    # A score over another module's output is no score the layout holds: refused naming why.
    import dataclasses

    loaded = Pretrained.load(tmp_path / "rm")
    elsewhere = dataclasses.replace(loaded, task={"name": "reward_model",
                                                  "fields": {**loaded.task["fields"], "features_module": "layers_0"}})
    with pytest.raises(NoExactCounterpartError, match="this one reads 'layers_0': its features_module"):
        elsewhere.save(tmp_path / "elsewhere", format="hf")


def test_a_classifier_of_several_labels_is_refused_naming_them(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_labels=3)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(NoExactCounterpartError, match="LlamaForSequenceClassification with 3 labels, a classifier"):
        Pretrained.load(tmp_path)
    # A score with a bias (a custom head's) is named as that class's tensor, not a causal model's.
    from weights_directories import rewrite_tensors, tensors_of

    one = tmp_path / "one"
    transformers.LlamaForSequenceClassification(config.__class__(**{**config.to_dict(), "num_labels": 1})).save_pretrained(one)
    tensors = tensors_of(one / "model.safetensors")
    rewrite_tensors(one / "model.safetensors", {**tensors, "score.bias": np.zeros((1,), np.float32)})
    with pytest.raises(TensorMismatchError, match="LlamaForSequenceClassification has no place for: score.bias"):
        Pretrained.load(one)


def test_an_uncovered_architecture_names_itself_and_the_covered_ones(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError,
                       match="GPT2LMHeadModel; dew loads LlamaForCausalLM.*Qwen3ForCausalLM.*Olmo2ForCausalLM"):
        Pretrained.load(tmp_path)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_fills_a_missing_config_key_with_transformers_own_default(name):
    """A config.json may leave a key out; transformers then uses its config class's default, which
    differs between families (Phi-3's norm epsilon 1e-5 against Llama's 1e-6, Mistral's window
    4096, DeepSeek-V3's eight expert groups). Each default dew declares is that class's own."""
    from transformers import CONFIG_MAPPING

    declared = family(name).defaults
    assert "rms_norm_eps" in declared and "max_position_embeddings" in declared
    theirs = CONFIG_MAPPING[family(name).model_type]
    for key, value in declared.items():
        assert getattr(theirs, key) == value, (name, key, getattr(theirs, key), value)


@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "deepseek_v3"])  # latent attention: no kv heads
def test_a_config_without_its_head_counts_reads_the_head_shapes_transformers_builds(name):
    """Without num_key_value_heads, dew took every head as a key-value head where Mistral's config class
    has 8, Qwen 3's 32, Gemma 2's 4; without head_dim, Qwen 3 MoE took Qwen 3's 128 where its class has
    none (hidden_size // heads): such a directory, which transformers loads, was refused by a shape."""
    from transformers import CONFIG_MAPPING

    config = json.loads(json.dumps(family(name).config(family(name).build("tiny"))))
    for key in ("num_key_value_heads", "head_dim"):
        config.pop(key, None)
    config["num_attention_heads"], config["hidden_size"] = 64, 256
    theirs = CONFIG_MAPPING[family(name).model_type](**config)
    ours = family(name).model(config)
    assert (ours.num_kv_heads or ours.num_heads) == theirs.num_key_value_heads, (name, theirs.num_key_value_heads)
    head = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert (ours.head_features or ours.emb_features // ours.num_heads) == head, (name, head)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3", "olmo2"])
def test_a_config_without_its_norm_epsilon_computes_what_transformers_computes(tmp_path, name):
    """Their transformers default is 1e-5; read as another family's 1e-6, the logits moved by
    up to 0.05 on these tiny models."""
    directory = write_checkpoint(name, tmp_path / name, seed=7, redrawn=True)
    config = json.loads((directory / "config.json").read_text())
    del config["rms_norm_eps"]
    (directory / "config.json").write_text(json.dumps(config))
    theirs = hf_logits(hf_model(directory))
    loaded = Pretrained.load(directory)
    assert loaded.model.norm_epsilon == 1e-5
    assert np.abs(_dew_logits(loaded) - theirs).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "mixtral", "deepseek_v3"])
def test_a_partial_rotary_factor_that_transformers_does_not_read_rotates_the_whole_head(tmp_path, name):
    """Only Phi-3 of dew's families rotates part of each head in transformers; the others' default
    rope never reads partial_rotary_factor. dew read it for every family and rotated half the head
    at 0.5: logits 1.5 to 8 away from transformers' (and Gemma 3 was refused, naming its sliding
    rope). Beside a scaled rope (llama's llama3, deepseek_v3's YaRN), transformers computes half
    the frequencies and fails on the whole head: refused, naming the key."""
    directory = write_checkpoint(name, tmp_path / name, seed=5, redrawn=True)
    config = json.loads((directory / "config.json").read_text())
    config["partial_rotary_factor"] = 0.5
    ropes = config.get("rope_parameters") or {}
    for params in (ropes.values() if name == "gemma3" else [ropes]):  # Gemma 3: one dict per layer type
        params["partial_rotary_factor"] = 0.5
    (directory / "config.json").write_text(json.dumps(config))
    if name in ("llama", "deepseek_v3"):
        with pytest.raises(RuntimeError, match="must match the size"):
            hf_logits(hf_model(directory))
        with pytest.raises(NoExactCounterpartError, match=r"sets partial_rotary_factor=0\.5.* remove "
                                                          r"partial_rotary_factor from a copy of config\.json"):
            Pretrained.load(directory)
        return
    theirs = hf_logits(hf_model(directory))
    loaded = Pretrained.load(directory)
    assert loaded.model.rotary_fraction == 1.0
    assert np.abs(_dew_logits(loaded) - theirs).max() <= 1e-4


@pytest.mark.slow
def test_a_mistral_config_with_layer_types_windows_only_its_sliding_layers(tmp_path):
    """Ministral 8B's config.json is Mistral's with a layer_types list, which transformers'
    AutoConfig reads as Ministral: its full_attention layers see every earlier position. Read
    as one window on every layer, the logits moved by 2.5; written back, the list travels."""
    directory = write_checkpoint("mistral", tmp_path / "ministral", seed=11, redrawn=True)
    config = json.loads((directory / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (directory / "config.json").write_text(json.dumps(config))
    hf = hf_model(directory)
    assert type(hf).__name__ == "MinistralForCausalLM"
    theirs = hf_logits(hf)
    loaded = Pretrained.load(directory)
    assert [window for window, _, _ in loaded.model._layer_parts()] == [config["sliding_window"], None]
    assert np.abs(_dew_logits(loaded) - theirs).max() <= 1e-4
    loaded.save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layer_types"] == config["layer_types"]
    assert np.abs(hf_logits(hf_model(tmp_path / "out")) - theirs).max() <= 1e-4
    assert Pretrained.load(tmp_path / "out").model == loaded.model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_without_sliding_layers_exports_a_window_transformers_can_run(tmp_path, name):
    """A Gemma 2 or 3 whose layer_types are all full_attention (or one built with no window) was
    exported with sliding_window: null, which transformers loads and then refuses at its first
    forward pass ("Could not find a sliding_window argument"): it builds the sliding mask whatever
    the list says. The export writes the context as the window, which no full layer reads."""
    directory = write_checkpoint(name, tmp_path / "full", seed=12, redrawn=True)
    config = json.loads((directory / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config.pop("sliding_window_pattern", None)
    (directory / "config.json").write_text(json.dumps(config))
    theirs = hf_logits(hf_model(directory))
    loaded = Pretrained.load(directory)
    assert loaded.model.sliding_window is None
    assert np.abs(_dew_logits(loaded) - theirs).max() <= 1e-4
    loaded.save(tmp_path / "out")
    written_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written_config["sliding_window"] == loaded.model.max_seq_len
    assert written_config["layer_types"] == config["layer_types"]
    assert np.abs(hf_logits(hf_model(tmp_path / "out")) - theirs).max() <= 1e-4
    assert Pretrained.load(tmp_path / "out").model == loaded.model


@pytest.mark.slow
def test_a_longrope_phi3_computes_what_transformers_computes_within_and_past_its_original_context(tmp_path):
    """Phi-3's 128k checkpoints, Phi-3.5-mini and Phi-4-mini divide each rotary frequency by a
    factor of their own, from short_factor while the positions stay within
    original_max_position_embeddings and from long_factor once they pass it, and scale cos and
    sin by sqrt(1 + ln(factor) / ln(original)). Here the original context is 12 positions, so the
    19-token prompts take the long list and 10-token ones the short; an old "su" config reads
    as the same model, and the export carries both lists back to transformers. A second original
    length inside rope_scaling yields to the top level's, as in transformers."""
    directory = write_checkpoint("phi3", tmp_path / "phi3", seed=5, redrawn=True)
    config = json.loads((directory / "config.json").read_text())
    rng = np.random.default_rng(1)
    config.update(rope_parameters=None, original_max_position_embeddings=12, max_position_embeddings=256,
                  rope_scaling={"type": "longrope", "short_factor": rng.uniform(1, 3, 4).round(3).tolist(),
                                "long_factor": rng.uniform(4, 16, 4).round(3).tolist(),
                                "original_max_position_embeddings": 64})
    (directory / "config.json").write_text(json.dumps(config))
    hf = hf_model(directory)
    loaded = Pretrained.load(directory)
    assert loaded.model.rope_scaling.kind == "longrope"
    short = PROMPTS[:, :10]
    for ids in (PROMPTS, short):
        assert np.abs(_dew_logits(loaded, ids) - hf_logits(hf, ids)).max() <= 1e-4
    # The two lists give other logits: the positions chose between them.
    assert np.abs(_dew_logits(loaded, PROMPTS)[:, :10] - _dew_logits(loaded, short)).max() > 1e-3
    config["rope_scaling"]["type"] = "su"
    (tmp_path / "su").mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "su" / name).write_bytes((directory / name).read_bytes())
    (tmp_path / "su" / "config.json").write_text(json.dumps(config))
    assert Pretrained.load(tmp_path / "su").model == loaded.model
    check_exports_back(loaded, hf_logits(hf), "phi3", tmp_path / "out")


def test_a_short_decode_cache_does_not_shorten_the_exported_context(tmp_path):
    """max_seq_len is the decode cache a run or a load chose; the published context length
    (max_position_embeddings) belongs to the weights and is written back, not the cache's."""
    source = write_checkpoint("qwen3", tmp_path / "source", seed=3)
    published = json.loads((source / "config.json").read_text())["max_position_embeddings"]
    loaded = Pretrained.load(source, max_seq_len=32)
    assert loaded.model.max_seq_len == 32 < published
    loaded.save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == published
    # A longer cache than the source declares is written as the longer context.
    longer = Pretrained.load(source, max_seq_len=2 * published)
    longer.save(tmp_path / "longer")
    assert json.loads((tmp_path / "longer" / "config.json").read_text())["max_position_embeddings"] == 2 * published


def test_a_short_decode_cache_does_not_rewrite_phi3s_original_context(tmp_path):
    """Phi-3's original_max_position_embeddings (its pretraining context, which LongRoPE switches
    factors at) was written as the decode cache's length of the run that exported it."""
    source = write_checkpoint("phi3", tmp_path / "source", seed=3)
    original = json.loads((source / "config.json").read_text())["original_max_position_embeddings"]
    Pretrained.load(source, max_seq_len=original // 2).save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["original_max_position_embeddings"] == original


@pytest.mark.slow
@pytest.mark.parametrize("name, change, field", [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_scaling\.rope_type='dynamic'.* remove rope_scaling from a copy of config\.json"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                               "long_factor": [1.0] * 3}}, r"rope_scaling\.short_factor='3 numbers'.* 4 here"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("qwen3", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quantization_config\.quant_method='fp8'"),  # as DeepSeek-V3's published directories are stored
])
def test_a_config_value_without_an_exact_counterpart_is_refused_naming_the_field(
        written, tmp_path, name, change, field):
    directory, _ = written[name]
    config = {**json.loads((directory / "config.json").read_text()), "rope_parameters": None, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NoExactCounterpartError, match=field):
        Pretrained.load(tmp_path)


@pytest.mark.slow
def test_a_missing_or_misshapen_fused_tensor_names_its_key_and_both_shapes(written, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory, _ = written["phi3"]
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(TensorMismatchError, match=rf"{name} \(shape \(128, 64\)"):
        Pretrained.load(tmp_path)
    save_file({**tensors, name: tensors[name][:96]}, tmp_path / "model.safetensors")
    with pytest.raises(TensorMismatchError, match=rf"{name} .* has shape \(96, 64\).* makes it \(128, 64\)"
                                                  r".*layers_1/attention/query \+ .*/value of shape"):
        Pretrained.load(tmp_path)


@pytest.mark.slow
def test_a_tokenizer_larger_than_the_embedding_is_refused_on_load(tmp_path):
    write_checkpoint("qwen3", tmp_path, overrides={"vocab_size": 200, "pad_token_id": None})
    with pytest.raises(VocabularyMismatchError, match=r"\d+ ids but the model's vocab_size is 200"):
        Pretrained.load(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3"])
def test_cached_decoding_matches_the_whole_sequence_across_windows(written, ours, name):
    # Sliding windows, per-layer rotary bases and soft-capping hold token by token, as rollouts decode.
    loaded = Pretrained.load(written[name][0], max_seq_len=32)
    ids = jnp.asarray(PROMPTS, jnp.int32)
    whole = ours(name)
    step = jax.jit(lambda v, t: loaded.model.apply(v, t, decode=True, mutable=["cache"]))
    cache: dict = {}
    pieces = []
    for t in range(ids.shape[1]):  # one token at a time: one compiled step
        logits, cache = step({**loaded.variables, **cache}, ids[:, t:t + 1])
        pieces.append(np.asarray(logits))
    assert np.abs(np.concatenate(pieces, axis=1) - whole).max() <= 1e-4


def test_a_model_its_family_cannot_express_is_refused_naming_the_field_and_the_family_that_can(tmp_path):
    model = family("qwen3").build("tiny").clone(family="llama")
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(NoExactCounterpartError,
                       match=r"CausalTransformer\.qk_norm='head'.*LlamaForCausalLM.*family to 'qwen3'"):
        Pretrained(model, variables).save(tmp_path)
    gemma = family("gemma2").build("tiny", logit_softcap=None).clone(family="gemma3")
    with pytest.raises(NoExactCounterpartError, match="CausalTransformer.qk_norm='none'.*Gemma3ForCausalLM"):
        Pretrained(gemma, variables).save(tmp_path)
    assert not list(tmp_path.iterdir())


def test_families_build_by_name_from_presets_and_refuse_unknown_presets_and_fields():
    from dew import models
    from dew.nn.backbones import CausalTransformer
    from dew.registry import InvalidFieldsError

    names = models.names()
    assert all(names.get(name) == "dew-core" for name in NAMES)
    qwen = models.build("qwen3", preset="0.6b", num_layers=2, max_seq_len=128)
    assert type(qwen) is CausalTransformer and qwen.family == "qwen3"
    assert (qwen.qk_norm, qwen.head_width, qwen.num_kv_heads, qwen.num_layers) == ("head", 128, 8, 2)
    gemma = models.build("gemma3", preset="1b", num_layers=12)  # the sliding pattern follows the layers
    assert gemma.sliding_layers == tuple(i for i in range(12) if i not in (5, 11))
    assert gemma.local_rope_base == 10_000.0 and gemma.rope_base == 1_000_000.0
    with pytest.raises(InvalidFieldsError, match="has no field 'qk_norms'.*did you mean 'qk_norm'"):
        models.build("qwen3", qk_norms="head")
    with pytest.raises(KeyError, match="no preset '0.5b'; its presets are '0.6b', '1.7b'"):
        models.build("qwen3", preset="0.5b")


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_writes_a_config_transformers_reads_as_that_size(tmp_path, name):
    fam = family(name)
    config_class = getattr(transformers, fam.architecture).config_class
    for preset in fam.presets:
        model = fam.build(preset)
        config = fam.config(model)
        theirs = config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        assert theirs.num_hidden_layers == model.num_layers and theirs.vocab_size == model.vocab_size
        assert getattr(theirs, "head_dim", None) in (None, model.head_width)
        if hasattr(theirs, "layer_types") and theirs.layer_types is not None:
            sliding = [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]
            assert [w is not None for w, _, _ in model._layer_parts()] == [
                i in sliding for i in range(model.num_layers)], preset


@pytest.mark.slow
def test_on_eight_devices_every_family_computes_what_one_device_does(written, ours, tmp_path):
    from dew.testing.processes import run_python

    for name in NAMES:
        np.save(tmp_path / f"{name}.npy", ours(name))
    directories = {name: str(written[name][0]) for name in NAMES}
    done = run_python(f"""
        import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        from dew.pretrained import Pretrained
        from dew.training import Layout, MeshSpec, build_mesh
        mesh = build_mesh(MeshSpec(fsdp=4, tensor=2))
        layout = Layout(min_shard=0)  # shard even the tiny weights
        ids = jnp.asarray({np.vstack([PROMPTS, PROMPTS[:1]]).tolist()!r}, jnp.int32)
        for name, directory in {directories!r}.items():
            model = Pretrained.load(directory).model
            abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
            shardings = layout.shardings(mesh, abstract)
            loaded = Pretrained.load(directory, shardings=shardings)
            wi = loaded.variables["params"]["layers_0"]["mlp"]["wi"]
            assert wi.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor"), wi.sharding
            with jax.set_mesh(mesh), nn.logical_axis_rules(layout.axis_rules):
                logits = jax.jit(model.apply)(loaded.variables, ids)
            reference = np.load({str(tmp_path)!r} + f"/{{name}}.npy")
            print(name, float(np.abs(np.asarray(logits)[:3] - reference).max()))
    """, devices=8, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    differences = dict(line.split() for line in done.stdout.strip().splitlines())
    assert set(differences) == set(NAMES)
    for name, difference in differences.items():
        assert float(difference) <= 2e-5, (name, difference)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_fused_attention_keeps_the_sliding_window_and_query_scale(written, ours, name):
    # jax.nn.dot_product_attention (the "xla" and "cudnn" kinds) takes the window and the scale.
    loaded = Pretrained.load(written[name][0])
    fused = loaded.model.clone(attention="xla")
    logits = np.asarray(jax.jit(fused.apply)(loaded.variables, jnp.asarray(PROMPTS, jnp.int32)))
    assert np.abs(logits - ours(name)).max() <= 1e-5
