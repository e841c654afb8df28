"""LoRA on a published family: adapters on Qwen 2 (q/k/v biases, grouped heads) merge into a model
transformers loads as Qwen 2, and go out as PEFT adapters the real peft puts onto transformers' base."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("qwix")
pytest.importorskip("peft")

from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)

TOKENS = np.random.default_rng(0).integers(0, 300, (2, 12)).astype(np.int32)


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_adapters_on_a_family_merge_and_export_as_peft_with_the_adapted_logits(tmp_path):
    from peft import PeftModel

    from dew.adapters.lora import Lora, merge_lora
    from dew.pretrained import Pretrained
    from dew.pretrained.peft import save_adapters
    from dew.testing.adapters import drawn_adapters

    source = write_checkpoint("qwen2", tmp_path / "base", seed=5, redrawn=True)
    loaded = Pretrained.load(source)
    spec = Lora(rank=4, targets=("attention", "mlp"))
    # B starts at zero; draw it so the adapters change what the model computes.
    adapted, variables = drawn_adapters(loaded.model, loaded.variables, spec, scale=0.05)
    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert np.abs(_torch_logits(base) - ours).max() > 1e-3  # the adapters matter: the checks can fail

    Pretrained(loaded.model, merge_lora(variables, spec)).save(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    np.testing.assert_allclose(_torch_logits(merged), ours, atol=1e-4, rtol=0)

    save_adapters(tmp_path / "adapters", loaded.model, variables, spec, base_name=str(source))
    with_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    np.testing.assert_allclose(_torch_logits(with_peft), ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_adapters_of_some_layers_export_with_those_layers_alone(tmp_path):
    """Adapters on layer 0's attention went out as target_modules q/k/v/o_proj with no layer: PEFT
    put adapters on every layer's projections, so its model held others than the run trained."""
    import json

    from peft import PeftModel

    from dew.adapters.lora import Lora
    from dew.pretrained import Pretrained
    from dew.pretrained.peft import save_adapters
    from dew.testing.adapters import drawn_adapters

    source = write_checkpoint("qwen2", tmp_path / "base", seed=5, redrawn=True)
    loaded = Pretrained.load(source)
    spec = Lora(rank=4, targets=(r".*layers_0/attention",))
    adapted, variables = drawn_adapters(loaded.model, loaded.variables, spec, scale=0.05)
    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    save_adapters(tmp_path / "adapters", loaded.model, variables, spec, base_name=str(source))
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [0]
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    adapted_modules = sorted(name for name, module in with_peft.named_modules() if hasattr(module, "lora_A")
                             and name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    assert adapted_modules and all(".layers.0." in name for name in adapted_modules), adapted_modules
    np.testing.assert_allclose(_torch_logits(with_peft), ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_adapters_on_other_modules_in_other_layers_export_as_exactly_those_modules(tmp_path):
    """Adapters on layer 0's attention and layer 1's MLP went out as every target name in every layer
    (no layers_to_transform fits both): PEFT added adapters on the 8 other projections, warning of
    missing adapter keys, so its model held others than the run trained. They go out as a pattern
    of those modules' names, which PEFT matches whole, and dew reads back."""
    import json
    import warnings

    from peft import PeftModel

    from dew.adapters.lora import Lora
    from dew.pretrained import Pretrained
    from dew.pretrained.peft import load_adapters, save_adapters
    from dew.testing.adapters import drawn_adapters

    source = write_checkpoint("qwen2", tmp_path / "base", seed=5, redrawn=True)
    loaded = Pretrained.load(source)
    spec = Lora(rank=2, alpha=4, targets=(r".*layers_0/attention", r".*layers_1/mlp"))
    adapted, variables = drawn_adapters(loaded.model, loaded.variables, spec, scale=0.05)
    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    save_adapters(tmp_path / "adapters", loaded.model, variables, spec, base_name=str(source))
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], str) and "layers_to_transform" not in config
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    assert not [w for w in warned if "adapter keys" in str(w.message)], [str(w.message) for w in warned]
    adapted_modules = sorted(name.removeprefix("base_model.model.") for name, module in with_peft.named_modules()
                             if hasattr(module, "lora_A"))
    assert adapted_modules == [f"model.layers.0.self_attn.{p}_proj" for p in ("k", "o", "q", "v")] + \
        [f"model.layers.1.mlp.{p}_proj" for p in ("down", "gate", "up")]
    np.testing.assert_allclose(_torch_logits(with_peft), ours, atol=1e-4, rtol=0)
    # dew reads them back onto its own adapted model, the adapters as they were
    cleared = jax.tree_util.tree_map_with_path(  # the adapters zeroed, the base kept
        lambda path, leaf: jnp.zeros_like(leaf) if "_lora_" in jax.tree_util.keystr(path) else leaf, variables)
    read = load_adapters(tmp_path / "adapters", adapted, cleared, spec=spec)
    np.testing.assert_allclose(np.asarray(jax.jit(adapted.apply)(read, jnp.asarray(TOKENS))), ours, atol=1e-5)
