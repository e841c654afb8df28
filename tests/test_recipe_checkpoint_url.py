"""A recipe's checkpoint URL reaches Checkpoints unchanged (the recipe names the objectives' and data's components)."""

from __future__ import annotations


def test_a_recipes_checkpoint_url_reaches_checkpoints_unchanged():
    from dew.recipes.config import RunConfig

    config = RunConfig.model_validate({
        "model": {"name": "causal_transformer", "vocab_size": 8, "emb_features": 8, "num_layers": 1,
                  "num_heads": 2, "mlp_features": 8, "max_seq_len": 8},
        "objective": {"name": "lm", "seq_len": 4},
        "data": {"name": "token_windows", "files": "x.txt", "length": 4, "batch": 8},
        "trainer": {"steps": 1, "checkpoint_dir": "gs://a-bucket/runs/one"},
    })
    assert str(config.trainer.build_checkpoints().directory) == "gs://a-bucket/runs/one"
