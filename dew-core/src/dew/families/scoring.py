"""A family's decoder that gives each text one score: transformers' ``<Family>ForSequenceClassification``
with one label, the layout published reward models ship in and TRL's reward trainer writes.

dew holds such a model as its ``reward_model`` objective trains one: the
decoder's own variables and, beside them, a linear map without bias from the
last hidden state (the final norm's output) to one number,
``params/reward_head/dense/kernel`` [hidden, 1]. The layout holds the same map
as ``score.weight`` [1, hidden] and no language-model head: a reward model
never reads its logits. transformers scores each row of a batch at its
rightmost token that is not the pad token, dew at each text's last token:
the same place unless a text ends with the pad token itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.families.convert import Entry, transposed
from dew.pretrained.errors import NoExactCounterpartError

if TYPE_CHECKING:
    from flax.linen import Module

    from dew.families.base import Family

__all__ = ["FEATURES", "HEAD", "TASK", "architecture", "is_scorer", "scored", "table", "task", "written"]

HEAD = "reward_head"
"""The top-level parameter that holds the score's linear map."""
TASK = "reward_model"
"""The objective whose pipeline scores text (registered by dew-objectives)."""
FEATURES = "final_norm"
"""The module whose output the layout's score reads: the decoder's last hidden state."""
_CAUSAL, _SCORES = "ForCausalLM", "ForSequenceClassification"
_NAMED = {"Gemma3ForCausalLM": "Gemma3TextForSequenceClassification"}  # the text model's own class


def architecture(name: str) -> str:
    """The sequence-classification class that goes with a causal-LM class name."""
    return _NAMED.get(name) or name.removesuffix(_CAUSAL) + _SCORES


def is_scorer(config: Mapping[str, Any], path: Path) -> bool:
    """Whether config.json names a sequence-classification model; one with other than one label
    (a classifier, not a reward model) is refused, naming its labels."""
    named = config.get("architectures") or []
    first = named if isinstance(named, str) else (named[0] if named else "")
    if not str(first).endswith(_SCORES):
        return False
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, Mapping) else config.get("num_labels", 2)
    if count != 1:
        raise NoExactCounterpartError(
            f"{path} describes a {first} with {count} labels, a classifier; dew reads sequence-"
            "classification checkpoints with one label (a reward model's score) and no classifier of "
            "several. Start from the causal language model its decoder was trained from instead.")
    return True


def table(family: Family, model: Module) -> dict[str, Entry]:
    """family's tensors for model, the language-model head replaced by the score."""
    out = {name: entry for name, entry in family.table(model).items() if name != "lm_head.weight"}
    embed = model.emb_features
    out["score.weight"] = Entry("score.weight", ((HEAD, "dense", "kernel"),), (1, embed), ((embed, 1),),
                                transposed())
    return out


def scored(model: Module, variables: Mapping[str, Any], task: Mapping[str, Any] | None) -> bool:
    """Whether variables are model's decoder with a score the layout holds: a reward-model task that
    reads the final norm, and a head of shape [hidden, 1] beside the decoder's own parameters."""
    if task is None or task.get("name") != TASK:
        return False
    if (task.get("fields") or {}).get("features_module", FEATURES) != FEATURES:
        return False
    head = variables.get("params", variables).get(HEAD)
    kernel = head.get("dense", {}).get("kernel") if isinstance(head, Mapping) else None
    return kernel is not None and tuple(kernel.shape) == (model.emb_features, 1)


def task(config: Mapping[str, Any], model: Module) -> dict[str, Any]:
    """The reward-model task a sequence-classification directory serves: the one dew recorded when
    it wrote the directory, else scoring texts as long as the model reads."""
    recorded = (config.get("dew") or {}).get("task")
    if isinstance(recorded, Mapping) and recorded.get("name") == TASK:
        return dict(recorded)
    return {"name": TASK, "fields": {"seq_len": int(model.max_seq_len)}}


def written(family: Family, config: dict[str, Any]) -> dict[str, Any]:
    """config.json of family's causal model as its one-label sequence-classification model."""
    return {**config, "architectures": [architecture(family.architecture)],
            "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
