"""The weights boundary: model directories the real transformers and peft wrote, then damaged.

Reading refuses what would load silently wrong (an int32 tensor, adapters
stored transposed or missing, a config.json whose sizes no weights present
could fill) with an error naming the file and what to do; writing puts an
export whole in place of OUT and never touches another program's files or what
a planted link points to. The ``dew`` commands over damaged directories, and a
distillation teacher of another architecture, need dew-objectives: they are
tested in tests/test_weights_commands.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.pretrained import (
    ConfigValueError,
    DamagedFileError,
    NoExactCounterpartError,
    Pretrained,
    TensorMismatchError,
)
from dew.pretrained.writing import ExportDirectoryError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from weights_directories import copy_directory, rewrite_tensors, tensors_of, write_llama  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny Llama 3-style directory transformers wrote, and PEFT's LoRA adapters beside it."""
    return write_llama(tmp_path_factory.mktemp("weights"))


# -- reading -------------------------------------------------------------------------------


def test_a_llama3_directory_loads_with_its_eos_list_and_every_weight_as_stored(good):
    loaded = Pretrained.load(good)
    stored = tensors_of(good / "model.safetensors")
    assert loaded.tokenizer.eos_id == 256
    query = np.asarray(loaded.variables["params"]["layers_1"]["attention"]["query"])
    # dew's query is [embed, heads, head_dim]; the file's is [heads * head_dim, embed].
    assert np.array_equal(query.reshape(32, -1), stored["model.layers.1.self_attn.q_proj.weight"].T)


def test_an_int32_tensor_is_refused_naming_the_file_and_tensor(good, tmp_path):
    directory = copy_directory(good, tmp_path / "d")
    tensors = tensors_of(directory / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].view(np.int32)  # the same bytes, read as integers
    rewrite_tensors(directory / "model.safetensors", tensors)
    with pytest.raises(TensorMismatchError, match=rf"model.safetensors stores {name} as I32"):
        Pretrained.load(directory)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_hidden_layers", 1_000_000_000, r"num_hidden_layers=1000000000, but the weights hold 21 tensors"),
    ("hidden_size", 0, r"hidden_size=0; it must be a positive integer"),
    ("vocab_size", "many", r"vocab_size='many'; it must be a positive integer"),
    ("intermediate_size", 10**9, r"intermediate_size=1000000000: one such matrix"),
])
def test_an_absurd_config_value_fails_fast_naming_the_field(good, tmp_path, key, value, match):
    directory = copy_directory(good, tmp_path / "d")
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    began = time.perf_counter()
    with pytest.raises(ConfigValueError, match=match):
        Pretrained.load(directory)
    assert time.perf_counter() - began < 5  # refused, not allocated


def test_a_config_over_the_size_cap_or_not_json_is_refused_unread(good, tmp_path):
    directory = copy_directory(good, tmp_path / "d")
    text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(text + " " * (17 * 2**20))  # valid JSON, 17 MB
    with pytest.raises(DamagedFileError, match=r"config.json is 17 MB, more than the 16 MB"):
        Pretrained.load(directory)
    (directory / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(DamagedFileError, match=r"config.json is not valid JSON"):
        Pretrained.load(directory)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header-only", "stale-index"])
def test_damaged_safetensors_are_refused_naming_the_file(good, tmp_path, damage):
    directory = copy_directory(good, tmp_path / "d")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) - 1000])
        match = r"model.safetensors ends before the data of"
    elif damage == "garbage":
        weights.write_bytes(np.random.default_rng(0).bytes(len(data)))
        match = r"model.safetensors( has no readable|'s) safetensors header"
    elif damage == "header-only":
        weights.write_bytes(data[:8] + b"{not json" + data[17:])
        match = r"model.safetensors's safetensors header is not valid JSON"
    else:  # an index naming a shard that is not there (without model.safetensors, read first)
        weights.unlink()
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
        match = r"names model-00001-of-00002.safetensors, which .* does not hold"
    with pytest.raises(DamagedFileError, match=match):
        Pretrained.load(directory)


def _adapted(good: Path, **lora_fields):
    from dew.adapters.lora import Lora, apply_lora, with_base

    loaded = Pretrained.load(good)
    spec = Lora(**{"rank": 4, "alpha": 8.0, "targets": ("attention",), **lora_fields})
    adapted = apply_lora(loaded.model, spec)
    fresh = adapted.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
    return loaded.model, with_base(fresh, loaded.variables), spec


def test_peft_adapters_load_and_damaged_ones_are_refused(good, tmp_path):
    from dew.pretrained.peft import load_adapters

    model, variables, spec = _adapted(good)
    source = good.parent / "adapters"
    stored = tensors_of(source / "adapter_model.safetensors")
    loaded = load_adapters(source, model, variables, spec=spec)
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    attention = loaded["params"]["layers_1"]["attention"]
    assert np.array_equal(np.asarray(attention["value_lora_a"]).reshape(32, 4),
                          stored[f"{prefix}.lora_A.weight"].T)
    assert np.array_equal(np.asarray(attention["value_lora_b"]).reshape(4, -1),
                          stored[f"{prefix}.lora_B.weight"].T)

    def damaged(name: str, change) -> Path:
        directory = copy_directory(good, tmp_path / name, adapters=True)
        tensors = tensors_of(directory / "adapter_model.safetensors")
        config = json.loads((directory / "adapter_config.json").read_text())
        change(tensors, config)
        rewrite_tensors(directory / "adapter_model.safetensors", tensors)
        (directory / "adapter_config.json").write_text(json.dumps(config))
        return directory

    a, b = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
    cases = {
        "transposed": (lambda t, c: t.update({a: np.ascontiguousarray(t[a].T)}),
                       rf"{a} in .* has shape \(32, 4\) \(stored transposed\)"),
        "int32": (lambda t, c: t.update({b: t[b].view(np.int32)}), rf"stores {b} as I32"),
        "missing-b": (lambda t, c: t.pop(b), rf"holds {a} but not {b}"),
        "missing-both": (lambda t, c: (t.pop(a), t.pop(b)), r"has no adapter for model.layers.1.self_attn.v_proj"),
        "rank": (lambda t, c: c.update(r=8), r"sets r=8, but the adapted model's adapters have rank 4"),
        "targets": (lambda t, c: c.update(target_modules=["q_proj", "v_proj"]),
                    r"targets \['q_proj', 'v_proj'\], but the adapted model carries adapters on \['k_proj'"),
        "alpha": (lambda t, c: c.update(lora_alpha=32), r"lora_alpha=32, but the Lora given has alpha=8.0"),
    }
    for name, (change, match) in cases.items():
        with pytest.raises(TensorMismatchError, match=match):
            load_adapters(damaged(name, change), model, variables, spec=spec)
    # PEFT settings that change what the same tensors compute (rsLoRA scales by alpha / sqrt(r), a
    # pattern gives one weight its own alpha or rank, DoRA adds a magnitude): refused by name; read as
    # plain LoRA, rsLoRA's logits were 3.55 away from PEFT's and an alpha_pattern's 2.23.
    for key, value in (("use_rslora", True), ("alpha_pattern", {"q_proj": 32}), ("rank_pattern", {"v_proj": 2}),
                       ("use_dora", True)):
        with pytest.raises(NoExactCounterpartError, match=rf"sets {key}={value!r}, which dew's LoRA does not compute"):
            load_adapters(damaged(key, lambda t, c, key=key, value=value: c.update({key: value})), model, variables,
                          spec=spec)


# -- writing -------------------------------------------------------------------------------


def test_adapters_are_written_whole_and_never_over_anothers_files(good, tmp_path):
    """PEFT adapters go out as exports do (issue 37, item 2): swapped in whole over an earlier
    export (none of its shards or index left), refused over another program's files, and with
    force never written through a link planted in OUT."""
    from dew.pretrained.peft import load_adapters, save_adapters

    model, variables, spec = _adapted(good)
    out = tmp_path / "out"
    Pretrained.load(good).save(out, max_shard_bytes=4000)  # an earlier export: shards and an index
    save_adapters(out, model, variables, spec)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    back = load_adapters(out, model, variables, spec=spec)
    for ours, again in zip(jax.tree.leaves(variables), jax.tree.leaves(back), strict=True):
        assert np.array_equal(ours, again)

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "adapter_config.json").write_text('{"mine": true}')
    with pytest.raises(ExportDirectoryError, match=r"holds files dew did not write \(adapter_config.json\)"):
        save_adapters(theirs, model, variables, spec)
    assert (theirs / "adapter_config.json").read_text() == '{"mine": true}'
    outside = tmp_path / "outside.safetensors"
    outside.write_text("precious")
    os.symlink(outside, theirs / "adapter_model.safetensors")
    (theirs / "notes.txt").write_text("kept")
    save_adapters(theirs, model, variables, spec, force=True)
    assert outside.read_text() == "precious" and not (theirs / "adapter_model.safetensors").is_symlink()
    assert (theirs / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "outside.safetensors", "theirs"]


def test_an_export_replaces_out_whole_and_never_touches_anothers_files(good, tmp_path):
    loaded = Pretrained.load(good)
    out = tmp_path / "out"
    loaded.save(out, max_shard_bytes=4000)  # sharded, with an index
    assert (out / "model.safetensors.index.json").is_file()
    loaded.save(out)  # one file: nothing of the sharded export is left to mislead a reader
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    again = Pretrained.load(out)
    for ours, theirs in zip(jax.tree.leaves(loaded.variables), jax.tree.leaves(again.variables), strict=True):
        assert np.array_equal(ours, theirs)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no fresh or old directory left beside it

    # Another program's directory: refused, untouched.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"mine": true}')
    with pytest.raises(ExportDirectoryError, match=r"holds files dew did not write \(config.json\)"):
        loaded.save(theirs)
    assert (theirs / "config.json").read_text() == '{"mine": true}'

    # --force: the export's files replaced, others kept; a planted link is never written through.
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    os.symlink(outside, theirs / "tokenizer.json")
    (theirs / "notes.txt").write_text("kept")
    loaded.save(theirs, force=True)
    assert outside.read_text() == "precious"
    assert not (theirs / "tokenizer.json").is_symlink() and (theirs / "notes.txt").read_text() == "kept"
    assert json.loads((theirs / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ExportDirectoryError, match=r"a-file is a file, not a directory"):
        loaded.save(tmp_path / "a-file")


@pytest.mark.parametrize(("name", "key"), [
    ("qwen2", "num_hidden_layers"), ("gemma2", "num_hidden_layers"), ("gemma3", "num_hidden_layers"),
    ("qwen3_moe", "num_hidden_layers"), ("deepseek_v3", "num_nextn_predict_layers"),
    ("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts"), ("deepseek_v3", "n_routed_experts"),
])
def test_an_absurd_layer_or_expert_count_fails_fast_in_every_family(tmp_path, name, key):
    """The families whose model description lists each layer's parts (sliding windows, dense
    layers, the prediction layers left unread) or whose table names each expert's tensors refuse
    a count the weights cannot hold before building those lists: 10**9 allocated gigabytes there."""
    from dew.families.examples import write_checkpoint

    directory = write_checkpoint(name, tmp_path / name)
    config = json.loads((directory / "config.json").read_text())
    config.pop("layer_types", None)  # as transformers 4 wrote it: the pattern follows the count
    config[key] = 1_000_000_000
    (directory / "config.json").write_text(json.dumps(config))
    began = time.perf_counter()
    with pytest.raises(ConfigValueError, match=rf"{key}=1000000000, but .*the weights hold \d+ tensors"):
        Pretrained.load(directory)
    assert time.perf_counter() - began < 5  # refused, not allocated


def test_a_single_weights_file_beside_an_old_index_and_shards_is_read_as_transformers_reads_it(good, tmp_path):
    """Sharded, then saved again as one file into the same directory: transformers' save_pretrained
    leaves the old index behind (and a copy can leave old shards); transformers reads model.safetensors."""
    directory = tmp_path / "resaved"
    hf = transformers.AutoModelForCausalLM.from_pretrained(good)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(1.0)  # the old weights, which the shards keep
    hf.save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(good)
    hf.save_pretrained(directory)  # the new weights, as one file
    shutil.copy(good / "tokenizer.json", directory)
    (directory / "model-00001-of-00099.safetensors").write_bytes(b"")  # a stale shard no index names
    ids = np.arange(10, dtype=np.int64)[None]
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(directory)(torch.as_tensor(ids)).logits.numpy()
    loaded = Pretrained.load(directory)
    logits = np.asarray(loaded.model.apply(loaded.variables, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(logits, expected, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tied_config_whose_file_holds_another_head_reads_that_head_as_transformers_does(tmp_path, family):
    """config.json says tie_word_embeddings, the file holds an lm_head.weight of other values (some
    published checkpoints do): transformers unties the two and computes with the stored head."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    kind = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    hf = transformers.AutoModelForCausalLM.from_config(kind(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    directory = tmp_path / family
    hf.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    same = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    ids = np.arange(12, dtype=np.int64)[None]
    for stored, untied in ((same, False), (dict(tensors, **{"lm_head.weight": torch.randn(64, 32)}), True)):
        save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
        with torch.no_grad():
            expected = transformers.AutoModelForCausalLM.from_pretrained(directory)(torch.as_tensor(ids)).logits.numpy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = Pretrained.load(directory)
        assert loaded.model.tie_embeddings is not untied
        assert any("tie_word_embeddings" in str(w.message) for w in caught) is untied
        logits = np.asarray(loaded.model.apply(loaded.variables, jnp.asarray(ids, jnp.int32)))
        np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_weights_stored_in_bfloat16_under_a_config_that_names_no_dtype_stay_bfloat16(good, tmp_path):
    """transformers reads such a directory in the stored type (dtype="auto"); widening it to float32
    doubled the memory and the export's size."""
    directory = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(good, dtype=torch.bfloat16).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(good / "tokenizer.json", directory)
    assert transformers.AutoModelForCausalLM.from_pretrained(directory).dtype == torch.bfloat16
    loaded = Pretrained.load(directory)
    assert {np.asarray(leaf).dtype.name for leaf in jax.tree.leaves(loaded.variables)} == {"bfloat16"}
    written = loaded.save(tmp_path / "out")
    assert json.loads((written / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_same_tensors_and_metadata_make_the_same_bytes(tmp_path):
    """safetensors writes metadata from a hash map, whose order changes from one call to the next: a
    LoRA export (metadata format and dew_base_digest) came out as files of other checksums from the
    same adapters. The header's metadata is written sorted, and the file still reads back whole."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from dew.pretrained.tensors import write_tensors

    metadata = {"format": "pt", "dew_base_digest": "0" * 64, "zeta": "1", "alpha": "\u00e9t\u00e9"}
    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(3, np.int8)}
    files = [tmp_path / f"{index}.safetensors" for index in range(8)]
    for path in files:
        write_tensors(path, tensors, metadata)
    assert len({path.read_bytes() for path in files}) == 1
    raw = files[0].read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == sorted(metadata)
    read = load_file(files[0])
    assert set(read) == set(tensors) and all(np.array_equal(read[name], tensors[name]) for name in tensors)
    with safe_open(files[0], "np") as handle:
        assert handle.metadata() == metadata
