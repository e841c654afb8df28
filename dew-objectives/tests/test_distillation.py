"""DistillationObjective: the loss against a hand-written formula, learning from a trained teacher,
a teacher read from another run's checkpoint, and teachers that cannot be compared."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.distillation import DistillationObjective, TeacherVocabularyError
from dew.objectives.lm import LMObjective
from dew.registry import objectives
from dew.training.initializers import ParamsFrom

from .tuning_helpers import (
    SEQ,
    VOCAB,
    counting_dataset,
    markov_dataset,
    markov_rows,
    student_model,
    teacher_model,
)

STEP = Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0), key=jax.random.key(0))


def numpy_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_registered_as_distillation():
    assert objectives.load("distillation") is DistillationObjective


@pytest.mark.slow  # about 17 s on a quiet 2-core machine: the model's ops compile one by one (eager)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_loss_and_gradient_equal_the_hand_written_formula(temperature):
    objective = DistillationObjective(student_model(), teacher_model(), SEQ, temperature=temperature,
                                      forward=0.7, reverse=0.4, labels=0.3)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    batch = {"text": markov_rows(0, rows=3)}
    loss, aux = objective.loss(variables, batch, STEP)

    inputs, targets = batch["text"][:, :-1], batch["text"][:, 1:]
    s = np.asarray(student_model().apply({"params": variables["params"]["student"]}, inputs), np.float64)
    t = np.asarray(teacher_model().apply({"params": variables["params"]["teacher"]}, inputs), np.float64)
    log_q, log_p = numpy_log_softmax(s / temperature), numpy_log_softmax(t / temperature)
    q, p = np.exp(log_q), np.exp(log_p)
    forward = (p * (log_p - log_q)).sum(-1)
    reverse = (q * (log_q - log_p)).sum(-1)
    ce = -np.take_along_axis(numpy_log_softmax(s), targets[..., None], -1)[..., 0]
    expected = temperature**2 * (0.7 * forward + 0.4 * reverse) + 0.3 * ce
    np.testing.assert_allclose(float(loss.value), expected.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux.metrics["kl_forward"].value), forward.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux.metrics["kl_reverse"].value), reverse.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux.metrics["cross_entropy"].value), ce.mean(), rtol=1e-5)
    # Agreement: the share of predicted tokens where the student's likeliest token is the teacher's.
    agreement = (s.argmax(-1) == t.argmax(-1)).mean()
    assert 0 < agreement < 1  # the two random models agree on some tokens and not others
    np.testing.assert_allclose(float(aux.metrics["agreement"].value), agreement, rtol=1e-6)

    # The gradient with respect to the student's logits, written out:
    #  d/ds T^2 KL(p||q) = T (q - p);  d/ds T^2 KL(q||p) = T q (log q - log p - KL(q||p));
    #  d/ds CE = softmax(s) - onehot(targets).
    def through_logits(logits):
        from dew.objectives.distillation import distillation_terms
        f, r = distillation_terms(logits, jnp.asarray(t, jnp.float32), temperature)
        c = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(temperature**2 * (0.7 * f + 0.4 * r) + 0.3 * c)

    grad = np.asarray(jax.grad(through_logits)(jnp.asarray(s, jnp.float32)), np.float64)
    onehot = np.eye(s.shape[-1])[targets]
    expected_grad = (0.7 * temperature * (q - p)
                     + 0.4 * temperature * q * (log_q - log_p - reverse[..., None])
                     + 0.3 * (np.exp(numpy_log_softmax(s)) - onehot))
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)

    # And the objective's gradient reaches the student only.
    grads = jax.grad(lambda v: objective.loss(v, batch, STEP)[0].total)(variables)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads["params"]["teacher"]))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads["params"]["student"]))


def test_packed_masked_rows_score_each_document_alone_and_only_its_marked_targets():
    """SFT data gives loss_mask and segment_ids aligned with text ([B, S + 1]): the mask was taken
    unshifted (a shape error on every prompt/completion or chat batch) and the segments not at all
    (documents attended across the boundary). Each document is run alone here, by hand."""
    objective = DistillationObjective(student_model(), teacher_model(), SEQ, temperature=1.0, forward=0.6,
                                      labels=0.4)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    text = markov_rows(3, rows=2)
    segments = np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13], np.int32)
    mask = np.ones_like(text)
    mask[0, :3] = 0  # a prompt the loss leaves out
    mask[1, 4:7] = 0
    loss, aux = objective.loss(variables, {"text": text, "segment_ids": segments, "loss_mask": mask}, STEP)

    totals, count = 0.0, 0
    for row in range(2):
        for segment in (1, 2):
            where = np.flatnonzero(segments[row] == segment)
            if len(where) < 2:
                continue
            ids = text[row, where]
            s = np.asarray(student_model().apply({"params": variables["params"]["student"]}, ids[None, :-1]),
                           np.float64)[0]
            t = np.asarray(teacher_model().apply({"params": variables["params"]["teacher"]}, ids[None, :-1]),
                           np.float64)[0]
            log_q, log_p = numpy_log_softmax(s), numpy_log_softmax(t)
            forward = (np.exp(log_p) * (log_p - log_q)).sum(-1)
            ce = -np.take_along_axis(log_q, ids[1:, None], -1)[:, 0]
            scored = mask[row, where[1:]] != 0  # a target counts where its own mask is set
            totals += float(((0.6 * forward + 0.4 * ce) * scored).sum())
            count += int(scored.sum())
    assert float(loss.count) == count
    np.testing.assert_allclose(float(loss.value), totals / count, rtol=1e-5)
    assert float(aux.metrics["kl_forward"].count) == count


@pytest.mark.slow
def test_hidden_states_match_through_a_learned_projection():
    objective = DistillationObjective(student_model(), teacher_model(), SEQ, forward=0.0, hidden=1.0)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    kernel = variables["params"]["projection"]["kernel"]
    assert kernel.shape == (8, 32)
    batch = {"text": markov_rows(1, rows=2)}
    loss, aux = objective.loss(variables, batch, STEP)

    def final_norm(model, params):
        _, state = model.apply({"params": params}, batch["text"][:, :-1],
                               capture_intermediates=lambda m, name: m.name == "final_norm")
        return np.asarray(state["intermediates"]["final_norm"]["__call__"][0])

    hs = final_norm(student_model(), variables["params"]["student"])
    ht = final_norm(teacher_model(), variables["params"]["teacher"])
    expected = ((hs @ np.asarray(kernel) - ht) ** 2).mean(-1).mean()
    np.testing.assert_allclose(float(loss.value), expected, rtol=1e-5)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both():
    with pytest.raises(TeacherVocabularyError, match=r"student's vocabulary has 12 tokens but the teacher's has 16"):
        DistillationObjective(student_model(vocab=12), teacher_model(), SEQ)
    # A tokenizer both cover: the teacher's is padded past it (Qwen's are), not another tokenizer's
    class Spelt:  # a tokenizer of 11 ids
        vocab_size = 11

        def encode(self, text):
            return [0]

        def decode(self, ids):
            return ""

    spelt = Spelt()
    with pytest.raises(TeacherVocabularyError, match=r"both cover the tokenizer's 11 ids, so the larger is padded past "
                                                     r"them\. .* build the student with the teacher's vocab_size \(16\)"):
        DistillationObjective(student_model(vocab=12), teacher_model(), SEQ, tokenizer=spelt)
    # Weights of another vocabulary, read for a teacher module that claims the right one.
    objective = DistillationObjective(student_model(), teacher_model(), SEQ)
    wrong = nn.meta.unbox(student_model(vocab=20).init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), initializer=objective.teacher_from(wrong))
    with pytest.raises(TeacherVocabularyError, match=r"vocabulary of 20 tokens, but the student scores 16"):
        trainer.place()


def test_settings_that_cannot_run_are_refused_when_the_objective_is_built():
    """A student shorter than the windows stopped the first step with a traceback; a hidden_layer
    naming no submodule stopped it the same way, and without hidden it trained as if absent."""
    short = CausalTransformer(vocab_size=VOCAB, emb_features=8, num_layers=1, num_heads=1, mlp_features=16,
                              max_seq_len=SEQ - 4)
    with pytest.raises(ValueError, match=r"seq_len=12 exceeds the student's max_seq_len=8"):
        DistillationObjective(short, teacher_model(), SEQ)
    with pytest.raises(ValueError, match=r"hidden_layer='nope' names no top-level submodule of the student; "
                                         r"its submodules are embed, final_norm, layers_0"):
        DistillationObjective(student_model(), teacher_model(), SEQ, hidden=1.0, hidden_layer="nope")
    with pytest.raises(ValueError, match=r"hidden_layer='layers_0' .* runs only with hidden > 0"):
        DistillationObjective(student_model(), teacher_model(), SEQ, hidden_layer="layers_0")
    names = [m.name for m in DistillationObjective(student_model(), teacher_model(), SEQ, hidden=1.0,
                                                   hidden_layer="layers_0").metrics()]
    assert "hidden_error" in names


def kl_to(teacher_params, student_params, rows):
    t = teacher_model().apply({"params": teacher_params}, rows[:, :-1])
    s = student_model().apply({"params": student_params}, rows[:, :-1])
    log_p, log_q = jax.nn.log_softmax(t), jax.nn.log_softmax(s)
    return float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)))


@pytest.mark.slow
def test_a_student_distilled_from_a_checkpointed_teacher_gets_closer_to_it_than_one_trained_on_labels(tmp_path):
    data = markov_dataset()
    teacher_run = Trainer(LMObjective(teacher_model(), SEQ), optax.adam(3e-3), key=jax.random.key(0),
                          checkpoints=Checkpoints(tmp_path / "teacher"))
    teacher = jax.device_get(teacher_run.fit(data, steps=150, log_every=150).params)["params"]

    objective = DistillationObjective(student_model(), teacher_model(), SEQ, temperature=1.0)
    distill = Trainer(objective, optax.adam(3e-3), key=jax.random.key(1),
                      initializer=objective.teacher_from(ParamsFrom(tmp_path / "teacher")))
    start = jax.device_get(distill.place()[0].params)["params"]
    jax.tree.map(np.testing.assert_array_equal, start["teacher"], teacher)  # read from the checkpoint
    state = distill.fit(markov_dataset(), steps=60, log_every=60)
    assert not [p for p in jax.tree_util.tree_flatten_with_path(state.opt_state)[0] if "teacher" in str(p[0])]
    distilled = jax.device_get(state.params)["params"]["student"]

    # The same student, from the same weights, trained on the labels for as many steps.
    labels = Trainer(LMObjective(student_model(), SEQ), optax.adam(3e-3), key=jax.random.key(1),
                     initializer={"params": start["student"]})
    labelled = jax.device_get(labels.fit(markov_dataset(), steps=60, log_every=60).params)["params"]

    held_out = markov_rows(10_000, rows=64)
    before = kl_to(teacher, start["student"], held_out)
    after_distill, after_labels = kl_to(teacher, distilled, held_out), kl_to(teacher, labelled, held_out)
    print(f"KL(teacher || student): start {before:.4f}, labels {after_labels:.4f}, distilled {after_distill:.4f}")
    assert after_distill < after_labels < before
    assert after_distill < 0.9 * after_labels


# -- a teacher from a Pretrained directory, and the student as a text-generation pipeline ---------------


def llama_teacher_directory(path, writer="transformers"):
    """A random Llama teacher of the markov vocabulary, written by transformers (or by dew's Pretrained)."""
    if writer == "transformers":
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                          tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        return path
    from dew.pretrained import Pretrained

    model = llama_student(emb=32, layers=2)
    Pretrained(model, model.init(jax.random.key(5), jnp.zeros((1, SEQ), jnp.int32))).save(path)
    return path


def llama_student(vocab=16, emb=8, layers=1):
    from dew.nn.backbones import CausalTransformer

    return CausalTransformer(vocab_size=vocab, emb_features=emb, num_layers=layers, num_heads=2, mlp_features=2 * emb,
                             max_seq_len=SEQ, position_embedding="rotary", mlp_activation="swiglu")


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["transformers", "dew"])
def test_a_teacher_from_a_pretrained_directory_is_read_whole_and_held_frozen(tmp_path, writer):
    from dew.pretrained import Pretrained

    directory = llama_teacher_directory(tmp_path / "teacher", writer)
    objective = DistillationObjective(student_model(), None, SEQ, teacher_pretrained=str(directory))
    loaded = Pretrained.load(directory)
    assert objective.teacher == loaded.model  # the architecture comes from config.json
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(1), initializer=objective.initializer())
    start = jax.device_get(trainer.place()[0].params)["params"]
    jax.tree.map(np.testing.assert_array_equal, start["teacher"], jax.device_get(loaded.variables["params"]))

    rows = markov_rows(7, rows=2)
    if writer == "transformers":  # dew's teacher computes transformers' own logits from those weights
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(torch.tensor(rows[:, :-1], dtype=torch.long)).logits.numpy()
        ours = np.asarray(objective.teacher.apply({"params": start["teacher"]}, rows[:, :-1]))
        assert np.abs(ours - theirs).max() <= 1e-4

    state = trainer.fit(markov_dataset(), steps=3, log_every=3)
    after = jax.device_get(state.params)["params"]
    jax.tree.map(np.testing.assert_array_equal, after["teacher"], start["teacher"])  # frozen
    assert not [p for p in jax.tree_util.tree_flatten_with_path(state.opt_state)[0] if "teacher" in str(p[0])]
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["student"]),
                                                        jax.tree.leaves(start["student"]), strict=True))


def test_a_pretrained_teacher_that_cannot_serve_is_refused_naming_why(tmp_path):
    from dew.pretrained import ConfigurationMismatchError

    directory = str(llama_teacher_directory(tmp_path / "teacher", "dew"))
    with pytest.raises(TeacherVocabularyError, match=r"student's vocabulary has 12 tokens but the teacher's has 16"):
        DistillationObjective(student_model(vocab=12), None, SEQ, teacher_pretrained=directory)
    with pytest.raises(ConfigurationMismatchError, match=r"emb_features=32 .* has 16\. Set objective\.teacher\."
                                                         r"emb_features=32"):
        DistillationObjective(student_model(), llama_student(emb=16, layers=2), SEQ, teacher_pretrained=directory)
    with pytest.raises(ValueError, match="teacher_checkpoint or from teacher_pretrained; set one"):
        DistillationObjective(student_model(), None, SEQ, teacher_pretrained=directory, teacher_checkpoint="runs/x")
    with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
        DistillationObjective(student_model(), None, SEQ, teacher_pretrained=str(tmp_path / "nowhere"))
    # A teacher given beside a missing export (as a run's run.json rebuilds it) is refused when
    # its weights are read, before anything trains.
    missing = DistillationObjective(student_model(), llama_student(), SEQ, teacher_pretrained=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"nowhere holds no config\.json"):
        missing.initializer()(nn.meta.unbox(jax.eval_shape(missing.init, jax.random.key(0))))
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationObjective(student_model(), None, SEQ)
    # The same architecture given explicitly is accepted, and reads the same weights.
    given = DistillationObjective(student_model(), llama_student(emb=32, layers=2), SEQ, teacher_pretrained=directory)
    assert given.teacher == llama_student(emb=32, layers=2)


def test_a_recipe_reads_its_teacher_from_an_exported_directory(tmp_path):
    from dew.pretrained import Pretrained
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts, objective_parts

    teacher = llama_student(vocab=257, emb=32, layers=1)
    teacher = teacher.clone(max_seq_len=64)
    Pretrained(teacher, teacher.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "teacher")
    recipe = RunConfig.load("tiny-distill", overrides=[
        "objective.teacher=null", "objective.teacher_checkpoint=null",
        f"objective.teacher_pretrained={tmp_path}/teacher", "data.files={stdlib}/abc.py"])
    objective = build_parts(recipe, with_data=False).objective
    assert objective.teacher == teacher
    assert objective.tokenizer is not None  # the reader's, so that pipeline() can write text
    read = objective_parts(objective)["initializer"]
    abstract = nn.meta.unbox(jax.eval_shape(objective.init, jax.random.key(0)))
    weights = read(abstract)["params"]["teacher"]
    jax.tree.map(np.testing.assert_array_equal, weights,
                 jax.device_get(Pretrained.load(tmp_path / "teacher").variables["params"]))


@pytest.mark.slow
def test_the_distilled_student_is_a_text_generation_pipeline_that_saves_for_transformers(tmp_path):
    from dew.data import ByteTokenizer
    from dew.sampling import Sampling, TextGeneration, generate

    tokenizer = ByteTokenizer()
    student = llama_student(vocab=257, emb=16).clone(max_seq_len=32)
    teacher = llama_student(vocab=257, emb=32, layers=2).clone(max_seq_len=32)
    objective = DistillationObjective(student, teacher, 16, tokenizer=tokenizer)
    text = np.asarray([tokenizer.encode("distil me, again and again")[:17]] * 4, np.int32)
    data = counting_dataset(lambda i: {"text": text}, 4)
    state = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0)).fit(data, steps=2, log_every=2)

    pipeline = objective.pipeline(state)
    student_params = jax.device_get(state.params)["params"]["student"]
    assert set(pipeline.variables) == {"params"}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(pipeline.variables["params"]), student_params)
    expected = generate(student, {"params": student_params}, [tokenizer.encode("dis")], 6, jax.random.key(0),
                        Sampling(temperature=0.0), eos_id=tokenizer.eos_id)
    assert pipeline("dis", max_new_tokens=6) == tokenizer.decode(expected.new_tokens[0])

    pipeline.save(tmp_path / "student")
    loaded = TextGeneration.load(tmp_path / "student")
    assert loaded.model == student
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded.variables["params"]), student_params)
    assert loaded("dis", max_new_tokens=6) == pipeline("dis", max_new_tokens=6)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        DistillationObjective(student, teacher, 16).pipeline(state)


def test_a_recipes_init_starts_the_student_and_the_teacher_still_comes_from_its_own_source(tmp_path):
    """A recipe's init section replaced the whole tree, teacher included (an init.run of another
    distillation took its teacher; a student-sized run or export was refused). It now reads the
    student alone; the teacher is teacher_pretrained's."""
    from dew.pretrained import Pretrained

    teacher_dir = llama_teacher_directory(tmp_path / "teacher", writer="dew")
    student = llama_student()
    student_weights = student.init(jax.random.key(9), jnp.zeros((1, SEQ), jnp.int32))
    objective = DistillationObjective(student, None, SEQ, teacher_pretrained=str(teacher_dir))
    abstract = jax.eval_shape(lambda: nn.meta.unbox(objective.init(jax.random.key(0))))
    started = objective.starting_weights(lambda wanted: student_weights)(abstract)
    jax.tree.map(np.testing.assert_array_equal, started["params"]["student"],
                 nn.meta.unbox(student_weights)["params"])
    jax.tree.map(np.testing.assert_array_equal, started["params"]["teacher"],
                 Pretrained.load(teacher_dir).variables["params"])
    placed = jax.device_get(Trainer(objective, optax.sgd(0.1), key=jax.random.key(1), initializer=objective
                                    .starting_weights(lambda wanted: student_weights)).place()[0].params)
    jax.tree.map(np.testing.assert_array_equal, placed["params"]["student"], nn.meta.unbox(student_weights)["params"])


def test_lora_on_the_student_draws_its_base_when_the_objective_reads_only_the_teacher():
    """LoRA put the starting weights under the adapters whole, and the teacher the objective reads was
    all they held: "The starting weights lack 12 base weight(s) ... params/student/embed", though the
    run's note said the student's base would be drawn fresh."""
    from dew.adapters.lora import Lora, adapters_only, apply_lora, is_adapter

    teacher = jax.device_get(teacher_model().init(jax.random.key(5), jnp.zeros((1, SEQ), jnp.int32)))
    given = {"params": {"teacher": teacher["params"]}}  # what teacher_from reads, the student absent
    plain = DistillationObjective(student_model(), teacher_model(), SEQ)
    adapted = adapters_only(DistillationObjective(apply_lora(student_model(), Lora(rank=2, targets=("mlp",))),
                                                  teacher_model(), SEQ))
    def same(a, b):  # boxed or not, leaf by leaf in the trees' order
        left, right = jax.tree.leaves(a), jax.tree.leaves(b)
        assert len(left) == len(right) > 0
        for x, y in zip(left, right, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    variables = nn.meta.unbox(adapted.init(jax.random.key(0), given))
    drawn = plain.init(jax.random.key(0), given)["params"]
    same(variables["params"]["teacher"], teacher["params"])
    # the student's base is the one the same objective without LoRA draws, under fresh adapters
    base = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"]["student"])[0]
            if not is_adapter((str(getattr(path[-1], "key", "")),), None)}
    same(list(base.values()), drawn["student"])
    assert [p for p, _ in jax.tree_util.tree_flatten_with_path(variables["params"]["student"])[0]
            if is_adapter(tuple(getattr(k, "key", "") for k in p), None)]


@pytest.mark.slow  # two short recipe runs (the start and the resume)
def test_a_run_whose_teacher_came_from_an_export_is_usable_after_the_export_moved(tmp_path, monkeypatch):
    """run.json recorded teacher: null beside teacher_pretrained, and the objective read the
    teacher's architecture from that export's config.json whenever it was rebuilt: once the export
    had moved, dew generate, eval, export and --resume refused a run whose checkpoints hold every
    weight. The run records the teacher it read, so it rebuilds without the export."""
    import shutil

    from dew import models
    from dew.pretrained import Pretrained
    from dew.recipes.config import RunConfig
    from dew.recipes.opening import open_run
    from dew.recipes.run import train

    monkeypatch.chdir(tmp_path)
    teacher = llama_student(vocab=257, emb=32, layers=1).clone(max_seq_len=64)
    Pretrained(teacher, teacher.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "teacher")
    shape = ["objective.teacher_checkpoint=null", "data.files={stdlib}/abc.py", "data.batch=2",
             "trainer.log_every=1", "trainer.eval_every=2", "model.emb_features=16", "model.mlp_features=32",
             "trainer.checkpoint_dir=run", "trackers=[]"]
    trained = train(RunConfig.load("tiny-distill", overrides=[
        *shape, "objective.teacher=null", "objective.teacher_pretrained=teacher", "trainer.steps=2"]))

    recorded = RunConfig.read(tmp_path / "run").objective.fields["teacher"]
    assert models.build(recorded.pop("name"), **recorded) == Pretrained.load(tmp_path / "teacher").model
    shutil.move(tmp_path / "teacher", tmp_path / "moved")

    opened = open_run(tmp_path / "run")  # what generate, eval and export read
    assert opened.objective.teacher == teacher
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(opened.live), jax.device_get(trained.params))

    resumed = train(RunConfig.read(tmp_path / "run").model_copy(
        update={"trainer": RunConfig.read(tmp_path / "run").trainer.model_copy(update={"steps": 3})}))
    assert int(resumed.step) == 3
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params)["params"]["teacher"],
                 jax.device_get(Pretrained.load(tmp_path / "moved").variables["params"]))
