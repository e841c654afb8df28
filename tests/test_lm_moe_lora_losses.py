"""dew-objectives' LMObjective on a LoRA-adapted mixture-of-experts family: the loss is the
cross entropy plus the routers' balance and z terms, as for the base model. Moved from
dew-core/tests/test_families_moe_lora.py (the objective is dew-objectives')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("qwix")

from dew.adapters.lora import Lora  # noqa: E402
from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)
from dew.pretrained import Pretrained  # noqa: E402
from dew.testing.adapters import drawn_adapters  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 300, (2, 12)).astype(np.int32)
SPEC = Lora(rank=2, alpha=6.0, targets=("mlp",))


@pytest.fixture(scope="module")
def adapted_mixtral(tmp_path_factory) -> tuple[object, dict]:
    """The tiny Mixtral of dew-core/tests/test_families_moe_lora.py, every adapter drawn away from zero."""
    loaded = Pretrained.load(write_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), seed=3, redrawn=True))
    return drawn_adapters(loaded.model, loaded.variables, SPEC, scale=0.1)


@pytest.mark.slow
def test_the_adapted_experts_train_on_the_balance_and_z_losses_too(adapted_mixtral):
    """An adapted MoE model's LM loss is the cross-entropy plus the routers' balance and z terms."""
    from dew.nn.moe import moe_statistics
    from dew.objectives.base import Step
    from dew.objectives.lm import LMObjective

    model, variables = adapted_mixtral
    objective = LMObjective(model=model, seq_len=11)
    zero = jnp.int32(0)
    loss, aux = objective.loss(variables, {"text": jnp.asarray(TOKENS)},
                               Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0)))
    logits, sown = model.apply(variables, jnp.asarray(TOKENS[:, :-1]), mutable=["moe"])
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    cross_entropy = -np.take_along_axis(logp, TOKENS[:, 1:, None], -1).mean()
    routing = {k: float(v) for k, v in moe_statistics(sown).items()}
    assert routing["load_balancing_loss"] > 0 and "router_z_loss" in routing
    expected = cross_entropy + 0.01 * routing["load_balancing_loss"] + 1e-3 * routing["router_z_loss"]
    assert abs(float(loss.total / loss.count) - expected) <= 1e-5 * expected
    assert abs(float(aux.metrics["load_balancing_loss"].total / aux.metrics["load_balancing_loss"].count)
               - routing["load_balancing_loss"]) <= 1e-6
