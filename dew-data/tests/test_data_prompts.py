"""prompts: prompt records from JSONL for GRPO and PPO, with what their rewards read beside them."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pytest

from dew.data.chat import TruncatedWarning
from dew.data.chat_template import ChatTemplateError
from dew.data.errors import MalformedRecordError, MissingKeyError
from dew.data.prompts import Prompts


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _text(column: np.ndarray) -> str:
    """A text column's row as a reward reads it (dew.rewards: UTF-8 bytes, -1 padding left out)."""
    return bytes(int(v) for v in column if v >= 0).decode()


def test_text_prompts_and_the_keys_beside_them_become_columns(tmp_path):
    files = _write(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4", "level": 1, "meta": {"k": "é"}},
                                           {"prompt": "été+1=", "answer": "23", "level": 2, "meta": [1]}])
    records = Prompts(files=files).records()
    first, second = records[0], records[1]
    assert first["prompt"][: first["prompt_length"]].tolist() == list(b"2+2=")
    assert second["prompt"][: second["prompt_length"]].tolist() == list("été+1=".encode())
    assert _text(first["answer"]) == "4" and _text(second["answer"]) == "23"
    assert first["level"] == 1 and records.columns["level"].dtype == np.int64
    assert json.loads(_text(first["meta"])) == {"k": "é"}  # a nested value as its JSON text
    # A column mixing whole numbers and decimals, a bool, a number past int64: text as str() writes it
    # (the whole numbers had become 4.0, which an exact match of "4" never equals).
    mixed = Prompts(files=_write(tmp_path / "m.jsonl", [
        {"prompt": "a", "answer": 4, "flag": True, "big": 2**70},
        {"prompt": "b", "answer": 0.5, "flag": False, "big": 1}])).records()
    assert [_text(mixed[i]["answer"]) for i in (0, 1)] == ["4", "0.5"]
    assert _text(mixed[0]["flag"]) == "True" and _text(mixed[0]["big"]) == str(2**70)


def test_a_null_beside_a_prompt_is_refused_naming_its_line_not_read_as_the_text_none(tmp_path):
    """An answer of null reached the reward as the text "None" (an exact match of that text scored it
    right), with no word; the evaluation tasks already refused it."""
    files = _write(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": None}])
    with pytest.raises(MalformedRecordError, match=r"p\.jsonl:2 holds null under 'answer'.*leave the key out"):
        Prompts(files=files).records()


def test_a_conversational_prompt_is_what_apply_chat_template_makes_with_its_generation_prompt(tmp_path):
    pytest.importorskip("transformers")
    from dew.families.examples import tokenizer as family_tokenizer

    folder = tmp_path / "llama"
    theirs = family_tokenizer("llama")
    theirs.save_pretrained(str(folder))
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+2?"}]
    records = Prompts(files=_write(tmp_path / "c.jsonl", [{"prompt": messages, "answer": "4"}]),
                      tokenizer=str(folder)).records()
    made = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = list(made["input_ids"] if isinstance(made, Mapping) else made)
    assert records[0]["prompt"][: records[0]["prompt_length"]].tolist() == expected
    # A prompt ending with an assistant's turn (a prefilled start of the answer) is continued from it, as
    # TRL renders it with continue_final_message; it had the turn closed and another one opened.
    prefilled = [*messages, {"role": "assistant", "content": "The answer is"}]
    records = Prompts(files=_write(tmp_path / "f.jsonl", [{"prompt": prefilled}]), tokenizer=str(folder)).records()
    made = theirs.apply_chat_template(prefilled, tokenize=True, continue_final_message=True)
    expected = list(made["input_ids"] if isinstance(made, Mapping) else made)
    assert records[0]["prompt"][: records[0]["prompt_length"]].tolist() == expected
    with pytest.raises(ChatTemplateError, match=r"c\.jsonl:1 gives its prompt as messages, which a chat template "
                                                r"renders, and the tokenizer 'byte' ships none"):
        Prompts(files=str(tmp_path / "c.jsonl")).records()


def test_bad_records_are_named_and_a_long_prompt_keeps_its_end(tmp_path):
    with pytest.raises(MissingKeyError, match=r"b\.jsonl:2 has no 'answer', which .*b\.jsonl:1 holds beside"):
        Prompts(files=_write(tmp_path / "b.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])).records()
    with pytest.raises(MissingKeyError, match=r"a\.jsonl:1 has no 'answer', which .*a\.jsonl:2 holds beside"):
        Prompts(files=_write(tmp_path / "a.jsonl", [{"prompt": "a"}, {"prompt": "b", "answer": "1"}])).records()
    with pytest.raises(MalformedRecordError, match=r"e\.jsonl:1 holds an empty prompt"):
        Prompts(files=_write(tmp_path / "e.jsonl", [{"prompt": ""}])).records()
    with pytest.raises(MissingKeyError, match=r"n\.jsonl:1 has no prompt under 'prompt' \(keys: \['question'\]\)"):
        Prompts(files=_write(tmp_path / "n.jsonl", [{"question": "a"}])).records()
    with pytest.raises(MalformedRecordError, match="'prompt_length', a column the rollout fills"):
        Prompts(files=_write(tmp_path / "r.jsonl", [{"prompt": "a", "prompt_length": 3}])).records()
    with pytest.warns(TruncatedWarning, match=r"1 prompt\(s\) were longer than length=4 tokens"):
        records = Prompts(files=_write(tmp_path / "l.jsonl", [{"prompt": "0123456789"}]), length=4).records()
    assert records[0]["prompt"][: records[0]["prompt_length"]].tolist() == list(b"6789")


def test_each_prompt_rides_along_as_given_without_changing_the_datas_fingerprint(tmp_path):
    """prompt_given (each prompt as the records gave it, for a reward model of another tokenizer) is a
    column the reader did not make before: in the saved position's fingerprint it refused to resume an RL
    run saved before it, blaming the data ("a file edited since the checkpoint")."""
    from dew.data.sources import ArrayRecords

    chat = [{"role": "user", "content": "héllo 😀 2+2?"}]
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
                                      + json.dumps({"prompt": chat, "answer": "4"}) + "\n")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    records = Prompts(files=str(tmp_path / "q.jsonl"), chat_template=template).records()
    given = [bytes(int(v) for v in records[i]["prompt_given"] if v >= 0).decode() for i in range(2)]
    assert [json.loads(text) for text in given] == ["2+2=", chat]
    before = ArrayRecords({k: v for k, v in records.columns.items() if k != "prompt_given"})  # the old reader's
    assert records.fingerprint() == before.fingerprint()
    assert records.subset(np.array([1, 0])).fingerprint() == before.subset(np.array([1, 0])).fingerprint()


def test_a_prompt_the_policy_sees_cut_rides_along_as_null(tmp_path):
    """A reward reads a prompt the policy saw cut as the policy saw it: scored whole, a prompt past the
    reward model's length stopped the run at its first rollout, with advice (a shorter data.length) that
    no longer shortened it."""
    import warnings

    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "2+2="}) + "\n" + json.dumps({"prompt": "12345+1="}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedWarning)
        records = Prompts(files=str(tmp_path / "q.jsonl"), length=6).records()
    given = [json.loads(bytes(int(v) for v in records[i]["prompt_given"] if v >= 0).decode()) for i in range(2)]
    assert given == ["2+2=", None]
