"""Supervised fine-tuning: loss masks, packed documents and the prompt/completion reader."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data.errors import MalformedRecordError, MissingKeyError
from dew.data.prompt_completion import (
    CompletionTooLongError,
    NothingToScoreWarning,
    PromptCompletion,
)
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective
from dew.registry import datasets

MODEL = CausalTransformer(vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
                          max_seq_len=16)
SEQ = 15
STEP = Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0), key=jax.random.key(0))


@pytest.fixture(scope="module")
def variables():
    return nn.meta.unbox(LMObjective(MODEL, SEQ).init(jax.random.key(0)))


def rows(seed, count=3):
    return np.random.default_rng(seed).integers(0, 32, size=(count, SEQ + 1)).astype(np.int32)


@pytest.mark.slow
def test_masked_positions_contribute_exactly_zero_gradient(variables):
    objective = LMObjective(MODEL, SEQ)
    text = rows(0)
    mask = (np.random.default_rng(1).random(text.shape) < 0.5).astype(np.int32)
    mask[:, 1] = 1  # every row scores something
    mask[:, -1] = 0  # the last token is a target only, never read
    grad = jax.grad(lambda v: objective.loss(v, {"text": text, "loss_mask": mask}, STEP)[0].total)(variables)

    # Independently: the cross-entropy summed over the unmasked targets alone.
    def hand(v):
        logits = MODEL.apply(v, text[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, text[:, 1:])
        return jnp.sum(jnp.where(mask[:, 1:] == 1, ce, 0.0))

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad, jax.grad(hand)(variables))
    # A masked target may be anything: the gradient does not change by a bit.
    scrambled = text.copy()
    scrambled[:, -1] = (text[:, -1] + 7) % 32
    again = jax.grad(lambda v: objective.loss(v, {"text": scrambled, "loss_mask": mask}, STEP)[0].total)(variables)
    jax.tree.map(np.testing.assert_array_equal, grad, again)
    loss, aux = objective.loss(variables, {"text": text, "loss_mask": mask}, STEP)
    assert float(loss.count) == mask[:, 1:].sum() and float(aux.metrics["accuracy"].count) == mask[:, 1:].sum()


def test_packed_documents_give_each_document_its_unpacked_loss(variables):
    objective = LMObjective(MODEL, SEQ)
    rng = np.random.default_rng(2)
    documents = [rng.integers(0, 32, size=n).astype(np.int32) for n in (5, 7, 4)]
    text = np.zeros((1, SEQ + 1), np.int32)
    segments = np.zeros((1, SEQ + 1), np.int32)
    start = 0
    for number, doc in enumerate(documents, 1):
        text[0, start:start + len(doc)], segments[0, start:start + len(doc)] = doc, number
        start += len(doc)
    text[0, start:] = rng.integers(0, 32, size=SEQ + 1 - start)  # padding: anything

    totals = []
    for number, doc in enumerate(documents, 1):
        only = (segments == number).astype(np.int32)
        loss, _ = objective.loss(variables, {"text": text, "segment_ids": segments, "loss_mask": only}, STEP)
        # The document alone, as the model reads it with no packing at all.
        logits = MODEL.apply(variables, doc[None, :-1])
        alone = optax.softmax_cross_entropy_with_integer_labels(logits, doc[None, 1:])
        np.testing.assert_allclose(float(loss.total), float(alone.sum()), rtol=2e-5)
        assert float(loss.count) == len(doc) - 1
        totals.append(float(loss.total))
    packed, _ = objective.loss(variables, {"text": text, "segment_ids": segments}, STEP)
    np.testing.assert_allclose(float(packed.total), sum(totals), rtol=2e-5)
    assert float(packed.count) == sum(len(d) - 1 for d in documents)


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_reader_masks_prompts_and_packs_records_into_numbered_segments(tmp_path):
    files = write(tmp_path / "a.jsonl", [{"prompt": "ab", "completion": "c"}, {"prompt": "de", "completion": "fg"},
                                         {"prompt": "hijk", "completion": "lmn"}])
    reader = datasets.build("prompt_completion", files=files, length=9)
    got = reader.rows()
    eos = 256
    assert got["text"].tolist() == [
        [97, 98, 99, eos, 100, 101, 102, 103, eos, eos],
        [104, 105, 106, 107, 108, 109, 110, eos, eos, eos],
    ]
    assert got["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]]
    assert got["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
    unpacked = PromptCompletion(files=files, length=9, pack=False).rows()
    assert unpacked["text"].shape == (3, 10) and unpacked["segment_ids"].max() == 1
    from dew.data import DataPartition

    batch = next(reader.load(batch=2).train(DataPartition()))
    assert set(batch) == {"text", "loss_mask", "segment_ids"} and batch["text"].shape == (2, 10)


def test_a_chat_template_renders_the_record_as_two_turns_and_scores_the_assistants(tmp_path):
    """With a chat template the prompt is the user turn and the generation prompt, the completion
    what the assistant turn adds (its end of turn included, no end-of-document id after it)."""
    pytest.importorskip("jinja2")
    from dew.data.chat_template import ChatTemplateError

    files = write(tmp_path / "a.jsonl", [{"prompt": "ab", "completion": "c"}])
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }};{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    record = PromptCompletion(files=files, length=32, chat_template=template, pack=False).encoded()[0]
    prompt, completion = "<user>ab;<assistant>", "c;"
    assert record.ids.tolist() == [*prompt.encode(), *completion.encode()]
    assert record.mask.tolist() == [0] * len(prompt) + [1] * len(completion)
    # The same template in a tokenizer folder is used without naming it; a tokenizer.json alone is not.
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    from dew.pretrained.tokenizers import byte_level

    byte_level().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    assert PromptCompletion(files=files, length=32, tokenizer=str(folder), pack=False).encoded()[0].ids.tolist() \
        == record.ids.tolist()
    plain = PromptCompletion(files=files, length=32, tokenizer=str(folder / "tokenizer.json"), pack=False)
    assert plain.encoded()[0].ids.tolist() == [*b"abc", 256]
    # A generation prompt the whole conversation does not start with cannot split the record.
    odd = template.replace("<assistant>{% endif %}", "<model>{% endif %}")
    with pytest.raises(ChatTemplateError, match=r"a\.jsonl:1: the chat template renders the user turn"):
        PromptCompletion(files=files, length=32, chat_template=odd).encoded()


def test_a_long_prompt_loses_its_start_and_a_long_completion_fails_naming_the_record_and_limit(tmp_path):
    from dew.data.chat import TruncatedWarning

    files = write(tmp_path / "b.jsonl", [{"prompt": "0123456789", "completion": "abc"}])
    with pytest.warns(TruncatedWarning, match=r"1 record\(s\) were longer .* their prompts lost their first "
                                              r"tokens \(the first: .*b\.jsonl:1\)"):
        got = PromptCompletion(files=files, length=5).rows()
    assert got["text"][0].tolist() == [56, 57, 97, 98, 99, 256]  # the prompt's last two bytes remain
    # A tokenizer that starts text with a beginning-of-text id (Llama's) keeps it first: the
    # prompt loses its first tokens after it (the row began mid-prompt, without it).
    pytest.importorskip("transformers")
    from dew.families.examples import tokenizer as family_tokenizer

    folder = tmp_path / "llama"
    theirs = family_tokenizer("llama")
    theirs.save_pretrained(str(folder))
    bos = theirs.bos_token_id
    with pytest.warns(TruncatedWarning):
        kept = PromptCompletion(files=files, length=6, tokenizer=str(folder / "tokenizer.json")).encoded()[0]
    completion = theirs("abc", add_special_tokens=False)["input_ids"]  # then the tokenizer.json's end id
    prompt = theirs("0123456789")["input_ids"]
    room = 7 - 1 - len(completion) - 1  # a row of length + 1, less the kept id, the completion and its end
    assert prompt[0] == bos and len(kept.ids) == 7
    assert kept.ids.tolist()[:-1] == [bos, *prompt[len(prompt) - room:], *completion]
    too_long = write(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "ok"}, {"prompt": "p", "completion": "abcdefgh"}])
    with pytest.raises(CompletionTooLongError, match=r"c\.jsonl:2: the completion is 9 tokens .* length \+ 1 = 6"):
        PromptCompletion(files=too_long, length=5).rows()


def test_a_record_with_nothing_to_score_warns_naming_it_and_is_skipped(tmp_path):
    files = write(tmp_path / "d.jsonl", [{"prompt": "p", "completion": ""}, {"prompt": "q", "completion": "r"}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = PromptCompletion(files=files, length=5).rows()
    assert [str(w.message) for w in caught if w.category is NothingToScoreWarning][0].startswith(
        f"{tmp_path / 'd.jsonl'}:1 has an empty (or blank) completion")
    assert got["text"].shape == (1, 6) and got["loss_mask"].sum() == 2
    with pytest.raises(MissingKeyError, match=r"d2\.jsonl:1 has no text under 'completion' .*\(prompts alone, for "
                                              r"GRPO or PPO to complete, are the prompts reader's\)"):
        PromptCompletion(files=write(tmp_path / "d2.jsonl", [{"prompt": "p", "answer": "x"}]), length=5).rows()
    # A number where text is expected is no missing key: setting completion_key= would not help.
    with pytest.raises(MalformedRecordError, match=r"d3\.jsonl:1 holds a int under 'completion' \(5\), not text"):
        PromptCompletion(files=write(tmp_path / "d3.jsonl", [{"prompt": "p", "completion": 5}]), length=5).rows()


def test_the_fine_tuned_model_is_a_pipeline_that_answers_the_prompts_it_learned(tmp_path):
    from dew import Trainer
    from dew.data import ByteTokenizer
    from dew.sampling import TextGeneration

    files = write(tmp_path / "qa.jsonl", [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+5=", "completion": "8"},
                                          {"prompt": "9+0=", "completion": "9"}])
    reader = PromptCompletion(files=files, length=15)
    model = CausalTransformer(vocab_size=257, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
                              max_seq_len=16, position_embedding="rotary", mlp_activation="swiglu")
    objective = LMObjective(model, 15, tokenizer=ByteTokenizer())
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).fit(reader.load(batch=2), steps=80,
                                                                           log_every=80)
    pipeline = objective.pipeline(state)
    assert pipeline(["2+2=", "3+5=", "9+0="], max_new_tokens=4) == ["4", "8", "9"]  # each stops at its end id
    pipeline.save(tmp_path / "tuned")
    loaded = TextGeneration.load(tmp_path / "tuned")
    assert loaded(["2+2=", "3+5="], max_new_tokens=4) == ["4", "8"]


def test_conversational_records_are_read_as_trl_reads_them(tmp_path):
    """TRL's conversational prompt/completion records (messages under prompt and completion, a system
    turn among them) were refused with advice to write the list as a JSON string, which would have
    trained on its JSON text."""
    pytest.importorskip("transformers")
    from dew.data.chat_template import ChatTemplateError
    from dew.families.examples import tokenizer as family_tokenizer

    folder = tmp_path / "llama"
    theirs = family_tokenizer("llama")
    theirs.save_pretrained(str(folder))
    prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 2?"}]
    completion = [{"role": "assistant", "content": "It is 4."}]
    files = write(tmp_path / "c.jsonl", [{"prompt": prompt, "completion": completion},
                                         {"prompt": prompt, "completion": "It is 4."}])  # text completes it too
    records = PromptCompletion(files=files, length=128, tokenizer=str(folder), pack=False).encoded()

    def ids(messages, **kwargs):  # transformers 5 returns a BatchEncoding here, 4 a list
        made = theirs.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(made["input_ids"] if isinstance(made, Mapping) else made)

    head = ids(prompt, add_generation_prompt=True)  # TRL: the prompt, then the rest of the whole
    whole = ids([*prompt, *completion])
    assert whole[: len(head)] == head
    for record in records:
        assert record.ids.tolist() == whole
        assert record.mask.tolist() == [0] * len(head) + [1] * (len(whole) - len(head))
    bare = write(tmp_path / "bare.jsonl", [{"prompt": prompt, "completion": completion}])
    with pytest.raises(ChatTemplateError, match=r"bare\.jsonl:1 gives its turns as messages, which a chat template "
                                                r"renders, and the tokenizer 'byte' ships none"):
        PromptCompletion(files=bare, length=128).encoded()


def test_unpaired_preference_records_become_the_rows_kto_reads(tmp_path):
    """TRL's unpaired preference records ({"prompt", "completion", "label"}) had no reader: only the
    addition reader made KTO's rows, and prompt_completion dropped the label."""
    from dew.data.errors import MalformedRecordError as Malformed

    files = write(tmp_path / "k.jsonl", [{"prompt": "2+2=", "completion": "4", "label": True},
                                         {"prompt": "3+3=", "completion": "7", "label": False}])
    rows = PromptCompletion(files=files, length=12, label_key="label").rows()
    assert sorted(rows) == ["completion", "completion_mask", "label", "prompt_length"]
    assert rows["label"].tolist() == [1, 0] and rows["prompt_length"].tolist() == [4, 4]
    assert rows["completion"][0, :6].tolist() == [*b"2+2=4", 256] and rows["completion"].shape == (2, 13)
    assert rows["completion_mask"][1].tolist() == [0, 0, 0, 0, 1, 1] + [0] * 7  # the completion and its end
    bad = write(tmp_path / "b.jsonl", [{"prompt": "a", "completion": "b", "label": "yes"}])
    with pytest.raises(Malformed, match=r'b\.jsonl:1 holds "yes" under \'label\' where a label goes'):
        PromptCompletion(files=bad, length=12, label_key="label").rows()


def test_preference_records_become_the_pairs_dpo_reads(tmp_path):
    """TRL's standard preference records ({"prompt", "chosen", "rejected"} as text) had no reader (the
    chat reader takes conversations only); conversational ones read as the chat reader reads them."""
    pytest.importorskip("transformers")
    from dew.data import ChatPreferences
    from dew.data.chat import TruncatedWarning
    from dew.families.examples import tokenizer as family_tokenizer

    files = write(tmp_path / "p.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "five"}])
    rows = PromptCompletion(files=files, length=10, completion_key="chosen", rejected_key="rejected").rows()
    assert rows["prompt_length"].tolist() == [4]
    assert rows["chosen"][0].tolist() == [*b"2+2=4", 256] + [256] * 5
    assert rows["rejected"][0].tolist() == [*b"2+2=five", 256] + [256] * 2
    assert rows["chosen_mask"][0].tolist() == [0] * 4 + [1, 1] + [0] * 5
    assert rows["rejected_mask"][0].tolist() == [0] * 4 + [1] * 5 + [0] * 2
    # a prompt too long for the longer side loses its front on both, alike
    long = write(tmp_path / "l.jsonl", [{"prompt": "0123456789", "chosen": "a", "rejected": "bcd"}])
    with pytest.warns(TruncatedWarning):
        cut = PromptCompletion(files=long, length=8, completion_key="chosen", rejected_key="rejected").rows()
    assert cut["prompt_length"].tolist() == [5] and cut["rejected"][0].tolist() == [*b"56789bcd", 256]
    assert cut["chosen"][0, :7].tolist() == [*b"56789a", 256]
    # conversational pairs: what the chat reader makes of the same records
    folder = tmp_path / "llama"
    family_tokenizer("llama").save_pretrained(str(folder))
    prompt = [{"role": "user", "content": "What is 2 plus 2?"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4."}],
              "rejected": [{"role": "assistant", "content": "Five, I think."}]}
    files = write(tmp_path / "c.jsonl", [record])
    ours = PromptCompletion(files=files, length=64, tokenizer=str(folder), completion_key="chosen",
                            rejected_key="rejected").rows()
    theirs = ChatPreferences(files=files, tokenizer=str(folder), length=64).rows()
    assert ours["prompt_length"].tolist() == theirs["prompt_length"].tolist()
    for side in ("chosen", "rejected"):
        mask = ours[f"{side}_mask"][0].astype(bool)
        assert mask.tolist() == theirs[f"{side}_mask"][0].astype(bool).tolist()
        end = int(np.flatnonzero(mask)[-1]) + 1
        assert ours[side][0, :end].tolist() == theirs[side][0, :end].tolist()
    # a pair preferring nothing (its sides alike) was kept without a word; one with an empty side
    # (as the docs say of an empty completion) was kept too, its loss comparing the end id alone
    from dew.data.prompt_completion import NothingToScoreWarning

    alike = write(tmp_path / "a.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "five"},
                                         {"prompt": "1+1=", "chosen": "", "rejected": ""},
                                         {"prompt": "3+3=", "chosen": "6", "rejected": "6"},
                                         {"prompt": "4+4=", "chosen": "8", "rejected": None},
                                         {"prompt": "5+5=", "chosen": "", "rejected": "11"}])
    with pytest.warns(NothingToScoreWarning) as caught:
        kept = PromptCompletion(files=alike, length=10, completion_key="chosen", rejected_key="rejected").rows()
    said = " | ".join(str(warning.message) for warning in caught)
    assert re.search(r"1 preference pair\(s\) give the same chosen and rejected completion \(the first at "
                     r"\S*a.jsonl:3\)", said), said
    assert re.search(r"3 preference pair\(s\) give an empty \(or blank\) chosen or rejected completion \(the first at "
                     r"\S*a.jsonl:2\).*left out", said), said
    assert kept["prompt_length"].tolist() == [4, 4]
    assert kept["chosen"][:, :6].tolist() == [[*b"2+2=4", 256], [*b"3+3=6", 256]]
