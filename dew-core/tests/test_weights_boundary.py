"""The weights boundary: model directories the real transformers and peft wrote, then damaged.

Reading refuses what would load silently wrong (an int32 tensor, adapters
stored transposed or missing, a config.json whose sizes no weights present
could fill, a teacher of another architecture) with an error naming the file
and what to do; writing puts an export whole in place of OUT and never touches
another program's files or what a planted link points to. The last test runs
the ``dew`` commands over many damaged directories in one child interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.pretrained import (
    ConfigValueError,
    DamagedFileError,
    Pretrained,
    TensorMismatchError,
)
from dew.pretrained.writing import ExportDirectoryError
from dew.testing.processes import run_python

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny Llama 3-style directory transformers wrote: eos_token_id a list, a tokenizer, every
    weight redrawn; and PEFT's LoRA adapters for it (B redrawn, so they change the output)."""
    from dew.pretrained.tokenizers import byte_level

    root = tmp_path_factory.mktemp("weights")
    directory = root / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False,
        bos_token_id=257, eos_token_id=[256, 258])
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0.0, 0.2)
    hf.save_pretrained(directory)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level(),
                                                     eos_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.1)
    lora.save_pretrained(root / "adapters")
    return directory


def _copy(good: Path, to: Path, *, adapters: bool = False) -> Path:
    source = good.parent / "adapters" if adapters else good
    shutil.copytree(source, to)
    return to


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(path)


def _rewrite(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata={"format": "pt"})


# -- reading -------------------------------------------------------------------------------


def test_a_llama3_directory_loads_with_its_eos_list_and_every_weight_as_stored(good):
    loaded = Pretrained.load(good)
    stored = _tensors(good / "model.safetensors")
    assert loaded.tokenizer.eos_id == 256
    query = np.asarray(loaded.variables["params"]["layers_1"]["attention"]["query"])
    # dew's query is [embed, heads, head_dim]; the file's is [heads * head_dim, embed].
    assert np.array_equal(query.reshape(32, -1), stored["model.layers.1.self_attn.q_proj.weight"].T)


def test_an_int32_tensor_is_refused_naming_the_file_and_tensor(good, tmp_path):
    directory = _copy(good, tmp_path / "d")
    tensors = _tensors(directory / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].view(np.int32)  # the same bytes, read as integers
    _rewrite(directory / "model.safetensors", tensors)
    with pytest.raises(TensorMismatchError, match=rf"model.safetensors stores {name} as I32"):
        Pretrained.load(directory)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_hidden_layers", 1_000_000_000, r"num_hidden_layers=1000000000, but the weights hold 21 tensors"),
    ("hidden_size", 0, r"hidden_size=0; it must be a positive integer"),
    ("vocab_size", "many", r"vocab_size='many'; it must be a positive integer"),
    ("intermediate_size", 10**9, r"intermediate_size=1000000000: one such matrix"),
])
def test_an_absurd_config_value_fails_fast_naming_the_field(good, tmp_path, key, value, match):
    directory = _copy(good, tmp_path / "d")
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    began = time.perf_counter()
    with pytest.raises(ConfigValueError, match=match):
        Pretrained.load(directory)
    assert time.perf_counter() - began < 5  # refused, not allocated


def test_a_config_over_the_size_cap_or_not_json_is_refused_unread(good, tmp_path):
    directory = _copy(good, tmp_path / "d")
    text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(text + " " * (17 * 2**20))  # valid JSON, 17 MB
    with pytest.raises(DamagedFileError, match=r"config.json is 17 MB, more than the 16 MB"):
        Pretrained.load(directory)
    (directory / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(DamagedFileError, match=r"config.json is not valid JSON"):
        Pretrained.load(directory)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header-only", "stale-index"])
def test_damaged_safetensors_are_refused_naming_the_file(good, tmp_path, damage):
    directory = _copy(good, tmp_path / "d")
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
    else:  # an index naming a shard that is not there
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
    stored = _tensors(source / "adapter_model.safetensors")
    loaded = load_adapters(source, model, variables, spec=spec)
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    attention = loaded["params"]["layers_1"]["attention"]
    assert np.array_equal(np.asarray(attention["value_lora_a"]).reshape(32, 4),
                          stored[f"{prefix}.lora_A.weight"].T)
    assert np.array_equal(np.asarray(attention["value_lora_b"]).reshape(4, -1),
                          stored[f"{prefix}.lora_B.weight"].T)

    def damaged(name: str, change) -> Path:
        directory = _copy(good, tmp_path / name, adapters=True)
        tensors = _tensors(directory / "adapter_model.safetensors")
        config = json.loads((directory / "adapter_config.json").read_text())
        change(tensors, config)
        _rewrite(directory / "adapter_model.safetensors", tensors)
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


def test_a_teacher_of_another_architecture_is_refused_naming_its_leaves(good):
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.distillation import DistillationObjective
    from dew.training.initializers import InitializerMismatchError

    loaded = Pretrained.load(good)
    student = CausalTransformer(vocab_size=260, emb_features=16, num_layers=1, num_heads=2,
                                mlp_features=32, max_seq_len=16)
    # Declared with learned positions and a gelu MLP; the weights are the Llama's.
    teacher = loaded.model.clone(position_embedding="learned", mlp_activation="gelu", max_seq_len=16)
    objective = DistillationObjective(model=student, teacher=teacher, seq_len=8)
    import flax.linen as nn

    abstract = nn.meta.unbox(jax.eval_shape(objective.init, jax.random.key(0)))
    read = objective.teacher_from({"params": loaded.variables["params"]})
    with pytest.raises(InitializerMismatchError,
                       match=r"teacher's weights do not fit.*position.*missing.*gate.*not in"):
        read(abstract)


# -- writing -------------------------------------------------------------------------------


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


# -- the commands --------------------------------------------------------------------------

DRIVER = """
import contextlib, io, json, sys
from dew.cli import main
results = []
for argv in json.loads(sys.argv[1] if len(sys.argv) > 1 else {cases!r}):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except BaseException as error:  # a traceback would be a failure of the test
            import traceback
            status, err = 99, io.StringIO(traceback.format_exc())
    results.append({{"argv": argv, "status": status, "stderr": err.getvalue()}})
print("RESULTS" + json.dumps(results))
"""


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def test_the_commands_refuse_every_damaged_directory_in_one_line(good, tmp_path):
    damaged: dict[str, tuple[Path, str, tuple[str, ...]]] = {}

    def case(name: str, match: str, change, commands=("generate", "eval", "export")) -> None:
        directory = _copy(good, tmp_path / name)
        change(directory)
        damaged[name] = (directory, match, commands)

    def tensors(change):
        def apply(directory: Path) -> None:
            found = _tensors(directory / "model.safetensors")
            change(found)
            _rewrite(directory / "model.safetensors", found)
        return apply

    def config(**fields):
        def apply(directory: Path) -> None:
            read = json.loads((directory / "config.json").read_text())
            read.update(fields)
            (directory / "config.json").write_text(json.dumps(read))
        return apply

    weights = "model.safetensors"
    case("truncated", "ends before the data of",
         lambda d: (d / weights).write_bytes((d / weights).read_bytes()[:-500]))
    case("garbage", "has no readable safetensors header",
         lambda d: (d / weights).write_bytes(b"\xff" * 4096))
    case("empty-weights", "has no readable safetensors header", lambda d: (d / weights).write_bytes(b""))
    case("missing-tensor", "lacks 1 tensor(s) the model needs, first model.layers.1.mlp.down_proj.weight",
         tensors(lambda t: t.pop("model.layers.1.mlp.down_proj.weight")))
    case("extra-tensor", "has no place for: model.layers.7.mlp.gate_proj.weight",
         tensors(lambda t: t.update({"model.layers.7.mlp.gate_proj.weight": t["model.layers.1.mlp.gate_proj.weight"]})))
    case("wrong-shape", "Tensor model.norm.weight in",
         tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:16]})))
    case("int32", "stores lm_head.weight as I32",
         tensors(lambda t: t.update({"lm_head.weight": t["lm_head.weight"].view(np.int32)})))
    case("bad-json", "config.json is not valid JSON",
         lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],'))
    case("json-list", "holds a JSON list", lambda d: (d / "config.json").write_text("[1, 2]"))
    case("huge-layers", "num_hidden_layers=1000000000", config(num_hidden_layers=10**9))
    case("zero-heads", "num_attention_heads=0; it must be a positive integer", config(num_attention_heads=0))
    case("string-size", "hidden_size='32'; it must be a positive integer", config(hidden_size="32"))
    case("other-architecture", "GPTNeoXForCausalLM", config(architectures=["GPTNeoXForCausalLM"]))
    case("bad-rope", "rope_scaling.rope_type", config(rope_scaling={"rope_type": "warp", "factor": 2.0}))
    case("garbage-tokenizer", "tokenizer.json is not a tokenizer",
         lambda d: (d / "tokenizer.json").write_text("{}"))
    case("stale-index", "does not hold", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})))
    case("no-weights", "holds neither model.safetensors", lambda d: (d / weights).unlink())
    case("no-tokenizer", "tokenizer", lambda d: [(d / n).unlink() for n in
                                                 ("tokenizer.json", "tokenizer_config.json")],
         commands=("generate",))  # the weights alone still export
    argvs, expected = [], []
    for name, (directory, match, commands) in damaged.items():
        chosen = {"generate": ["generate", str(directory), "hi", "--max-new-tokens", "2"],
                  "eval": ["eval", str(directory), "--task", "nothing"],
                  "export": ["export", str(directory), str(tmp_path / "exports" / name)]}
        argvs.extend(chosen[command] for command in commands)
        expected.extend(match for _ in commands)
    # Export refusals: OUT a file, OUT another program's, OUT a link.
    (tmp_path / "a-file").write_text("x")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"mine": true}')
    os.symlink(theirs, tmp_path / "linked")
    refusals = {"a-file": "is a file, not a directory", "theirs": "holds files dew did not write",
                "linked": "is a symbolic link"}
    for name in refusals:
        argvs.append(["export", str(good), str(tmp_path / name)])
    before = _snapshot(tmp_path)
    done = run_python(DRIVER.format(cases=json.dumps(argvs)), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULTS", 1)[1])
    expected += list(refusals.values())
    for result, match in zip(results, expected, strict=True):
        command = result["argv"][0]
        lines = result["stderr"].splitlines()
        assert result["status"] == 2, result
        assert lines and lines[0].startswith(f"dew {command}: ") and "Traceback" not in result["stderr"], result
        assert match in lines[0], (match, result)
    assert _snapshot(tmp_path) == before  # nothing written anywhere: no export, no damage repaired
    assert not (tmp_path / "exports").exists()
