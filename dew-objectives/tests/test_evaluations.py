"""dew's evaluation tasks score an exported model as transformers does by hand, run on a cadence
in training and from `dew eval --task`, shard over devices, and name a bad record's line."""

from __future__ import annotations

import gzip
import json
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpe_helpers import build_tokenizer
from dew.evaluations import Subject, TaskFileError
from dew.testing import EvaluationTaskKit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_LEN = 48
QUESTIONS = [
    ("What is two plus two?", ["It is four.", "It is five.", "Thank you!"], 0),
    ("The user asks a question and the", ["assistant answers it politely.", "tokens packed.", "dew"], 0),
    ("def add(x, y):", ["return x + y", "return x - y"], 1),
    ("Documents are tokenized on the fly, ", ["packed and shuffled by block.", "politely.", "four"], 2),
    ("", ["It is four.", "Documents are packed."], 1),
    (" ".join(["dew trains jax models on packed windows"] * 6), ["The user asks.", "It is four."], 0),
]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama-style dew model, its weights redrawn larger than at init, saved for transformers."""
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.nn.backbones import CausalTransformer
    from dew.pretrained import Pretrained

    folder = tmp_path_factory.mktemp("export")
    tokens = build_tokenizer(folder / "tokenizer", template=None, eos="<|endoftext|>")
    tokenizer = HFTokenizer.from_file(tokens / "tokenizer.json")
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, mlp_features=64, max_seq_len=MAX_LEN,
                              position_embedding="rotary", mlp_activation="swiglu")
    shapes = jax.eval_shape(model.init, jax.random.key(3), jnp.zeros((1, 4), jnp.int32))
    rng = np.random.default_rng(4)
    variables = jax.tree.map(lambda x: (rng.normal(size=x.shape) * 0.3).astype(x.dtype), shapes)
    Pretrained(model, variables, tokenizer).save(folder / "model")
    loaded = Pretrained.load(folder / "model")
    return folder, Subject(loaded.model, loaded.variables, loaded.tokenizer)


@pytest.fixture(scope="module")
def choice_file(exported):
    folder, _ = exported
    return _write(folder / "choice.jsonl", [{"context": c, "choices": ch, "answer": a} for c, ch, a in QUESTIONS])


@pytest.fixture(scope="module")
def reference(exported):
    """transformers' tokenizer and model, read from the export."""
    folder, _ = exported
    return (transformers.AutoTokenizer.from_pretrained(str(folder / "model")),
            transformers.AutoModelForCausalLM.from_pretrained(str(folder / "model")).eval())


def _hand_scores(reference, questions):
    """Each choice's summed log-probability, by transformers, tokenized as the harnesses do."""
    tokenizer, model = reference

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for context, choices, _ in questions:
        scores = []
        for choice in choices:
            continuation = " " + choice
            stripped = context.rstrip()
            continuation, context_text = context[len(stripped):] + continuation, stripped
            if context_text:
                head = ids(context_text)
                tail = ids(context_text + continuation)[len(head):]
            else:
                head, tail = [tokenizer.eos_token_id], ids(continuation)
            row = (head + tail)[-(MAX_LEN + 1):]
            with torch.no_grad():
                logits = model(torch.tensor([row[:-1]])).logits[0].double()
            logp = torch.log_softmax(logits, -1)[torch.arange(len(row) - 1), torch.tensor(row[1:])]
            scores.append(float(logp[-len(tail):].sum()))
        out.append(np.asarray(scores))
    return out


def test_multiple_choice_equals_a_hand_written_scorer_in_transformers(exported, choice_file, reference):
    from dew.evaluations.multiple_choice import MultipleChoice

    _, subject = exported
    task = MultipleChoice(file=choice_file, batch=4)
    expected = _hand_scores(reference, QUESTIONS)
    got = task.choice_scores(subject)
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-3)
    accuracy = np.mean([int(np.argmax(s)) == a for s, (_, _, a) in zip(expected, QUESTIONS, strict=True)])
    scores = task.evaluate(subject)
    assert scores["accuracy"] == accuracy and scores["records"] == len(QUESTIONS)
    # lm-eval's acc_norm: the sum per character of the choice, its separator not counted
    normed = np.mean([int(np.argmax(s / np.asarray([len(c) for c in choices], float))) == a
                      for s, (_, choices, a) in zip(expected, QUESTIONS, strict=True)])
    assert scores["accuracy_norm"] == normed
    assert 0 < accuracy < 1  # the redrawn weights prefer some right answers and some wrong ones


def test_an_answer_given_as_a_choices_text_is_that_choice_and_an_ambiguous_one_is_refused(tmp_path):
    """A string answer was read as an index or a letter before it was looked up among the choices:
    "4" among the choices 3, 4, 5, 6 was refused as naming none of them, "y" among x and y read as
    the 25th letter, and "3" among 3, 4, 5, 6 silently became the choice "6". A choice's text names
    that choice; where it also names another by position, answer_is says which reading is meant."""
    from dew.evaluations.multiple_choice import MultipleChoice

    def golds(records, **fields):
        file = _write(tmp_path / "mc.jsonl", [{"context": "c", **record} for record in records])
        return [q.choices[q.answer] for q in MultipleChoice(file=file, **fields).questions()]

    numbers = ["3", "4", "5", "6"]
    assert golds([{"choices": numbers, "answer": "4"}, {"choices": ["x", "y"], "answer": "y"},
                  {"choices": numbers, "answer": "1"}, {"choices": ["no", "yes"], "answer": "B"}]) == ["4", "y", "4", "yes"]
    ambiguous = [{"choices": numbers, "answer": "3"}, {"choices": ["B", "A"], "answer": "A"}]
    for record, text, position in zip(ambiguous, (0, 1), (3, 0), strict=True):
        with pytest.raises(TaskFileError, match=rf"the answer '{record['answer']}' is the text of choice {text} and "
                                                rf"also names choice {position} by its position; set answer_is="):
            golds([record])
    assert golds(ambiguous, answer_is="text") == ["3", "A"]
    assert golds(ambiguous, answer_is="position") == ["6", "B"]
    with pytest.raises(TaskFileError, match=r"the answer '4' names none of its 4 choices"):
        golds([{"choices": numbers, "answer": "4"}], answer_is="position")


def test_a_choice_the_tokenizer_merges_into_the_context_is_refused_naming_its_line(tmp_path):
    """'It is t' then 'he' tokenizes as 'It is the', no more ids than the context: the choice had no id
    to score, a log-likelihood of 0, and won every accuracy without a word."""
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.evaluations.multiple_choice import MultipleChoice, continuation_ids

    tokenizer = HFTokenizer.from_file(build_tokenizer(tmp_path / "tokenizer", template=None,
                                                      eos="<|endoftext|>") / "tokenizer.json")
    assert continuation_ids(tokenizer, "It is t", "he")[1] == []  # the case: nothing of the choice is left
    records = [{"context": "It is", "choices": [" four.", " five."], "answer": 0},
               {"context": "It is t", "choices": ["he", "o"], "answer": 1}]
    task = MultipleChoice(file=_write(tmp_path / "mc.jsonl", records), separator="")
    with pytest.raises(TaskFileError, match=r"Line 2 of .*mc.jsonl'?: its context with 'he' after it tokenizes into "
                                            r"no more ids than the context alone"):
        task.rows(tokenizer, None)
    assert len(MultipleChoice(file=_write(tmp_path / "ok.jsonl", records[:1]), separator="").rows(tokenizer, None)) == 2


def test_accuracy_norm_divides_by_the_choice_alone_as_lm_eval_does():
    """lm-eval's acc_norm divides each summed log-probability by len(choice): here -42.09/24 beats
    -6.39/3, while counting the separator (25 and 4 characters) would pick the short choice."""
    from dew.evaluations.multiple_choice import normalized_pick

    choices = ["and thank return what", "block documents politely", "and"]
    scores = np.asarray([-48.85, -42.09, -6.39])
    assert normalized_pick(scores, choices) == 1
    # counting the separator, as accuracy_norm did, picks the short choice instead
    assert int(np.argmax(scores / np.asarray([len(" " + c) for c in choices], float))) == 2
    # An empty choice divides by zero characters there (-inf): never picked over one with text, though
    # dividing by max(len, 1) made its -1.79 the best.
    assert normalized_pick(np.asarray([-1.79, -10.36, -19.95]), ["", "None", "not None"]) == 2


@pytest.mark.slow  # greedy decoding compiled in dew and run in transformers
def test_generation_exact_match_equals_transformers_greedy_answers(exported, reference):
    """References are transformers' own greedy first words for half the prompts, so dew's exact
    match is one half exactly when it generates what transformers does."""
    from dew.evaluations.generation import GenerationTask

    folder, subject = exported
    tokenizer, model = reference
    prompts = ["What is two plus two?", "def add(x, y):", "The user asks", "Documents are", "It is", "dew"]
    firsts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        firsts.append(text.split()[0] if text.split() else "")
    assert len(set(firsts)) > 1
    records = [{"question": p, "answer": f"#### {w if i % 2 == 0 else w + 'x'}"}
               for i, (p, w) in enumerate(zip(prompts, firsts, strict=True))]
    file = _write(folder / "answers.jsonl", records)
    task = GenerationTask(file=file, max_new_tokens=6, pattern=r"(\S+)", answer_pattern=r"#### (.*)", batch=8)
    assert task.evaluate(subject) == {"exact_match": 0.5, "records": 6.0}
    # lm-eval's regexes_to_ignore and ignore_case: the references written with a dollar sign, in
    # upper case and with a full stop after are the same answers once both sides drop them
    dressed = [{"question": p, "answer": f"#### ${w.upper()}."} for p, w in zip(prompts, firsts, strict=True)]
    file = _write(folder / "dressed.jsonl", dressed)
    task = GenerationTask(file=file, max_new_tokens=6, pattern=r"(\S+)", answer_pattern=r"#### (.*)", batch=8,
                          ignore=[r"\$", r"\.$"], ignore_case=True)
    expected = sum(re.sub(r"\.$", "", re.sub(r"\$", "", w)).lower() == w.upper().lower() for w in firsts)
    assert expected > 1  # the generated words themselves hold no dollar sign or final full stop
    assert task.evaluate(subject) == {"exact_match": expected / 6, "records": 6.0}
    assert GenerationTask(file=file, answer_pattern=r"#### (.*)").matches(firsts[0], f"${firsts[0].upper()}.") is False


def test_a_pattern_of_alternatives_reads_the_branch_that_matched_as_lm_eval_does(tmp_path):
    """With one group per alternative (lm-eval's GSM8K flexible-extract), a match of a later branch
    read group 1, which was empty: the prediction was "no match" and the reference was refused as
    holding no answer. lm-eval's RegexFilter keeps the first group that matched."""
    from dew.evaluations.generation import GenerationTask

    file = _write(tmp_path / "gsm.jsonl", [{"question": "1+1=", "answer": "so\n#### 60"}])
    task = GenerationTask(file=file, pattern=r"zzz(\d+)|= (\d+)", answer_pattern=r"zzz(\d+)|#### (\d+)")
    assert [p.reference for p in task.problems()] == ["60"]
    flexible = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # lm-eval's own, written out by hand below
    for text, by_hand in (("so x = 42 then", "42"), ("answer 7", "7"), ("no digits", None)):
        found = flexible.search(text)
        expected = None if found is None else next(g for g in found.groups() if g)
        assert GenerationTask(file=file, pattern=flexible.pattern).prediction(text) == expected == by_hand
    assert task.prediction("so x = 42 then") == "42"
    assert GenerationTask(file=file, pattern=r"x()").prediction("x") == ""  # a group that matched nothing


class TestMultipleChoice(EvaluationTaskKit):
    @pytest.fixture(autouse=True)
    def _given(self, exported, choice_file, tmp_path):
        self.folder, self._subject = exported
        self.file, self.tmp = choice_file, tmp_path

    def task(self):
        from dew.evaluations.multiple_choice import MultipleChoice

        return MultipleChoice(file=self.file)

    def subject(self):
        return self._subject

    def rebatched(self, rows):
        from dew.evaluations.multiple_choice import MultipleChoice

        return MultipleChoice(file=self.file, batch=rows)

    def malformed(self):
        from dew.evaluations.multiple_choice import MultipleChoice

        file = self.tmp / "bad.jsonl"
        file.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "answer": 0}) + "\n\n"
                        + json.dumps({"context": "a", "choices": ["b", "c"], "answer": 7}) + "\n")
        return (lambda: MultipleChoice(file=str(file))), 3


class TestGenerationTask(EvaluationTaskKit):
    @pytest.fixture(autouse=True)
    def _given(self, exported, tmp_path):
        self.folder, self._subject = exported
        self.file = _write(tmp_path / "gen.jsonl", [{"question": q, "answer": c[a]} for q, c, a in QUESTIONS[:4]])
        self.tmp = tmp_path

    def task(self):
        from dew.evaluations.generation import GenerationTask

        return GenerationTask(file=self.file, max_new_tokens=3)

    def subject(self):
        return self._subject

    def malformed(self):
        from dew.evaluations.generation import GenerationTask

        file = self.tmp / "bad.jsonl"
        file.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n" + '{"question": "a", "answer": \n')
        return (lambda: GenerationTask(file=str(file))), 2


def test_bad_task_files_name_the_line_and_what_is_wrong(tmp_path, exported):
    from dew.evaluations.multiple_choice import MultipleChoice

    _, subject = exported
    cases = [({"choices": ["a", "b"], "answer": 0}, "has no key 'context'"),
             ({"context": "x", "choices": "ab", "answer": 0}, "must be a list of at least two strings"),
             ({"context": "x", "choices": ["a", "b"], "answer": "C"}, "names none of its 2 choices")]
    for record, message in cases:
        file = _write(tmp_path / "t.jsonl", [{"context": "x", "choices": ["a", "b"], "answer": 1}, record])
        with pytest.raises(TaskFileError, match=f"Line 2 of .*t.jsonl.*{message}"):
            MultipleChoice(file=file)  # when the task is built, before a run trains to its first evaluation
    from dew.evaluations.generation import GenerationTask

    file = _write(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}, {"q": "2+2=", "a": "4"}])
    with pytest.raises(TaskFileError, match="Line 2 of .*q.jsonl' has no key 'answer'"):
        GenerationTask(file=file)
    from dew.evaluations.generation import GenerationTask
    from dew.evaluations.perplexity import PerplexityTask

    untokenized = Subject(subject.model, subject.variables, None)  # an image run's, or ids without a tokenizer
    file = _write(tmp_path / "t.jsonl", [{"context": "x", "choices": ["a", "b"], "answer": 1, "text": "x",
                                          "prompt": "x", "answer_text": "y"}])
    for task, purpose in [(MultipleChoice(file=file), "choices"), (PerplexityTask(file=file), "documents"),
                          (GenerationTask(file=file, prompt_key="prompt", answer_key="answer_text"), "prompts")]:
        with pytest.raises(TaskFileError, match=f"{type(task).__name__} needs the run's tokenizer to turn "
                                                f"{purpose} into ids, and this run has none.*Text tasks score"):
            task.evaluate(untokenized)
    arc = {"question": "x", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}, "answerKey": "C"}
    task = MultipleChoice(file=_write(tmp_path / "arc.jsonl", [arc]), template="Question: {question}\nAnswer:",
                          answer_key="answerKey")
    assert task.questions()[0].answer == 2 and task.questions()[0].context == "Question: x\nAnswer:"


@pytest.mark.slow
def test_scores_sharded_over_four_devices_equal_one_device(exported, choice_file, python_in_subprocess):
    """Batches split over a data axis of 4 devices give the single device's scores."""
    from dew.evaluations.multiple_choice import MultipleChoice

    folder, subject = exported
    one = MultipleChoice(file=choice_file, batch=5).choice_scores(subject)
    out = python_in_subprocess(f"""
        import json, jax
        from dew.evaluations import Subject
        from dew.evaluations.multiple_choice import MultipleChoice
        from dew.pretrained import Pretrained
        from dew.training.placement.mesh import build_mesh
        loaded = Pretrained.load({str(folder / "model")!r})
        mesh = build_mesh()
        assert mesh.shape["data"] == 4
        scores = MultipleChoice(file={choice_file!r}, batch=5).choice_scores(
            Subject(loaded.model, loaded.variables, loaded.tokenizer), mesh=mesh)
        print(json.dumps([s.tolist() for s in scores]))
    """, devices=4)
    four = json.loads(out.strip().splitlines()[-1])
    for a, b in zip(one, four, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dew_eval_scores_a_task_on_an_export(exported, choice_file, capsys):
    from dew.cli import main
    from dew.evaluations.multiple_choice import MultipleChoice

    folder, subject = exported
    assert main(["eval", str(folder / "model"), "--task", "multiple_choice", "--set", f"file={choice_file}",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = MultipleChoice(file=choice_file).evaluate(subject)
    assert printed["eval/multiple_choice/accuracy"] == expected["accuracy"]
    assert main(["eval", str(folder / "model"), "--task", "multiple_choice", "--set", "file=missing.jsonl"]) == 2
    assert "missing.jsonl' does not exist" in capsys.readouterr().err
    # a field without its value was told to write a recipe's trainer.steps=10
    assert main(["eval", str(folder / "model"), "--task", "multiple_choice", "--set", "file"]) == 2
    assert "--set 'file' is not KEY=VALUE: write a field of the task, for example --set file=arc.jsonl." \
        in capsys.readouterr().err


DOCUMENTS = [" ".join(["Documents are tokenized on the fly, packed and shuffled by block."] * 8),
             "It is four.", "def add(x, y):\n    return x + y\n" * 4]


def _hand_perplexity(reference, documents, width):
    """lm-eval's loglikelihood_rolling and wikitext metrics, written out with transformers: windows
    of get_rolling_token_windows (context_len 1) made disjoint, the prefix the beginning-of-text id
    or else the end-of-document id."""
    import math
    import re

    tokenizer, model = reference
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    total, count = 0.0, 0
    for text in documents:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        count += len(tokens)
        windows = [([prefix] + tokens[: min(width, len(tokens)) - 1], tokens[: min(width, len(tokens))])]
        predicted = len(windows[0][1])
        while predicted < len(tokens):
            length = min(len(tokens) - predicted, width)
            end = predicted + length
            windows.append((tokens[end - width - 1: end - 1], tokens[end - length: end]))
            predicted += length
        for context, continuation in windows:
            row = context[: len(context) - (len(continuation) - 1)] + continuation
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([row[:-1]])).logits[0].double(), -1)
            picked = logp[torch.arange(len(row) - 1), torch.tensor(row[1:])]
            total += float(picked[-len(continuation):].sum())
    words = sum(len(re.split(r"\s+", text)) for text in documents)
    size = sum(len(text.encode("utf-8")) for text in documents)
    # e to more than ~709.8 passes float64: that perplexity is infinite
    exp = lambda nats: math.exp(nats) if nats < math.log(sys.float_info.max) else math.inf  # noqa: E731
    return {"word_perplexity": exp(-total / words), "byte_perplexity": exp(-total / size),
            "bits_per_byte": -total / size / math.log(2), "token_perplexity": exp(-total / count)}


def test_perplexity_equals_lm_evals_rolling_windows_in_transformers(exported, reference, tmp_path, capsys):
    from dew.cli import main
    from dew.evaluations.perplexity import PerplexityTask

    folder, subject = exported
    documents = _write(tmp_path / "documents.jsonl", [{"text": t} for t in DOCUMENTS])
    longest = max(len(reference[0](t, add_special_tokens=False)["input_ids"]) for t in DOCUMENTS)
    assert longest > 2 * MAX_LEN  # a document takes three windows
    expected = _hand_perplexity(reference, DOCUMENTS, MAX_LEN)
    scores = PerplexityTask(file=documents, batch=3).evaluate(subject)
    assert scores["records"] == len(DOCUMENTS)
    for name, value in expected.items():
        assert scores[name] == pytest.approx(value, rel=1e-4), name
    assert main(["eval", str(folder / "model"), "--task", "perplexity", "--set", f"file={documents}",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["eval/perplexity/bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-4)
    _write(tmp_path / "untitled.jsonl", [{"body": "x"}])
    with pytest.raises(TaskFileError, match=r"has no key 'text' \(it has \['body'\]\).*set text_key="):
        PerplexityTask(file=str(tmp_path / "untitled.jsonl")).evaluate(subject)


def test_a_perplexity_past_floats_range_is_infinite_not_a_traceback(exported, reference, tmp_path, capsys):
    """A word the model finds costlier than ~710 nats (a long URL, text written without spaces) made
    e to the cost overflow: dew eval, and a run scoring the task on its cadence, ended on
    OverflowError's traceback. That perplexity is infinite; the others are scored as ever, and
    --json spells it "+Inf" as the journal does (JSON has no Infinity)."""
    import math

    from dew.cli import main
    from dew.evaluations.perplexity import PerplexityTask

    folder, subject = exported
    word = "".join(np.random.default_rng(7).choice(list("qzxjvkw"), 900))  # one word, one document
    documents = _write(tmp_path / "word.jsonl", [{"text": word}])
    expected = _hand_perplexity(reference, [word], MAX_LEN)
    assert expected["bits_per_byte"] * len(word) * math.log(2) > 710  # the word's cost in nats
    scores = PerplexityTask(file=documents).evaluate(subject)
    assert scores["word_perplexity"] == math.inf == expected["word_perplexity"]
    for name in ("byte_perplexity", "bits_per_byte", "token_perplexity"):
        assert math.isfinite(scores[name]) and scores[name] == pytest.approx(expected[name], rel=1e-4), name
    assert main(["eval", str(folder / "model"), "--task", "perplexity", "--set", f"file={documents}",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1], parse_constant=pytest.fail)
    assert printed["eval/perplexity/word_perplexity"] == "+Inf"


SMALL = ["model.emb_features=32", "model.num_heads=4", "model.mlp_features=64", "model.num_layers=1",
         "model.max_seq_len=64", "objective.seq_len=48", "data.length=48", "objective.prompt=null"]


@pytest.mark.slow
def test_a_recipe_scores_its_tasks_on_a_cadence_and_dew_eval_repeats_them(tmp_path, capsys, monkeypatch):
    """tiny-sft's trainer.evaluate: the multiple-choice task logged at steps 1 and 2, the same score
    that `dew eval RUN --task` computes from the kept step, typed from another folder (the task
    file's relative path starts where the run trained, as the recipe's other paths do)."""
    import shutil

    from dew.cli import main
    from dew.placeholders import expand

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copy(expand("{recipes}/data/addition-choice.jsonl", ""), work / "choice.jsonl")
    run = work / "runs" / "sft"
    task = "[{task: multiple_choice, label: sums, every: 1, file: choice.jsonl}]"
    monkeypatch.chdir(work)
    assert main(["train", "tiny-sft", *SMALL, "trainer.steps=2", "trainer.log_every=1",
                 "trainer.checkpoint_dir=runs/sft", "trackers.0.directory=runs/sft",
                 f"trainer.evaluate={task}"]) == 0
    rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["eval/sums/accuracy"] for row in rows if "eval/sums/accuracy" in row}
    assert sorted(logged) == [1, 2] and all(row.get("eval/sums/records") in (None, 12.0) for row in rows)
    capsys.readouterr()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(run), "--task", "sums", "--json"]) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["step"] == 2 and printed["eval/sums/accuracy"] == logged[2]
    # By task name: the run's own entry on its own file; given another file, the task as registered (the
    # run's entry, with the template and keys written for its file, was taken silently).
    assert main(["eval", str(run), "--task", "multiple_choice", "--json"]) == 0
    assert "eval/sums/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    other = shutil.copy(work / "choice.jsonl", elsewhere / "other.jsonl")
    assert main(["eval", str(run), "--task", "multiple_choice", "--set", f"file={other}", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "eval/multiple_choice/accuracy" in printed and "eval/sums/accuracy" not in printed


@pytest.mark.slow
def test_dew_eval_resolves_only_the_fields_a_task_reads_as_files_from_where_the_run_trained(tmp_path, monkeypatch):
    """dew eval RUN --task rewrote every text field of the run's entry that named a path existing
    where the run trained: a generation's stop text "." became that folder's absolute path, so the
    command scored another task than the run did (exact_match 0.5 logged, 0.0 repeated). Only the
    fields the task reads as files (ReadsFiles.file_fields) are resolved there."""
    import argparse
    import shutil

    from dew.cli import main
    from dew.cli.evaluate import _task_config
    from dew.placeholders import expand
    from dew.recipes.opening import open_run

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(expand("{recipes}/data/addition-answers.jsonl", ""), work / "answers.jsonl")
    (work / "answer").mkdir()  # a folder named as the task's answer_key: a field that is no path
    task = "[{task: generation, label: sums, file: answers.jsonl, stop: '.', answer_key: answer, max_new_tokens: 4}]"
    monkeypatch.chdir(work)
    assert main(["train", "tiny-sft", *SMALL, "trainer.steps=1", "trainer.checkpoint_dir=runs/sft",
                 "trackers.0.directory=runs/sft", f"trainer.evaluate={task}"]) == 0
    monkeypatch.chdir(tmp_path)
    config = _task_config(argparse.Namespace(task="sums", fields=[]), open_run(work / "runs" / "sft"))
    assert config.fields == {"file": str(work / "answers.jsonl"), "stop": ".", "answer_key": "answer",
                             "max_new_tokens": 4}


def test_a_recipe_names_a_bad_evaluation_entry():
    from dew.recipes.config import RecipeError, RunConfig

    with pytest.raises(RecipeError, match=r"trainer\.evaluate\.1\.fiel: evaluation task 'multiple_choice' has no "
                                          r"field 'fiel'"):
        RunConfig.load("tiny-sft", overrides=["trainer.evaluate.1.fiel=x.jsonl"])
    with pytest.raises(RecipeError, match=r"trainer\.evaluate\.0\.task: no evaluation task named 'gsm9k'"):
        RunConfig.load("tiny-sft", overrides=["trainer.evaluate.0.task=gsm9k"])


GENERATION_POOL = r"""
import json, sys
from dew.training.runtime.process import ProcessSettings, prepare_process
prepare_process(ProcessSettings(multi_host=True))  # the pool run_pool describes
import jax
from dew.evaluations import Subject
from dew.evaluations.generation import GenerationTask
from dew.pretrained import Pretrained

loaded = Pretrained.load(sys.argv[1])
subject = Subject(loaded.model, loaded.variables, loaded.tokenizer)
task = GenerationTask(file=sys.argv[2], max_new_tokens=4, pattern=r"(\S+)", batch=4)
mine = task.generations(subject)
print("RESULT" + json.dumps({"rank": jax.process_index(), "mine": {str(k): v for k, v in mine.items()},
                             "scores": task.evaluate(subject)}))
"""


@pytest.mark.slow  # a pool of two interpreters
def test_generation_split_over_two_processes_equals_one_process(exported, tmp_path):
    """Each process generates its share of every global batch; together they generate what one
    process does, and both report the exact match one process computes."""
    from dew.evaluations.generation import GenerationTask
    from dew.testing.processes import run_pool

    folder, subject = exported
    prompts = ["What is two plus two?", "def add(x, y):", "The user asks", "Documents are", "It is", "dew"]
    alone = GenerationTask(file=_write(tmp_path / "p.jsonl", [{"question": p, "answer": "x"} for p in prompts]),
                           max_new_tokens=4, batch=4)
    texts = alone.generations(subject)
    assert sorted(texts) == list(range(6))
    words = [alone.prediction(texts[r]) or "" for r in range(6)]  # the first word, as pattern reads it
    file = _write(tmp_path / "answers.jsonl", [{"question": p, "answer": w if i % 3 else "never said"}
                                               for i, (p, w) in enumerate(zip(prompts, words, strict=True))])
    single = GenerationTask(file=file, max_new_tokens=4, pattern=r"(\S+)", batch=4).evaluate(subject)
    assert 0 < single["exact_match"] < 1 and single["records"] == 6  # some right, some wrong
    finished = run_pool(GENERATION_POOL, processes=2, args=(str(folder / "model"), file), timeout=600)
    for done in finished:
        assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(d.stdout.split("RESULT", 1)[1]) for d in finished]
    shares = [{int(k): v for k, v in r["mine"].items()} for r in results]
    assert set(shares[0]).isdisjoint(shares[1]) and shares[0] and shares[1]  # each generated its own rows
    assert {**shares[0], **shares[1]} == texts
    assert [r["scores"] for r in results] == [single, single]


def test_a_task_is_checked_when_it_is_built_not_at_its_first_evaluation(tmp_path, monkeypatch, capsys):
    """A missing task file, a directory, a batch or token count below 1, a non-UTF-8 line and a
    choice that is empty text: each refused by name. A recipe naming a missing file is refused
    before it trains (it trained to its first evaluation and lost those steps), traced to its
    trainer.evaluate entry."""
    from dew.cli import main
    from dew.evaluations.generation import GenerationTask
    from dew.evaluations.multiple_choice import MultipleChoice

    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "1+1=", "answer": 0, "context": "1+1=", "choices": ["2", ""]}\n')
    for task in (GenerationTask, MultipleChoice):
        with pytest.raises(TaskFileError, match="'nowhere.jsonl' does not exist"):
            task(file="nowhere.jsonl")
        with pytest.raises(TaskFileError, match="is a directory"):
            task(file=str(tmp_path))
        with pytest.raises(TaskFileError, match=r"\.batch=0; it is at least 1"):
            task(file=str(good), batch=0)
    with pytest.raises(TaskFileError, match=r"max_new_tokens=0; it is at least 1"):
        GenerationTask(file=str(good), max_new_tokens=0)
    with pytest.raises(TaskFileError, match=r"GenerationTask.ignore '\[' is not a regular expression"):
        GenerationTask(file=str(good), ignore=[",", "["])
    # an empty pattern (dew eval --set pattern=) matched the empty text: every answer scored wrong, silently
    for given in ({"pattern": ""}, {"answer_pattern": ""}, {"stop": ["\n", ""]}):
        with pytest.raises(TaskFileError, match=rf"GenerationTask.{next(iter(given))} is empty, which every text "
                                                r"holds at its start.*leave it out \(null\)"):
            GenerationTask(file=str(good), **given)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "\xe9"}\n')
    with pytest.raises(TaskFileError, match=r"Line 2 of .*latin1\.jsonl' is not UTF-8 text"):
        GenerationTask(file=str(tmp_path / "latin1.jsonl")).problems()
    # A byte-order mark (Notepad's UTF-8) was refused as invalid JSON, though every training reader
    # reads it; a gzipped task file was called text that is not UTF-8.
    (tmp_path / "marked.jsonl").write_bytes(b"\xef\xbb\xbf" + good.read_bytes().replace(b"\n", b"\r\n"))
    assert MultipleChoice(file=str(tmp_path / "marked.jsonl")).questions() == MultipleChoice(file=str(good)).questions()
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(good.read_bytes()))
    with pytest.raises(TaskFileError, match=r"packed\.jsonl\.gz' is compressed \(gzip\).*decompress it"):
        MultipleChoice(file=str(tmp_path / "packed.jsonl.gz")).questions()
    with pytest.raises(TaskFileError, match=r"Line 1 of .*: a choice is empty and separator is ''"):
        MultipleChoice(file=str(good), separator="")  # read when built: it was refused at the first evaluation

    monkeypatch.chdir(tmp_path)
    code = main(["train", "tiny-lm", "trainer.steps=4", "trainer.checkpoint_dir=runs/t",
                 "trackers.0.directory=runs/t",
                 "trainer.evaluate=[{task: generation, every: 2, file: nosuch.jsonl}]"])
    err = capsys.readouterr().err
    assert code == 2 and "TaskFileError: The task file 'nosuch.jsonl' does not exist" in err
    assert "The recipe's trainer.evaluate.0 (generation) asks for it." in err
    assert "step 1" not in err and not (tmp_path / "runs").exists()  # refused before anything ran or was kept
    # A generation asking for more new tokens than the model holds: refused as it is scheduled, not after
    # the run trained to its first evaluation.
    code = main(["train", "tiny-lm", "trainer.steps=4", "trainer.checkpoint_dir=runs/t", "trackers.0.directory=runs/t",
                 f"trainer.evaluate=[{{task: generation, every: 2, file: {good}, max_new_tokens: 200}}]"])
    err = capsys.readouterr().err
    assert code == 2 and "max_new_tokens=200 leaves no room for a prompt in the model's max_seq_len=128" in err
    assert "step 1" not in err and not (tmp_path / "runs").exists()


def test_a_generation_prompt_longer_than_the_model_keeps_its_end_instead_of_failing_the_task(tmp_path):
    """One record too long for max_seq_len less max_new_tokens failed the whole task (and the run
    that scheduled it); it is cut from the front, as MultipleChoice cuts a row, and generates what
    the cut prompt generates."""
    from dew.data import ByteTokenizer
    from dew.evaluations.generation import GenerationTask
    from dew.models import build
    from dew.sampling import Sampling, generate

    model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                  mlp_features=32, max_seq_len=16)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    long = "0123456789abcdefghij"  # 20 bytes, past the 16 - 4 = 12 the model leaves room for
    (tmp_path / "gen.jsonl").write_text(json.dumps({"question": long, "answer": "x"}) + "\n"
                                        + json.dumps({"question": "ab", "answer": "y"}) + "\n")
    task = GenerationTask(file=str(tmp_path / "gen.jsonl"), max_new_tokens=4, pattern=None)
    made = task.generations(Subject(model, variables, ByteTokenizer()))
    cut = generate(model, variables, [list(long[-12:].encode())], 4, jax.random.key(0), Sampling(temperature=0.0),
                   eos_id=ByteTokenizer().eos_id).new_tokens[0]
    assert made[0] == ByteTokenizer().decode(cut) and set(made) == {0, 1}
    with pytest.raises(TaskFileError, match="max_new_tokens=16 leaves no room for a prompt in the model's max_seq_len=16"):
        GenerationTask(file=str(tmp_path / "gen.jsonl"), max_new_tokens=16).generations(
            Subject(model, variables, ByteTokenizer()))


def test_a_choice_longer_than_the_model_reads_is_scored_on_its_end_with_a_warning(tmp_path):
    """A choice past the window was scored on its last ids without a word (the harness refuses it)."""
    from dew.data import ByteTokenizer
    from dew.evaluations.multiple_choice import ChoiceCutWarning, MultipleChoice

    file = _write(tmp_path / "mc.jsonl", [{"context": "q", "choices": ["a" * 40, "b"], "answer": 1},
                                           {"context": "r", "choices": ["c", "d"], "answer": 0}])
    task = MultipleChoice(file=file)
    with pytest.warns(ChoiceCutWarning, match=r"1 choice\(s\) of .*mc.jsonl' \(the first on line 1\) are longer "
                                              r"than the model's window of 16 positions, so each is scored on its "
                                              r"last 16 ids alone"):
        rows = task.rows(ByteTokenizer(), 17)
    assert rows[0].scored == 16 and len(rows[0].ids) == 17  # its last 16 ids, after one of context
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task.rows(ByteTokenizer(), 64)  # room for all: no warning


def test_a_perplexity_file_with_a_bad_record_and_null_fields_are_refused_when_the_task_is_built(tmp_path):
    """perplexity read its file at the first evaluation only (a run trained to it and lost its steps),
    and said a present key was missing; a null answer, prompt or context was scored as the text None."""
    from dew.evaluations.generation import GenerationTask
    from dew.evaluations.multiple_choice import MultipleChoice
    from dew.evaluations.perplexity import PerplexityTask

    file = _write(tmp_path / "p.jsonl", [{"text": "a b"}, {"text": 5}])
    with pytest.raises(TaskFileError, match=r"Line 2 of .*p.jsonl' holds 5 under 'text', not a document"):
        PerplexityTask(file=file)
    with pytest.raises(TaskFileError, match=r"Line 1 of .*p.jsonl' has no key 'body' \(it has \['text'\]\)"):
        PerplexityTask(file=file, text_key="body")
    for task, record, key in ((GenerationTask, {"question": "q", "answer": None}, "answer"),
                              (GenerationTask, {"question": None, "answer": "4"}, "question"),
                              (MultipleChoice, {"context": None, "choices": ["a", "b"], "answer": 0}, "context")):
        with pytest.raises(TaskFileError, match=rf"Line 1 of .*n.jsonl' holds null under '{key}'"):
            task(file=_write(tmp_path / "n.jsonl", [record]))


def test_a_task_field_holding_a_list_or_an_object_is_refused_where_it_would_be_scored_as_its_repr(tmp_path):
    """A conversation's messages as the question (TRL's records) were scored as the prompt
    "[{'role': 'user', ...}]", a list answer as "['2']"; numbers stay text, as before."""
    from dew.evaluations.generation import GenerationTask
    from dew.evaluations.multiple_choice import MultipleChoice

    messages = [{"role": "user", "content": "1+1="}]
    for task, record, key, what, extra in (
            (GenerationTask, {"question": messages, "answer": "2"}, "question", "a list", {}),
            (GenerationTask, {"question": "1+1=", "answer": ["2"]}, "answer", "a list", {}),
            (GenerationTask, {"q": {"text": "1+1="}, "answer": "2"}, "q", "an object", {"template": "Q: {q}"}),
            (MultipleChoice, {"context": {"q": "1+1="}, "choices": ["2", "3"], "answer": 0}, "context", "an object",
             {})):
        with pytest.raises(TaskFileError, match=rf"Line 1 of .*l.jsonl' holds {what} under '{key}', where the "
                                                r"task reads text"):
            task(file=_write(tmp_path / "l.jsonl", [record]), **extra)
    kept = GenerationTask(file=_write(tmp_path / "n.jsonl", [{"question": 12, "answer": 3}]))
    assert [(r.prompt, r.reference) for r in kept.problems()] == [("12", "3")]
    indexed = MultipleChoice(file=_write(tmp_path / "i.jsonl", [{"q": ["x", "y"], "choices": ["a", "b"], "answer": 1}]),
                             template="{q[1]}?")  # an index into a list is text
    assert indexed.questions()[0].context == "y?"


def test_templates_labels_and_paths_that_cannot_be_read_are_refused_by_name(tmp_path):
    """A template reaching into a field ({context.x}) raised AttributeError through the CLI; an ARC
    label that is not a list said "'int' object is not iterable"; a list under the context with no
    template was blamed on "the template None"; an empty file path was called a directory; and one
    stop string stopped at each of its letters."""
    from dew.evaluations.generation import GenerationTask
    from dew.evaluations.multiple_choice import MultipleChoice

    choice = _write(tmp_path / "c.jsonl", [{"context": "a", "choices": ["b", "c"], "answer": 0}])
    question = _write(tmp_path / "q.jsonl", [{"question": "a", "answer": "1"}])
    for build in (lambda: MultipleChoice(file=choice, template="{context.x}"),
                  lambda: GenerationTask(file=question, template="{question.x}")):
        with pytest.raises(TaskFileError, match=r"Line 1 of .*: the template '\{\w+\.x\}' cannot be filled from "
                                                r"the record \(AttributeError: .*\); its keys are \["):
            build()
    labelled = _write(tmp_path / "arc.jsonl", [{"context": "a", "choices": {"text": ["b", "c"], "label": 5},
                                                "answer": "A"}])
    with pytest.raises(TaskFileError, match=r"Line 1 of .*'choices'.label must be a list of one label per choice "
                                            r"\(2\), got 5"):
        MultipleChoice(file=labelled)
    listed = _write(tmp_path / "l.jsonl", [{"question": ["a"], "answer": "1"}])
    with pytest.raises(TaskFileError) as refused:
        GenerationTask(file=listed)
    assert "cannot be filled" not in str(refused.value) and "holds a list under 'question'" in str(refused.value)
    for task in (GenerationTask, MultipleChoice):
        with pytest.raises(TaskFileError, match=r"The task's file is empty; pass the path of a JSONL file"):
            task(file="")
    stopped = GenerationTask(file=question, stop="Answer")
    assert stopped.stop == ("Answer",) and stopped.prediction("no answer here") == "no answer here"
    assert stopped.prediction("7 Answer 8") == "7"


def test_a_text_task_is_refused_for_a_denoiser_or_a_run_without_a_tokenizer_as_it_is_built(tmp_path):
    """A masked-diffusion run scored perplexity 400 over a 257-token vocabulary and an accuracy from logits
    that predict no next token, and its generation task failed with a TypeError after every step trained."""
    from dew.data import ByteTokenizer
    from dew.evaluations.base import UnscorableModelError, scheduled
    from dew.evaluations.config import EvaluateConfig
    from dew.nn.backbones import CausalTransformer
    from dew.nn.token_denoiser import TokenDenoiser

    file = _write(tmp_path / "p.jsonl", [{"text": "a b", "context": "x", "choices": ["a", "b"], "answer": 0,
                                          "question": "1+1=", "answer_text": "2"}])
    denoiser = TokenDenoiser(vocab_size=257, emb_features=8, num_layers=1, num_heads=2, mlp_features=8,
                             max_seq_len=16)
    causal = CausalTransformer(vocab_size=257, emb_features=8, num_layers=1, num_heads=2, mlp_features=8,
                               max_seq_len=16)
    for task, fields in (("perplexity", {}), ("multiple_choice", {}),
                         ("generation", {"answer_key": "answer_text", "max_new_tokens": 4})):
        config = EvaluateConfig.model_validate({"task": task, "file": file, **fields})
        with pytest.raises(UnscorableModelError, match=rf"'{task}' scores a causal language model's next-token "
                                                       r"predictions, and this run's model, TokenDenoiser"):
            scheduled(config, denoiser, ByteTokenizer())
        with pytest.raises(UnscorableModelError, match=rf"'{task}' turns text into ids with the run's tokenizer, "
                                                       "and this run has none"):
            scheduled(config, causal, None)
        assert scheduled(config, causal, ByteTokenizer()).task is not None


def test_a_text_task_is_refused_for_a_reward_models_run_and_its_export(tmp_path, capsys):
    """A reward model's run (and its export) was scored by the text tasks through its decoder's token
    logits, which Bradley-Terry never trains: byte perplexity 300 and a multiple-choice accuracy that
    meant nothing. The objective declares it serves a score, and the tasks are refused as built."""
    import jax

    from dew.cli import main
    from dew.data import ByteTokenizer
    from dew.evaluations.base import UnscorableModelError, scheduled
    from dew.evaluations.config import EvaluateConfig
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.lm import LMObjective
    from dew.objectives.reward_model import RewardModelObjective
    from dew.pretrained.native import objective_pretrained

    file = _write(tmp_path / "p.jsonl", [{"text": "a b", "context": "x", "choices": ["a", "b"], "answer": 0}])
    causal = CausalTransformer(vocab_size=257, emb_features=8, num_layers=1, num_heads=2, mlp_features=8,
                               max_seq_len=16)
    rewards = RewardModelObjective(causal, 8, tokenizer=ByteTokenizer())
    for task in ("perplexity", "multiple_choice"):
        config = EvaluateConfig.model_validate({"task": task, "file": file})
        for objective in (rewards, RewardModelObjective):  # a run's, and an export's recorded class
            with pytest.raises(UnscorableModelError, match=rf"'{task}' scores .* trained with, "
                                                           r"RewardModelObjective, trains its model to serve a score"):
                scheduled(config, causal, ByteTokenizer(), objective=objective)
        assert scheduled(config, causal, ByteTokenizer(), objective=LMObjective(causal, 8)).task is not None

    variables = jax.device_get(rewards.init(jax.random.key(0)))
    objective_pretrained(rewards, variables).save(tmp_path / "export")
    assert main(["eval", str(tmp_path / "export"), "--task", "perplexity", "--set", f"file={file}"]) == 2
    assert "RewardModelObjective, trains its model to serve a score" in capsys.readouterr().err


def test_the_data_page_gsm8k_entry_scores_numbers_as_lm_eval_does(tmp_path):
    """docs/datasets.md's generation entry, built by the registry as a recipe's is: a reference
    written "1,600" or "$1600." and a generation that says "= 1600" are one answer once its
    ignore expressions drop the comma, dollar sign and final full stop on both sides."""
    import yaml

    from dew import registry

    page = (Path(__file__).resolve().parents[2] / "docs" / "datasets.md").read_text()
    block = re.search(r"```yaml\n(trainer:\n  evaluate:.*?)```", page, flags=re.S)
    assert block is not None
    entry = next(e for e in yaml.safe_load(block.group(1))["trainer"]["evaluate"] if e["task"] == "generation")
    file = _write(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "1000 + 600 = 1600\n#### 1,600"},
                                             {"question": "q", "answer": "#### $1600."}])
    fields = {k: v for k, v in entry.items() if k not in ("task", "every")} | {"file": file}
    task = registry.evaluations.build("generation", **fields)
    plain = registry.evaluations.build("generation", **{k: v for k, v in fields.items() if k != "ignore"})
    said = task.prediction("so 1000 + 600 = 1600 apples")
    assert said == "1600"
    for problem in task.problems():
        assert task.matches(said, problem.reference)
        assert not plain.matches(said, problem.reference)


def test_choices_kept_in_fields_of_their_own_are_named_as_a_list(exported, tmp_path):
    """PIQA keeps its two solutions in sol1 and sol2: no setting reached them (a list was refused as
    no string, one field as no list). choices_key names them in order, and scores what the same
    questions written with a choices list score; one field alone is refused saying how."""
    from dew import registry
    from dew.evaluations.multiple_choice import MultipleChoice

    _, subject = exported
    two = [(c, ch[:2], min(a, 1)) for c, ch, a in QUESTIONS]
    piqa = _write(tmp_path / "piqa.jsonl", [{"goal": c, "sol1": ch[0], "sol2": ch[1], "label": a} for c, ch, a in two])
    listed = _write(tmp_path / "listed.jsonl", [{"context": c, "choices": ch, "answer": a} for c, ch, a in two])
    # built as a recipe's trainer.evaluate entry (or dew eval --set choices_key=[sol1, sol2]) builds it
    task = registry.evaluations.build("multiple_choice", file=str(piqa), context_key="goal",
                                      choices_key=["sol1", "sol2"], answer_key="label")
    assert task.evaluate(subject) == MultipleChoice(file=str(listed)).evaluate(subject)
    with pytest.raises(TaskFileError, match=r"'sol1' must be a list of at least two strings, got '.*' \(choices kept "
                       r"in fields of their own are named as a list, choices_key: \[sol1, sol2\]\)\.$"):
        MultipleChoice(file=str(piqa), context_key="goal", choices_key="sol1", answer_key="label")


def _hand_loglikelihood(reference, context, continuation):
    """The summed log-probability of continuation after context, by transformers, split as the harnesses split."""
    tokenizer, model = reference

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    stripped = context.rstrip()
    continuation, context = context[len(stripped):] + continuation, stripped
    head = ids(context)
    tail = ids(context + continuation)[len(head):]
    row = (head + tail)[-(MAX_LEN + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([row[:-1]])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[torch.arange(len(row) - 1), torch.tensor(row[1:])]
    return float(logp[-len(tail):].sum())


def test_winogrande_partial_scoring_fills_the_blank_with_each_choice_as_lm_eval_does(exported, reference, tmp_path):
    """Winogrande's options are contexts: each fills the sentence's blank, and the rest of the sentence is
    scored after it (lm-eval's partial scoring), its answers numbered from 1. No setting reached this:
    the options were scored as continuations of the whole sentence, blank and all."""
    import yaml

    from dew import registry
    from dew.evaluations.multiple_choice import MultipleChoice

    _, subject = exported
    records = [
        {"sentence": "The trophy does not fit in the case because the _ is too big.", "option1": "trophy",
         "option2": "case", "answer": "1"},
        {"sentence": "Sarah lent Maria a book because _ had finished reading it.", "option1": "Sarah",
         "option2": "Maria", "answer": "1"},
        {"sentence": "The user asks and _ answers the question quickly.", "option1": "dew", "option2": "it",
         "answer": "2"},
        {"sentence": "Tokens go in windows, so _ are packed.", "option1": "documents", "option2": "they",
         "answer": "2"},
    ]
    file = _write(tmp_path / "winogrande.jsonl", records)
    # docs/datasets.md's entry, built by the registry as a recipe's is
    page = (Path(__file__).resolve().parents[2] / "docs" / "datasets.md").read_text()
    block = re.search(r"```yaml\n(trainer:\n  evaluate:.*?)```", page, flags=re.S)
    assert block is not None
    entry = next(e for e in yaml.safe_load(block.group(1))["trainer"]["evaluate"] if e.get("label") == "winogrande")
    fields = {k: v for k, v in entry.items() if k not in ("task", "every", "label")} | {"file": file, "batch": 3}
    task = registry.evaluations.build(entry["task"], **fields)
    by_hand, contexts = [], []
    for record in records:  # lm-eval's winogrande: partial_context and partial_target, target_delimiter " "
        cut = record["sentence"].index("_")
        filled = [record["sentence"][:cut] + record[o] for o in ("option1", "option2")]
        target = " " + record["sentence"][cut + 1:].strip()
        by_hand.append(np.asarray([_hand_loglikelihood(reference, c, target) for c in filled]))
        contexts.append(filled)
    for mine, theirs in zip(task.choice_scores(subject), by_hand, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-3)
    answers = [int(r["answer"]) - 1 for r in records]
    scores = task.evaluate(subject)
    assert scores["accuracy"] == np.mean([int(np.argmax(s)) == a for s, a in zip(by_hand, answers, strict=True)])
    # lm-eval divides by the length of each choice, which for this task is the filled context
    assert scores["accuracy_norm"] == np.mean([
        int(np.argmax(s / np.asarray([len(c) for c in filled], float))) == a
        for s, filled, a in zip(by_hand, contexts, answers, strict=True)])
    with pytest.raises(TaskFileError, match="Line 1 of .* holds the blank '_' 0 times"):
        MultipleChoice(file=_write(tmp_path / "none.jsonl", [{"context": "no mark", "choices": ["a", "b"],
                                                                   "answer": 0}]), blank="_")
    with pytest.raises(TaskFileError, match=r"the answer '3' names none of its 2 choices; give its index \(from 1"):
        MultipleChoice(file=_write(tmp_path / "three.jsonl", [records[0] | {"answer": "3"}]),
                           context_key="sentence", choices_key=["option1", "option2"], blank="_", first_answer=1)
    with pytest.raises(TaskFileError, match="blank is empty"):
        MultipleChoice(file=file, context_key="sentence", choices_key=["option1", "option2"], blank="")
