"""The weights boundary where it needs more than dew-core: the ``dew`` commands (generate, eval,
export) over many damaged model directories in one child interpreter, and a distillation
teacher of another architecture refused naming its leaves. Moved from
dew-core/tests/test_weights_boundary.py: ``dew generate`` and ``dew eval`` run dew-objectives'
sampling and tasks, and the teacher is dew-objectives' DistillationObjective."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from dew.pretrained import Pretrained
from dew.testing.processes import run_python

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from weights_directories import copy_directory, rewrite_tensors, tensors_of, write_llama  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny Llama 3-style directory transformers wrote, and PEFT's LoRA adapters beside it."""
    return write_llama(tmp_path_factory.mktemp("weights"))


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
        directory = copy_directory(good, tmp_path / name)
        change(directory)
        damaged[name] = (directory, match, commands)

    def tensors(change):
        def apply(directory: Path) -> None:
            found = tensors_of(directory / "model.safetensors")
            change(found)
            rewrite_tensors(directory / "model.safetensors", found)
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
    case("stale-index", "does not hold", lambda d: ((d / weights).unlink(), (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))))  # an index alone
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
