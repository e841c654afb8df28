"""Knowledge distillation: a small language model learns a larger frozen one's distributions.

The variables hold the student (trained) beside the teacher (frozen, declared
through ``Objective.frozen`` so the trainer keeps one copy of it and no
optimizer state) and, when hidden states are matched, a learned projection
from the student's width to the teacher's::

    {"params": {"student": ..., "teacher": ..., "projection": ...}}

The loss at temperature T is ``T**2 * (forward * KL(p_T || q_T) + reverse *
KL(q_T || p_T)) + labels * CE(targets, q_1) + hidden * mean_d (P h_s - h_t)_d**2``,
where p_T and q_T are the teacher's and the student's softmax of logits / T
and each term is a mean over predicted tokens (the T**2 keeps the gradient's
scale independent of T, as Hinton et al. propose).

The teacher's weights reach the run as the Trainer's ``initializer``:
``Trainer(objective, ..., initializer=objective.initializer())`` when the
objective names where they are (``teacher_checkpoint``, another run's
checkpoint directory, or ``teacher_pretrained``, a directory ``dew export``,
``Pretrained.save`` or transformers wrote); or
``objective.teacher_from(ParamsFrom(run))`` or ``objective.teacher_from(variables)``
for weights at hand. The student and projection start from the run's own init
key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data.base import vocab_size_of
from dew.errors import DewError
from dew.nn import sharding as axes
from dew.nn.features import submodule_names
from dew.nn.kinds import CausalDecoder
from dew.objectives.base import (
    Aux,
    Batch,
    Mean,
    MeanMetric,
    Metric,
    Objective,
    Step,
    Variables,
    under,
)
from dew.objectives.lm import (
    BatchShapeError,
    MissingBatchKeyError,
    Tokenizer,
    argmax_hits,
    scored_targets,
    segment_positions,
)
from dew.sampling import Sampling, TextGeneration
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.pretrained import Pretrained
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["DistillationObjective", "TeacherVocabularyError", "distillation_terms"]


class TeacherVocabularyError(DewError, ValueError):
    """The student and the teacher score different vocabularies, so their distributions cannot be compared."""


def distillation_terms(student_logits: jax.Array, teacher_logits: jax.Array,
                       temperature: float) -> tuple[jax.Array, jax.Array]:
    """Per-position forward KL(p_T || q_T) and reverse KL(q_T || p_T) at a temperature.

    >>> import jax.numpy as jnp
    >>> same = jnp.log(jnp.asarray([[0.25, 0.75]]))
    >>> [float(x[0]) for x in distillation_terms(same, same, 2.0)]
    [0.0, 0.0]
    """
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    forward = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    reverse = jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)
    return forward, reverse


class _Projection(nn.Module):
    """A learned map from the student's hidden width to the teacher's."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = axes.param(self, "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                            (axes.EMBED, axes.MLP))
        return jnp.einsum("bte,ef->btf", x, kernel)


_FINAL_NORM = "final_norm"  # the submodule whose output the hidden match compares by default


@dataclass(frozen=True)
class DistillationObjective(Objective):
    """A student causal language model distilled from a frozen teacher over token windows.

    model is the student; teacher a model of the same vocabulary (usually
    larger), or in a recipe the teacher's model config ({"name": ..., fields}).
    Its weights come from teacher_checkpoint (the directory of the run that
    trained it) or teacher_pretrained (a Hugging Face Llama directory, as
    ``dew export`` writes; teacher may then be None, and is read from its
    config.json). Both models read windows of seq_len + 1 ids under "text"
    (inputs the first seq_len, targets the last seq_len, as LMObjective's), an
    optional "loss_mask" of 0/1 that leaves positions out, aligned with text
    [batch, seq_len + 1] as dew's readers write it or with the targets
    [batch, seq_len], and optional "segment_ids" [batch, seq_len + 1] of packed rows.
    forward and reverse weigh the two KL directions, labels the hard-label
    cross-entropy, hidden the match of hidden states: the output of the
    submodule named hidden_layer in each model (the final norm by default),
    the student's through a learned projection. tokenizer (a recipe's reader
    supplies it) lets ``pipeline`` turn the student into text generation.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder
    heads: ClassVar[tuple[str, ...]] = ("projection",)
    fills_its_start: ClassVar[bool] = True  # its initializer reads the teacher; init draws the student

    model: nn.Module
    teacher: nn.Module | Mapping[str, Any] | None
    seq_len: int
    _: KW_ONLY
    teacher_checkpoint: str | None = None
    teacher_pretrained: str | None = None
    temperature: float = 2.0
    forward: float = 1.0
    reverse: float = 0.0
    labels: float = 0.0
    hidden: float = 0.0
    hidden_layer: str = _FINAL_NORM
    tokenizer: Tokenizer | None = None

    frozen = staticmethod(under("params/teacher"))

    def __post_init__(self) -> None:
        if self.teacher_checkpoint is not None and self.teacher_pretrained is not None:
            raise ValueError("DistillationObjective reads the teacher's weights from teacher_checkpoint or from "
                             "teacher_pretrained; set one of the two.")
        if isinstance(self.teacher, Mapping):  # a recipe's model config: {"name": ..., fields}
            from dew import models

            fields = dict(self.teacher)
            object.__setattr__(self, "teacher", models.build(fields.pop("name"), **fields))
        if self.teacher_pretrained is not None:
            object.__setattr__(self, "teacher", _pretrained_teacher(self.teacher_pretrained, self.teacher))
        elif self.teacher is None:
            raise ValueError("DistillationObjective needs a teacher: a model (or its config), or teacher_pretrained "
                             "naming a directory that `dew export` or transformers wrote.")
        for role, model in (("teacher", self.teacher), ("student", self.model)):
            limit = getattr(model, "max_seq_len", None)  # any flax Module: unchecked if it has none
            if limit is not None and self.seq_len > limit:
                raise ValueError(f"DistillationObjective.seq_len={self.seq_len} exceeds the {role}'s max_seq_len="
                                 f"{limit}; shorten the windows or build the {role} for longer ones.")
        if not self.temperature > 0:  # NaN too
            raise ValueError(f"DistillationObjective.temperature must be positive, got {self.temperature}.")
        if min(self.forward, self.reverse, self.labels, self.hidden) < 0:
            raise ValueError("DistillationObjective's weights (forward, reverse, labels, hidden) must be >= 0.")
        if self.forward + self.reverse + self.labels + self.hidden == 0:
            raise ValueError("DistillationObjective needs a positive weight on forward, reverse, labels or hidden.")
        if self.hidden == 0 and self.hidden_layer != _FINAL_NORM:
            raise ValueError(f"DistillationObjective.hidden_layer={self.hidden_layer!r} names the layer whose "
                             "output the hidden match compares, which runs only with hidden > 0; set hidden "
                             "to a weight, or leave hidden_layer out.")
        if self.hidden > 0:
            for role, model in (("student", self.model), ("teacher", self.teacher)):
                names = submodule_names(model, min(self.seq_len, 4), top=True)
                if self.hidden_layer not in names:
                    raise ValueError(f"DistillationObjective.hidden_layer={self.hidden_layer!r} names no "
                                     f"top-level submodule of the {role}; its submodules are "
                                     f"{', '.join(sorted(names))}.")
        # Any flax Modules: a pair that does not say its vocabularies is not checked.
        student, teacher = getattr(self.model, "vocab_size", None), getattr(self.teacher, "vocab_size", None)
        if student is not None and teacher is not None and student != teacher:
            raise TeacherVocabularyError(_vocabulary_message(student, teacher, vocab_size_of(self.tokenizer)))

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """A recipe's teacher with nothing to read its weights from (dew.registry.ChecksFields): the run
        would draw them at random and distill the student from noise. In code, the Trainer's
        initializer may bring them instead."""
        if fields.get("teacher_checkpoint") is None and fields.get("teacher_pretrained") is None:
            return [(("teacher_checkpoint",), "the teacher's weights come from nowhere, so the student would "
                     "learn a randomly drawn teacher: set objective.teacher_checkpoint to the checkpoint "
                     "directory of the run that trained it, or objective.teacher_pretrained to a directory "
                     "`dew export` or transformers wrote.")]
        return []

    # -- the teacher's weights ---------------------------------------------------------
    def initializer(self) -> WeightSource | None:
        """The teacher read from teacher_checkpoint or teacher_pretrained, or None when neither is set.

        A recipe's run passes it to the Trainer (``objective_parts``); in code,
        pass it (or ``objective.teacher_from(...)``) as the Trainer's initializer.
        """
        if self.teacher_pretrained is not None:

            def read_pretrained(abstract: Variables) -> Variables:
                return {"params": self._pretrained_teacher(weights=True).variables["params"]}

            return self.teacher_from(read_pretrained)
        if self.teacher_checkpoint is None:
            return None
        from dew.training.initializers import InitializerMismatchError, ParamsFrom

        checkpoint = self.teacher_checkpoint
        run = ParamsFrom(_absolute(checkpoint))

        def read_run(abstract: Variables) -> Variables:
            try:
                return run(abstract)
            except InitializerMismatchError as error:  # its advice (init.within, init.ignore) is the student's
                raise InitializerMismatchError(
                    f"objective.teacher_checkpoint={checkpoint}: {error.mismatch or error} A teacher is read "
                    "whole from a run's checkpoint; to teach with a model the run kept beside others (a "
                    f"distillation run's student), export it (dew export {checkpoint} DIR) and set "
                    "objective.teacher_pretrained=DIR, or declare objective.teacher as the run's model.",
                    mismatch=error.mismatch) from None

        return self.teacher_from(read_run)

    def check_own_weights(self) -> None:
        """Refuse the teacher_pretrained the initializer would refuse, reading its config.json and
        tensor headers alone (dew.objectives.base.ChecksOwnWeights): a directory that is missing, holds
        another model than the teacher, or comes with another tokenizer than the student's data. A
        teacher_checkpoint is another run, which ``dew train --check`` does not read."""
        if self.teacher_pretrained is not None:
            self._pretrained_teacher(weights=False)

    def _pretrained_teacher(self, *, weights: bool) -> Pretrained:
        """teacher_pretrained read for the teacher (weights: its tensors too, else their headers alone),
        refused where its tokenizer is not the student's."""
        from dew.data.hf_tokenizer import vocabulary
        from dew.pretrained import Pretrained

        assert self.teacher_pretrained is not None  # the initializer and the check read it only when set
        directory, teacher = _absolute(self.teacher_pretrained), self.teacher
        # Any flax Module: a family without these fields takes the directory's own.
        read = Pretrained.load if weights else Pretrained.describe
        loaded = read(directory, max_seq_len=getattr(teacher, "max_seq_len", None),
                      param_dtype=getattr(teacher, "param_dtype", None),
                      scan_layers=bool(getattr(teacher, "scan_layers", False)))
        if (loaded.tokenizer is not None and self.tokenizer is not None
                and vocabulary(loaded.tokenizer) != vocabulary(self.tokenizer)):
            raise TeacherVocabularyError(
                f"The teacher in {directory} comes with another tokenizer than the student's data: the "
                "same text is other ids to it (a vocabulary of the same size can still differ, as "
                "Llama 2's and Mistral's do). " + _vocabulary_advice())
        return loaded

    def recorded_fields(self) -> Mapping[str, Any]:
        """The teacher's architecture when it was read from teacher_pretrained's config.json, so a
        run rebuilds this objective (to resume, generate, evaluate or export) once that export
        has moved: the weights themselves are in the run's checkpoints."""
        if self.teacher_pretrained is None:
            return {}
        from dew.recipes.components import model_section

        return {"teacher": model_section("causal_transformer", self.teacher)}

    def starting_weights(self, source: WeightSource) -> WeightSource:
        """The student read from source (a recipe's init: another run's or a pretrained model's
        weights, the student's own shape); the teacher still comes from teacher_checkpoint or
        teacher_pretrained, never from init."""
        teacher = self.initializer()

        def read(abstract: Variables) -> Variables:
            student = nn.meta.unbox(source({"params": abstract["params"]["student"]}))
            if "params" not in student:
                raise ValueError(f"The student's starting weights hold collections {sorted(student)}; "
                                 "expected Flax variables with a 'params' collection.")
            params = {"student": student["params"]}
            if callable(teacher):
                params.update(teacher(abstract)["params"])
            return {"params": params}

        return read

    def teacher_from(self, source: Variables | WeightSource) -> WeightSource:
        """A Trainer initializer that reads the teacher from source and leaves the rest to init.

        source is a teacher variables tree ({"params": ...}) or a weight
        source such as ``ParamsFrom(run_directory)``, called with the
        teacher's abstract variables.
        """

        def read(abstract: Variables) -> Variables:
            teacher_abstract = {"params": abstract["params"]["teacher"]}
            weights = source(teacher_abstract) if callable(source) else source
            weights = nn.meta.unbox(weights)
            if "params" not in weights:
                raise ValueError(f"The teacher's weights hold collections {sorted(weights)}; expected "
                                 "Flax variables with a 'params' collection.")
            self._check_teacher_vocabulary(weights["params"], teacher_abstract["params"])
            from dew.training.initializers import compare_trees

            # Every leaf of the declared teacher, and no other, of its shape: none is left to init.
            compare_trees(nn.meta.unbox(teacher_abstract)["params"], weights["params"],
                          what="The teacher's weights")
            return {"params": {"teacher": weights["params"]}}

        return read

    def _check_teacher_vocabulary(self, weights: Mapping[str, PyTree], abstract: Mapping[str, PyTree]) -> None:
        given, expected = _vocabulary_of(weights), _vocabulary_of(abstract)
        if given is not None and expected is not None and given != expected:
            raise TeacherVocabularyError(
                f"The teacher's weights score a vocabulary of {given} tokens, but the student "
                f"scores {expected}. " + _vocabulary_advice()
            )

    # -- the Objective protocol ------------------------------------------------------------
    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """Student, teacher and projection; given variables fill what they hold (the teacher alone, or all)."""
        given = dict((variables or {}).get("params", {}))
        student_key, teacher_key, projection_key = jax.random.split(key, 3)
        tokens = jnp.zeros((1, self.seq_len), jnp.int32)
        params: dict[str, PyTree] = {}
        params["student"] = given.get("student") or self.model.init(student_key, tokens)["params"]
        teacher = self.teacher
        assert teacher is not None and not isinstance(teacher, Mapping)  # __post_init__ built it
        params["teacher"] = given.get("teacher") or teacher.init(teacher_key, tokens)["params"]
        if self.hidden:
            if "projection" in given:
                params["projection"] = given["projection"]
            else:
                student_width = self._hidden(params["student"], self.model, tokens).shape[-1]
                teacher_width = self._hidden(params["teacher"], self.teacher, tokens).shape[-1]
                params["projection"] = _Projection(teacher_width).init(
                    projection_key, jnp.zeros((1, 1, student_width)))["params"]
        return {"params": params}

    def required_keys(self) -> Sequence[str]:
        return ("text",)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """The weighted sum of the KL terms, the label loss and the hidden match, per scored token."""
        inputs, targets, weights, read = self._windows(batch)
        params = variables["params"]
        student_logits, student_hidden = self._apply(params["student"], self.model, inputs, read)
        teacher_logits, teacher_hidden = self._apply(params["teacher"], self.teacher, inputs, read)
        teacher_logits = jax.lax.stop_gradient(teacher_logits)
        if student_logits.shape[-1] != teacher_logits.shape[-1]:
            raise TeacherVocabularyError(_vocabulary_message(student_logits.shape[-1], teacher_logits.shape[-1]))
        forward, reverse = distillation_terms(student_logits, teacher_logits, self.temperature)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(student_logits, targets)
        per_token = self.temperature**2 * (self.forward * forward + self.reverse * reverse)
        per_token = per_token + self.labels * cross_entropy
        metrics: dict[str, Mean | jax.Array] = {
            "kl_forward": Mean.of(forward, weights),
            "kl_reverse": Mean.of(reverse, weights),
            "cross_entropy": Mean.of(cross_entropy, weights),
            "agreement": Mean.of(argmax_hits(student_logits, jnp.argmax(teacher_logits, -1)), weights),
        }
        if self.hidden:
            assert teacher_hidden is not None  # _apply returns the hidden states when hidden is set
            projected = _Projection(teacher_hidden.shape[-1]).apply({"params": params["projection"]}, student_hidden)
            error = jnp.mean((projected - jax.lax.stop_gradient(teacher_hidden)) ** 2, axis=-1)
            per_token = per_token + self.hidden * error
            metrics["hidden_error"] = Mean.of(error, weights)
        if weights is not None:  # a masked position contributes an exact zero, never a NaN
            per_token = jnp.where(weights, per_token, 0.0)
        return Mean.of(per_token, weights), Aux(metrics=metrics)

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        loss, aux = self.loss(variables, batch, step)
        return {"loss": loss, **aux.metrics}

    def metrics(self) -> tuple[Metric, ...]:
        """The validation metrics evaluate supports: the loss, both KLs, cross-entropy, agreement and
        (with hidden set) the hidden error."""
        names = ("loss", "kl_forward", "kl_reverse", "cross_entropy", "agreement") + (
            ("hidden_error",) if self.hidden else ())
        return tuple(MeanMetric(name) for name in names)

    def pipeline(self, state: TrainState | Variables, *,
                 sampling: Sampling | Mapping[str, Any] | None = None) -> TextGeneration:
        """The distilled student as text generation (its EMA copy when the run kept one).

        state is a TrainState or a variables tree holding ``params/student``;
        the teacher and the projection stay behind. Greedy unless sampling (a
        Sampling or its fields) is given; ``save`` writes the student through
        Pretrained.save.
        """
        from dew.objectives.inference import variables_of
        from dew.objectives.policy import policy_pipeline

        variables = variables_of(state)
        student = variables.get("params", {}).get("student")
        if student is None:
            raise ValueError("DistillationObjective.pipeline needs variables with params/student; got "
                             f"{sorted(variables.get('params', variables))}.")
        return policy_pipeline(self.model, {"params": student}, self.tokenizer, sampling=sampling)

    # -- internals -----------------------------------------------------------------------------
    def _apply(self, params: PyTree, model: nn.Module, inputs: jax.Array,
               read: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """model's logits on inputs (each packed document on its own, given its segment ids read),
        and the hidden states it matches when hidden is set."""
        packed: dict[str, Any] = {} if read is None else {"segment_ids": read}
        positions = () if read is None else (segment_positions(read),)
        if not self.hidden:
            return model.apply({"params": params}, inputs, *positions, **packed), None
        logits, state = model.apply({"params": params}, inputs, *positions, **packed,
                                    capture_intermediates=self._captures)
        return logits, self._captured(state, model)

    def _hidden(self, params: PyTree, model: nn.Module, inputs: jax.Array) -> jax.Array:
        _, state = model.apply({"params": params}, inputs, capture_intermediates=self._captures)
        return self._captured(state, model)

    def _captures(self, module: nn.Module, method: str) -> bool:
        return method == "__call__" and module.name == self.hidden_layer

    def _captured(self, state: Variables, model: nn.Module) -> jax.Array:
        found = state.get("intermediates", {}).get(self.hidden_layer, {}).get("__call__")
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no submodule named {self.hidden_layer!r} whose output "
                "DistillationObjective(hidden_layer=...) could match; name one of its top-level submodules."
            )
        return found[0]

    def _windows(self, batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """Inputs, targets, which targets count (None: all) and the inputs' segment ids (None: none)."""
        if "text" not in batch:
            raise MissingBatchKeyError(
                f"DistillationObjective reads token windows under 'text', but the batch has keys "
                f"{sorted(batch)}; yield {{'text': int32 [batch, {self.seq_len + 1}]}}."
            )
        text = batch["text"]
        if np.ndim(text) != 2 or np.shape(text)[1] != self.seq_len + 1:
            raise BatchShapeError(
                f"Batch key 'text' has shape {tuple(np.shape(text))}, but "
                f"DistillationObjective(seq_len={self.seq_len}) expects (batch, {self.seq_len + 1})."
            )
        text = jnp.asarray(text, jnp.int32)
        mask = batch.get("loss_mask")
        if mask is not None and tuple(np.shape(mask)) == tuple(text[:, 1:].shape):
            # a mask of the targets, as this objective took it before: aligned with text here
            batch = {**batch, "loss_mask": jnp.pad(jnp.asarray(mask), ((0, 0), (1, 0)))}
        weights, read = scored_targets(batch, text)  # loss_mask and segment_ids as LMObjective reads them
        return text[:, :-1], text[:, 1:], weights, read


def _absolute(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _pretrained_teacher(directory: str | os.PathLike[str], given: nn.Module | None) -> nn.Module:
    """The teacher module directory's config.json describes (given, when set, must compute the same function).

    Only the config is read here; the weights are read when the run starts (``initializer``).
    A given teacher is taken as it is when directory holds no config.json: a run records the
    teacher it read (``recorded_fields``) and is rebuilt from its run.json after the export
    moved, and a fresh run's ``initializer`` still refuses a missing directory before training.
    """
    import json

    from dew.pretrained import (
        CONFIG_FILE,
        ConfigurationMismatchError,
        NoPretrainedModelError,
        check_same_function,
        model_from_config,
    )

    path = os.path.join(_absolute(directory), CONFIG_FILE)
    if not os.path.isfile(path):
        if given is not None:  # a recorded run rebuilt after its export moved: its weights are in the run
            return given
        raise NoPretrainedModelError(  # dew's own error: said in one line, where a builtin one was a traceback
            f"DistillationObjective.teacher_pretrained: {os.path.dirname(path)} holds no {CONFIG_FILE}; point at "
            "a directory that `dew export`, Pretrained.save or transformers' save_pretrained wrote."
        )
    with open(path) as handle:
        config = json.load(handle)
    if given is None:
        return model_from_config(config)
    try:
        check_same_function(given, model_from_config(config), f"teacher_pretrained {directory}",
                            prefix="objective.teacher.")  # the advice names the teacher's fields
    except ConfigurationMismatchError as error:
        raise ConfigurationMismatchError(
            f"{error} Or leave teacher out (None): it is then read from config.json.") from None
    return given


def _vocabulary_of(params: Mapping[str, PyTree]) -> int | None:
    embed = params.get("embed", {}).get("embedding") if isinstance(params.get("embed"), Mapping) else None
    return None if embed is None else int(embed.shape[0])


def _vocabulary_advice() -> str:
    return ("Distillation compares the two distributions token by token, so both must use the same "
            "tokenizer; pick a teacher trained with the student's tokenizer or build the student with "
            "the teacher's vocab_size.")


def _vocabulary_message(student: int, teacher: int, spelt: int | None = None) -> str:
    if spelt is not None and spelt <= min(student, teacher):  # one is padded past the tokenizer's ids
        return (f"The student's vocabulary has {student} tokens but the teacher's has {teacher}; both cover "
                f"the tokenizer's {spelt} ids, so the larger is padded past them. The two distributions are "
                f"compared id by id: build the student with the teacher's vocab_size ({teacher}).")
    return f"The student's vocabulary has {student} tokens but the teacher's has {teacher}. " + _vocabulary_advice()
