"""``dew export --verify``: transformers loads the export and must compute dew's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)


@pytest.mark.slow
def test_dew_export_verify_certifies_the_export_and_fails_above_the_tolerance(tmp_path, capsys):
    import jax
    import jax.numpy as jnp

    from dew.cli import main
    from dew.pretrained import Pretrained

    source = write_checkpoint("gemma2", tmp_path / "source", seed=3, redrawn=True)
    assert main(["export", str(source), str(tmp_path / "out"), "--verify"]) == 0
    assert "Verified: transformers' Gemma2ForCausalLM matches" in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert record["passed"] and record["architecture"] == "Gemma2ForCausalLM"
    assert record["versions"]["transformers"] == transformers.__version__
    assert record["versions"]["torch"] == torch.__version__
    assert len(record["prompts_sha256"]) == 64 and len(record["prompt_lengths"]) == 5  # 2 id rows, 3 texts

    # The recorded difference is the one an independent comparison finds on the first prompt.
    loaded = Pretrained.load(source)
    row = np.random.default_rng(0).integers(0, loaded.model.vocab_size, (1, 32))
    mine = np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(row, jnp.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(row)).logits.numpy()
    assert record["max_abs_difference"] <= 1e-4
    assert abs(np.abs(mine - theirs).max() - record["max_abs_difference"]) <= 1e-5
    # The tokenizer's chat template travels with the export.
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()

    # Past the tolerance: exit 1, the record says why, and the export stays whole.
    assert main(["export", str(source), str(tmp_path / "strict"), "--verify", "--tolerance", "1e-12"]) == 1
    assert "computes logits up to" in capsys.readouterr().err
    failed = json.loads((tmp_path / "strict" / "verification.json").read_text())
    assert not failed["passed"] and failed["max_abs_difference"] > 1e-12
    assert failed["prompts_sha256"] == record["prompts_sha256"]
    assert (tmp_path / "strict" / "model.safetensors").is_file()
