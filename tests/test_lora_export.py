"""A LoRA run from `dew train` on an exported model, out through `dew export`: merged into a Llama
transformers loads, or as PEFT adapters the real `peft` puts onto the transformers base.

The commands run through ``dew.cli.main`` in this process (the conftest's dew_command: the function
the console script calls), each in the test's directory."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.pretrained import Pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("qwix")

SMALL = ["model.emb_features=32", "model.num_layers=1", "model.mlp_features=64", "lora.rank=4",
         "data.files={stdlib}/abc.py", "data.load.val_fraction=0", "trainer.eval_every=null", "trainer.steps=4", "trainer.log_every=2", "objective.prompt=null",
         "optimizer.learning_rate=5.0e-2", "optimizer.warmup_steps=0"]


@pytest.fixture
def dew(dew_command):
    """Call with (*args, cwd=DIRECTORY): `dew ARGS` in DIRECTORY, which must succeed."""

    def call(*args: str, cwd: Path):
        result = dew_command(*args, cwd=cwd)
        assert result.returncode == 0, result.stdout + result.stderr[-4000:]
        return result

    return call


def _base(directory: Path, seed: int) -> Path:
    """A model as `dew export` writes it: the shape tiny-lm-qlora's SMALL overrides give."""
    model = models.build("causal_transformer", vocab_size=257, emb_features=32, num_layers=1, num_heads=4,
                         mlp_features=64, max_seq_len=128, position_embedding="rotary",
                         mlp_activation="swiglu")
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    return Pretrained(model, variables).save(directory)


def _train(dew, tmp_path: Path, base: str) -> Path:
    _base(tmp_path / "exported", seed=0)
    run = tmp_path / f"run-{base}"
    dew("train", "tiny-lm-qlora", *SMALL, f"lora.base={base}", "init.pretrained=exported",  # from tmp_path
         f"trainer.checkpoint_dir={run}", f"trackers.0.directory={run}", cwd=tmp_path)
    return run


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 257, (2, 12)).astype(np.int32)


def _dew_logits(run: Path) -> tuple[np.ndarray, object]:
    from dew.recipes.opening import open_run

    opened = open_run(run)
    return np.asarray(opened.model.apply(opened.variables, jnp.asarray(_tokens()))), opened


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(_tokens(), dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_merged_and_peft_exports_compute_the_adapted_model(tmp_path, dew, dew_command):
    from peft import PeftModel

    from dew.adapters.lora import base_model, with_base
    from dew.pretrained.peft import AdapterBaseMismatchError, load_adapters

    run = _train(dew, tmp_path, "float32")
    adapted, opened = _dew_logits(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert np.abs(_torch_logits(base) - adapted).max() > 1e-3  # the adapters trained: the check can fail

    dew("export", str(run), str(tmp_path / "merged"), cwd=tmp_path)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(merged), adapted, atol=1e-4, rtol=0)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = dew("export", "--adapters", str(run), str(tmp_path / "adapters"), cwd=elsewhere)
    assert "the adapters" in out.stdout and "PEFT puts them onto the float base" not in out.stdout
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json",
                                                                          "adapter_model.safetensors"]
    written = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    # The run's init.pretrained (relative, from where it trained), not from where the export ran.
    assert written["base_model_name_or_path"] == f"{tmp_path}/exported"
    with_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    np.testing.assert_allclose(_torch_logits(with_peft), adapted, atol=1e-4, rtol=0)
    # --verify puts them onto their base with PEFT and compares; adapters PEFT computes otherwise (B
    # scaled in the file, as a PEFT that dropped or misread them would) fail it, with the record kept.
    out = dew("export", "--adapters", "--verify", str(run), str(tmp_path / "verified"), cwd=tmp_path)
    assert "Verified: transformers' PeftModel on LlamaForCausalLM matches dew's logits within" in out.stdout
    record = json.loads((tmp_path / "verified" / "verification.json").read_text())
    assert record["passed"] and record["max_abs_difference"] < 1e-3
    from safetensors.numpy import load_file, save_file

    weights = load_file(tmp_path / "verified" / "adapter_model.safetensors")
    save_file({k: v * 3 if "lora_B" in k else v for k, v in weights.items()},
              tmp_path / "verified" / "adapter_model.safetensors", metadata={"format": "pt"})
    from dew.adapters.lora import merge_lora
    from dew.pretrained.verify import ExportMismatchError, verify_adapters

    with pytest.raises(ExportMismatchError, match=r"PeftModel on LlamaForCausalLM computes logits up to"):
        verify_adapters(tmp_path / "verified", base_model(opened.model),
                        merge_lora(opened.variables, opened.config.lora))
    assert not json.loads((tmp_path / "verified" / "verification.json").read_text())["passed"]

    # Read back by dew onto the same base: the run's adapters; onto another base: refused.
    fresh = opened.model.init(jax.random.key(9), jnp.zeros((1, 8), jnp.int32))
    same = with_base(fresh, Pretrained.load(tmp_path / "exported").variables)
    loaded = load_adapters(tmp_path / "adapters", base_model(opened.model), same)
    np.testing.assert_allclose(np.asarray(opened.model.apply(loaded, jnp.asarray(_tokens()))), adapted,
                               atol=1e-5, rtol=0)
    other = with_base(fresh, Pretrained.load(_base(tmp_path / "other", seed=1)).variables)
    with pytest.raises(AdapterBaseMismatchError, match=r"base of digest [0-9a-f]{64}.*base has digest [0-9a-f]{64}"):
        load_adapters(tmp_path / "adapters", base_model(opened.model), other)


@pytest.mark.slow
def test_a_qlora_run_merges_into_a_float_llama_with_its_logits(tmp_path, dew, dew_command):
    run = _train(dew, tmp_path, "nf4")
    adapted, _ = _dew_logits(run)
    written = dew("export", str(run), str(tmp_path / "merged"), cwd=tmp_path)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(merged), adapted, atol=1e-4, rtol=0)
    # The merge is onto the base the run trained on, nf4's rounding of it: said (it was not).
    assert ("adapters merged into an nf4 copy of the base, read back as floats: the run's own function, not the "
            "original base's weights plus the update") in written.stdout
    # Its adapters alone would go onto the float base, which is not the base it trained on: said.
    out = dew("export", "--adapters", str(run), str(tmp_path / "adapters"), cwd=tmp_path)
    assert "trained on an nf4 copy of the base: PEFT puts them onto the float base" in out.stdout
    # which --verify would count against them: refused, pointing at the merged export's verification
    refused = dew_command("export", "--adapters", "--verify", str(run), str(tmp_path / "checked"), cwd=tmp_path)
    assert refused.returncode == 2 and "trained its adapters on an nf4 copy of the base" in refused.stderr
    assert "Verify the merged export (drop --adapters)" in refused.stderr and not (tmp_path / "checked").exists()


def test_adapters_of_a_model_without_lora_are_refused(tmp_path, capsys):
    from dew.cli import main

    _base(tmp_path / "exported", seed=0)
    assert main(["export", "--adapters", str(tmp_path / "exported"), str(tmp_path / "out")]) == 2
    assert "has no lora section" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_options_an_export_would_ignore_are_refused(tmp_path, capsys):
    """--tolerance without --verify, a negative tolerance and --adapters in dew's layout did nothing
    (or failed a good export); each is refused before anything is read or written."""
    from dew.cli import main

    _base(tmp_path / "exported", seed=0)
    for extra, said in ((["--tolerance", "1e-6"], "add --verify, or drop --tolerance"),
                        (["--verify", "--tolerance", "-1"], "--tolerance -1.0 is no largest difference"),
                        (["--adapters", "--format", "dew"], "have no dew layout")):
        assert main(["export", str(tmp_path / "exported"), str(tmp_path / "out"), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("dew export: ") and said in err and err.count("\n") == 1, (extra, err)
    assert not (tmp_path / "out").exists()
    # --verify of a model only dew's own layout holds (a DiT): transformers has nothing to compare,
    # and the verification stopped with a TypeError traceback after writing the export.
    from dew.nn.dit import DiT

    dit = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
              mlp_features=32, num_classes=10)
    Pretrained(dit, dit.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,)),
                             jnp.zeros((1,), jnp.int32))).save(tmp_path / "dit")
    assert main(["export", str(tmp_path / "dit"), str(tmp_path / "out"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "DiT is written in dew's own layout, which transformers does not read; drop --verify" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    # Asked for in Hugging Face's layout, it says what to do: the advice was for quantized language models
    from dew.pretrained import NoExactCounterpartError

    with pytest.raises(NoExactCounterpartError, match=r"Export it in dew's own layout \(dew export without --format hf"):
        Pretrained.load(tmp_path / "dit").save(tmp_path / "out", format="hf")


@pytest.mark.slow
def test_adapters_of_a_run_started_from_another_run_say_how_peft_gets_that_base(tmp_path, dew, dew_command):
    """PEFT reads a base from a transformers directory; a run folder (init.run) is none, and its
    path as base_model_name_or_path made PEFT fail with "Unrecognized model"."""
    plain = [item for item in SMALL if not item.startswith("lora.")]
    dew("train", "tiny-lm", *plain, "trainer.checkpoint_dir=base", "trackers.0.directory=base", cwd=tmp_path)
    dew("train", "tiny-lm-qlora", *SMALL, "lora.base=float32", "init={run: base}", "trainer.checkpoint_dir=tuned",
        "trackers.0.directory=tuned", cwd=tmp_path)
    out = dew("export", "--adapters", "tuned", "adapters", cwd=tmp_path)
    assert "their base is the run base, which PEFT cannot read: export it with `dew export base DIR`" in out.stdout
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["base_model_name_or_path"] == ""
    unverified = dew_command("export", "--adapters", "--verify", "tuned", "unverified", cwd=tmp_path)
    assert unverified.returncode == 2 and "The adapters name no base directory" in unverified.stderr
    # Followed: the base exported, PEFT puts the adapters onto it and computes the run's model.
    from peft import PeftModel

    dew("export", "base", "base-exported", cwd=tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-exported").eval()
    with_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    adapted, _ = _dew_logits(tmp_path / "tuned")
    np.testing.assert_allclose(_torch_logits(with_peft), adapted, atol=1e-4, rtol=0)
    # A run started from the LoRA run itself: its checkpoints hold base and adapters apart. Said in
    # one line with the way that works (an InitializerMismatchError advised init.ignore, which did not).
    started = dew_command("train", "tiny-lm", *plain, "init={run: tuned}", "trainer.checkpoint_dir=again",
                          "trackers.0.directory=again", cwd=tmp_path)
    assert started.returncode == 2, started.stdout + started.stderr
    assert "init.run=tuned is a LoRA run" in started.stderr and "dew export tuned DIR" in started.stderr
