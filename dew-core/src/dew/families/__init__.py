"""Published decoder families: each a preset of dew's decoder parts plus one converter.

``models.build("qwen3", preset="0.6b")`` builds dew's CausalTransformer
with Qwen 3's parts at a published size (config only: nothing is
downloaded). ``Pretrained.load`` picks the family a ``config.json`` names
(its ``architectures``), reads it through that family's converter table and
``Pretrained.save`` writes the same layout back, which transformers loads as
that family. One decoder computes every family; the families differ only in
data (see ``dew.families.base.Family``).

>>> from dew.families import family
>>> qwen3 = family("qwen3")
>>> model = qwen3.build("0.6b")
>>> model.qk_norm, model.num_layers, model.tie_embeddings
('head', 28, True)
>>> sorted(qwen3.presets)[:3]
['0.6b', '1.7b', '14b']
"""

from dew.families.base import (
    FAMILIES,
    Family,
    PresetError,
    architectures,
    check_same_function,
    family,
    for_config,
    function_fields,
    of_model,
)

__all__ = [
    "FAMILIES",
    "Family",
    "PresetError",
    "architectures",
    "check_same_function",
    "family",
    "for_config",
    "function_fields",
    "of_model",
]
