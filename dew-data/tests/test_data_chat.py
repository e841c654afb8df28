"""The chat readers render conversations with the model's own template and score the assistant's
tokens exactly as transformers' apply_chat_template marks them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bpe_helpers import MARKED, UNMARKED, UNMARKED_AS_MARKED, build_tokenizer

pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "It is four."},
     {"role": "user", "content": "Thank you!"},
     {"role": "assistant", "content": "You are welcome, café!"}],
    [{"role": "user", "content": "def add(x, y)"},
     {"role": "assistant", "content": "return x + y"},
     {"role": "tool", "content": "ok"},
     {"role": "assistant", "content": "Documents are packed."}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello!"}],
]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _asked(folder, prompt):
    """The ids of prompt as transformers renders it for the model to answer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


def _reference(folder, conversation):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("marked"))


def test_tokens_and_mask_equal_transformers(marked, tmp_path):
    from dew.data.chat import Chat

    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    encoded = Chat(files=str(files), tokenizer=str(marked), length=256).encoded()
    assert len(encoded) == len(CONVERSATIONS)
    for conversation, got in zip(CONVERSATIONS, encoded, strict=True):
        ids, mask = _reference(marked, conversation)
        assert got.ids.tolist() == ids
        assert got.mask.tolist() == mask
        assert 0 < got.mask.sum() < len(ids)


def test_a_template_without_markers_finds_the_same_turns(tmp_path):
    """Rendering up to each assistant turn finds the spans a marked template declares."""
    from dew.data.chat import Chat

    plain = build_tokenizer(tmp_path / "plain", template=UNMARKED)
    reference = build_tokenizer(tmp_path / "reference", template=UNMARKED_AS_MARKED)
    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    encoded = Chat(files=str(files), tokenizer=str(plain), length=256).encoded()
    for conversation, got in zip(CONVERSATIONS, encoded, strict=True):
        ids, mask = _reference(reference, conversation)
        assert (got.ids.tolist(), got.mask.tolist()) == (ids, mask)


# Phi-3's published style: a conversation not asked to continue ends with the eos token.
CLOSED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}")
CLOSED_AS_MARKED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                    "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
                    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}")
# A ChatML template that ignores add_generation_prompt: each turn writes its own header.
HEADED = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
HEADED_AS_MARKED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                    "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
                    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")


@pytest.mark.parametrize("plain, marked_like", [(CLOSED, CLOSED_AS_MARKED), (HEADED, HEADED_AS_MARKED)],
                         ids=["closed-by-eos", "ignores-the-generation-prompt"])
def test_unmarked_templates_in_two_more_published_styles_find_the_turns_a_marked_one_declares(
        plain, marked_like, tmp_path):
    """Phi-3's style ends an unanswered conversation with eos_token, so every conversation of more
    than one assistant turn was refused; a template ignoring add_generation_prompt had each
    assistant header scored. Both now mark what the same template with markers marks."""
    from dew.data.chat import Chat

    folder = build_tokenizer(tmp_path / "plain", template=plain, eos="<|endoftext|>")
    reference = build_tokenizer(tmp_path / "reference", template=marked_like, eos="<|endoftext|>")
    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    encoded = Chat(files=str(files), tokenizer=str(folder), length=256).encoded()
    for conversation, got in zip(CONVERSATIONS, encoded, strict=True):
        ids, mask = _reference(reference, conversation)
        assert (got.ids.tolist(), got.mask.tolist()) == (ids, mask)


def test_packed_rows_keep_each_conversation_and_its_mask(marked, tmp_path):
    from dew.data.chat import Chat

    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 3])
    chat = Chat(files=str(files), tokenizer=str(marked), length=127)
    encoded, rows = chat.encoded(), chat.rows()
    assert rows["text"].shape[1] == 128 and rows["text"].shape[0] < len(encoded)
    pieces = []
    for text, mask, segments in zip(rows["text"], rows["loss_mask"], rows["segment_ids"], strict=True):
        for number in range(1, segments.max() + 1):
            here = segments == number
            assert np.flatnonzero(here).tolist() == list(range(here.argmax(), here.argmax() + here.sum()))
            pieces.append((text[here].tolist(), mask[here].tolist()))
        assert not mask[segments == 0].any()
    assert pieces == [(c.ids.tolist(), c.mask.tolist()) for c in encoded]


def test_an_unknown_role_names_the_record(marked, tmp_path):
    from dew.data.chat import Chat, ChatRecordError

    bad = [{"messages": CONVERSATIONS[0]},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]
    files = _write(tmp_path / "chat.jsonl", bad)
    with pytest.raises(ChatRecordError, match=r"Message 1 of line 2 of .*chat.jsonl.* role 'robot'"):
        Chat(files=str(files), tokenizer=str(marked)).encoded()
    # Content that is no text (a list of parts, a number) was rendered as its Python repr and trained.
    for content, kind in (([{"type": "text", "text": "hello"}], "list"), (4, "int")):
        files = _write(tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": content}]}])
        with pytest.raises(ChatRecordError, match=rf"Message 1 of line 1 of .*parts.jsonl.* content of type {kind}"):
            Chat(files=str(files), tokenizer=str(marked)).encoded()


def test_conversations_from_parquet_equal_those_from_jsonl(marked, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dew.data.chat import Chat

    jsonl = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    pq.write_table(pa.table({"messages": CONVERSATIONS}), tmp_path / "chat.parquet")
    a = Chat(files=str(jsonl), tokenizer=str(marked), length=200).rows()
    b = Chat(files=str(tmp_path / "chat.parquet"), tokenizer=str(marked), length=200).rows()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_preference_pairs_score_the_answers_after_their_shared_prompt(marked, tmp_path):
    from dew.data.chat import ChatPreferences

    dpo = pytest.importorskip("dew.objectives.dpo")  # the objective these rows are for

    prompt = [{"role": "user", "content": "What is two plus two?"}]
    records = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "It is four."}],
                "rejected": [{"role": "assistant", "content": "Five, thank you."}]},
               {"chosen": CONVERSATIONS[2], "rejected": CONVERSATIONS[2][:1] + [
                   {"role": "assistant", "content": "Documents are packed."}]},
               # Answers that open alike: their shared words are scored too (they were taken for
               # prompt, as the first token the two sides differ at).
               {"prompt": prompt, "chosen": [{"role": "assistant", "content": "It is four."}],
                "rejected": [{"role": "assistant", "content": "It is five."}]}]
    files = _write(tmp_path / "pairs.jsonl", records)
    rows = ChatPreferences(files=str(files), tokenizer=str(marked), length=63).rows()
    dpo.check_pairs(rows)  # what DPO's rollout checks before each step
    from dew.nn.backbones import CausalTransformer

    model = CausalTransformer(vocab_size=400, emb_features=8, num_layers=1, num_heads=2, mlp_features=16,
                              max_seq_len=64)
    assert set(dpo.DPOObjective(model, 63).required_keys()) <= set(rows)
    for i, record in enumerate(records):
        for side in ("chosen", "rejected"):
            ids, mask = _reference(marked, record.get("prompt", []) + record[side])
            n, common = len(ids), int(rows["prompt_length"][i])
            assert rows[side][i, :n].tolist() == ids and not rows[side][i, n:].any()
            expected = [m if t >= common else 0 for t, m in enumerate(mask)]
            assert rows[f"{side}_mask"][i, :n].tolist() == expected and sum(expected) > 0
        assert rows["chosen"][i, :common].tolist() == rows["rejected"][i, :common].tolist()
        # The prompt ends where TRL's does: the prompt messages (given, or those both sides open
        # with) rendered with the generation prompt.
        asked = _asked(marked, record.get("prompt") or record["chosen"][:1])
        assert common == len(asked) and rows["chosen"][i, :common].tolist() == asked


def test_preference_pairs_with_an_empty_side_are_left_out_and_renamed_sides_read_as_dpo_names(marked, tmp_path):
    """A side whose assistant turn says nothing scored the end-of-turn token alone, kept without a
    word; sides read under other keys came out under those keys, which DPO does not read."""
    from dew.data.chat import ChatPreferences
    from dew.data.prompt_completion import NothingToScoreWarning

    prompt = [{"role": "user", "content": "What is two plus two?"}]
    good = {"prompt": prompt, "pos": [{"role": "assistant", "content": "It is four."}],
            "neg": [{"role": "assistant", "content": "Five."}]}
    records = [good,
               {"prompt": prompt, "pos": [{"role": "assistant", "content": ""}], "neg": good["neg"]},
               {"prompt": prompt, "pos": good["pos"], "neg": [{"role": "assistant", "content": ""}]}]
    files = _write(tmp_path / "pairs.jsonl", records)
    with pytest.warns(NothingToScoreWarning, match=r"2 preference pair\(s\) .*no assistant text on one side.*"
                                                   r"line 2 of \S*pairs.jsonl"):
        rows = ChatPreferences(files=str(files), tokenizer=str(marked), length=63, chosen_key="pos",
                               rejected_key="neg").rows()
    assert sorted(rows) == ["chosen", "chosen_mask", "prompt_length", "rejected", "rejected_mask"]
    for side, key in (("chosen", "pos"), ("rejected", "neg")):
        ids, _ = _reference(marked, prompt + good[key])
        assert rows[side].shape[0] == 1 and rows[side][0, :len(ids)].tolist() == ids


def test_the_template_is_read_from_the_tokenizer_files(tmp_path):
    from dew.data.chat_template import ChatTemplateError, read_chat_template

    folder = build_tokenizer(tmp_path / "tok", template=None)
    with pytest.raises(ChatTemplateError, match="No chat template"):
        read_chat_template(folder)
    (folder / "chat_template.jinja").write_text(MARKED)
    template = read_chat_template(folder / "tokenizer.json")
    assert template.marks_generation and template.special_tokens["eos_token"] == "<|im_end|>"


def test_the_template_runs_sandboxed(tmp_path):
    from dew.data.chat_template import ChatTemplate, ChatTemplateError

    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="refused the conversation: no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([{"role": "user", "content": "x"}])


def test_a_template_that_asks_for_gigabytes_is_refused_and_ordinary_repetition_renders():
    # A hundred bytes of template, {{ 'x' * 3000000000 }}, took 3 GB of memory inside the sandbox.
    import resource

    from dew.data.chat_template import ChatTemplate, ChatTemplateError

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for bomb in ("{{ ('x' * 3000000000)|length }}", "{{ (3000000000 * ['x'])|length }}", "{{ 7 ** 99999999 }}"):
        with pytest.raises(ChatTemplateError, match="more than|larger than dew renders"):
            ChatTemplate(bomb).render([{"role": "user", "content": "x"}])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was built
    indented = ChatTemplate("{{ '  ' * 2 }}{{ 2 ** 10 }}{{ 2 * 'ab' }}{{ ([0] * 3)|length }}")
    assert indented.render([]).text == "    1024abab3"


def test_padding_that_asks_for_gigabytes_is_refused_and_ordinary_padding_renders():
    """Repetition was bounded, but padding was not: 'x'.ljust(n), center(n), '%nd' % 1 and '{:>n}'.format(1)
    each built a string of n characters from some thirty bytes of template."""
    from dew.data.chat_template import ChatTemplate, ChatTemplateError

    for bomb in ("{{ 'x'.ljust(3000000000) }}", "{{ 'x'|center(3000000000) }}", "{{ '%3000000000d' % 1 }}",
                 "{{ '%.3000000000f' % 1 }}", "{{ '{:>3000000000}'.format(1) }}", "{{ 'x'|indent(3000000000) }}"):
        with pytest.raises(ChatTemplateError, match="more than the|wider than the"):
            ChatTemplate(bomb).render([{"role": "user", "content": "x"}])
    padded = ChatTemplate("{{ 'ab'.ljust(4) }}|{{ 'x'|center(3) }}|{{ '%03d' % 7 }}|{{ '{:>3}'.format(1) }}|"
                          "{{ '%s: %s' % ('a', 'b') }}")
    assert padded.render([]).text == "ab  | x |007|  1|a: b"


def test_a_held_out_share_smaller_than_a_batch_is_refused_when_the_data_loads(marked, tmp_path):
    """The run would otherwise train until its first evaluation and stop there."""
    from dew.data.base import SINGLE
    from dew.data.chat import Chat
    from dew.data.errors import EmptyDatasetError

    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 4])
    chat = Chat(files=str(files), tokenizer=str(marked), length=256, pack=False)
    rows = len(chat.rows()["text"])
    held = round(rows * 0.25)
    assert 0 < held < 4 < rows - held
    with pytest.raises(EmptyDatasetError, match=rf"holds {held} records, fewer than one global batch of 4"):
        chat.load(batch=4, val_fraction=0.25)
    dataset = chat.load(batch=held, val_fraction=0.25)  # a share of one batch loads and reads it
    assert dataset.val is not None
    assert sum(len(b["text"]) for b in dataset.val(SINGLE)) == held


def test_a_conversation_cut_to_nothing_scored_is_said_to_be_left_out(marked, tmp_path):
    """A conversation whose assistant turn lies past a row's end was dropped, and the warning said
    it was cut to fit."""
    from dew.data.chat import Chat, TruncatedWarning
    from dew.data.errors import EmptyDatasetError

    long = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "Hello!"}]
    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in (long, CONVERSATIONS[2], long)])
    with pytest.warns(TruncatedWarning, match=r"2 conversation\(s\) were longer .*; 2 of them kept no "
                                              r"assistant token to score within it and were left out"):
        encoded = Chat(files=str(files), tokenizer=str(marked), length=24).encoded()
    assert len(encoded) == 1
    # Every one cut so: the error blamed the data ("holds no conversation with an assistant turn").
    files = _write(tmp_path / "long.jsonl", [{"messages": long}] * 3)
    with pytest.warns(TruncatedWarning), pytest.raises(
            EmptyDatasetError, match=r"begin within a row of 25 tokens: 3 lost .*long.jsonl.* Raise length"):
        Chat(files=str(files), tokenizer=str(marked), length=24).encoded()


def test_records_with_nothing_to_score_are_counted_in_a_warning(marked, tmp_path):
    """A conversation without an assistant turn and a pair whose two sides are the same were left out
    without a word: 10 of 15 conversations and 10 of 14 pairs trained, and nothing said so."""
    from dew.data.chat import Chat, ChatPreferences
    from dew.data.prompt_completion import NothingToScoreWarning

    asked = [{"role": "user", "content": "q"}]
    files = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[2]}] * 2 + [{"messages": asked}] * 3)
    with pytest.warns(NothingToScoreWarning, match=r"^3 conversation\(s\) hold no assistant turn .*first: line 3 of"):
        assert len(Chat(files=str(files), tokenizer=str(marked), length=200).encoded()) == 2
    other = CONVERSATIONS[2][:1] + [{"role": "assistant", "content": "Bye."}]
    pairs = [{"chosen": CONVERSATIONS[2], "rejected": other}] + [{"chosen": CONVERSATIONS[2], "rejected": CONVERSATIONS[2]}] * 2
    files = _write(tmp_path / "pairs.jsonl", pairs)
    with pytest.warns(NothingToScoreWarning, match=r"^2 preference pair\(s\) have no assistant text .*first: line 2 of"):
        assert len(ChatPreferences(files=str(files), tokenizer=str(marked), length=63).rows()["chosen"]) == 1


def test_empty_assistant_turns_leave_nothing_to_score(marked, tmp_path):
    """An assistant turn with empty or blank content was kept and trained on its end-of-turn token alone, in a conversation and as a prompt/completion record's messages completion; a text
    completion "" was already skipped. A tool call with no text is something to learn, and stays."""
    from dew.data.chat import Chat
    from dew.data.prompt_completion import NothingToScoreWarning, PromptCompletion

    user = {"role": "user", "content": "q"}
    silent = [[user, {"role": "assistant", "content": ""}], [user, {"role": "assistant", "content": "  "}]]
    files = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[2]}] + [{"messages": c} for c in silent])
    with pytest.warns(NothingToScoreWarning, match=r"^2 conversation\(s\) hold no assistant turn .*first: line 2 of"):
        assert [c.where for c in Chat(files=str(files), tokenizer=str(marked), length=200).encoded()] == \
            [f"line 1 of {str(files)!r}"]
    records = [{"prompt": [user], "completion": [{"role": "assistant", "content": "It is four."}]},
               {"prompt": [user], "completion": [{"role": "assistant", "content": ""}]}]
    files = _write(tmp_path / "pc.jsonl", records)
    with pytest.warns(NothingToScoreWarning, match=r"pc.jsonl:2 has an empty \(or blank\) completion"):
        assert len(PromptCompletion(files=str(files), tokenizer=str(marked), length=200).encoded()) == 1


def test_a_blank_text_completion_is_left_out_as_a_blank_assistant_turn_is(marked, tmp_path):
    """A completion of spaces written as text trained on its spaces without a word, where the same
    record written as an assistant turn was left out; a pair whose rejected side was blank likewise."""
    import warnings

    from dew.data.prompt_completion import NothingToScoreWarning, PromptCompletion

    user = {"role": "user", "content": "Hi"}
    for blank in ("   ", [{"role": "assistant", "content": "   "}]):
        prompt = "Hi" if isinstance(blank, str) else [user]
        files = _write(tmp_path / "pc.jsonl", [{"prompt": "P?", "completion": "C."},
                                              {"prompt": prompt, "completion": blank}])
        with pytest.warns(NothingToScoreWarning, match=r"pc.jsonl:2 has an empty \(or blank\) completion"):
            assert len(PromptCompletion(files=str(files), tokenizer=str(marked), length=64, pack=False).encoded()) == 1
    files = _write(tmp_path / "pairs.jsonl", [{"prompt": "P?", "chosen": "C.", "rejected": "D."},
                                              {"prompt": "Hi", "chosen": "C.", "rejected": " \n "}])
    with pytest.warns(NothingToScoreWarning, match=r"^1 preference pair\(s\) give an empty \(or blank\) chosen"):
        rows = PromptCompletion(files=str(files), tokenizer=str(marked), length=64, completion_key="chosen",
                                rejected_key="rejected").rows()
    assert len(rows["chosen"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a completion of one space between words is text: kept, unwarned
        files = _write(tmp_path / "pc.jsonl", [{"prompt": "P?", "completion": " a b"}])
        assert len(PromptCompletion(files=str(files), tokenizer=str(marked), length=64).encoded()) == 1


def _merging_tokenizer(folder, template=UNMARKED):
    """Bytes plus the one merge of two line breaks, split as Qwen 2.5's tokenizer splits text (a run
    of line breaks is one piece), with a ChatML template: the prompt's last line break and a
    completion's first become one token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {character: number for number, character in enumerate(alphabet)}
    vocab["ĊĊ"] = len(vocab)
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    pieces = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    inner.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pieces), behavior="isolated"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=template)
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_prompt_and_its_completion_are_tokenized_whole_as_transformers_renders_them(tmp_path):
    """The rendered prompt and the completion were tokenized apart, so a completion opening with a
    line break after the generation prompt's own gave two tokens where transformers' tokenizer (and
    TRL's SFT) gives one merged token: other ids than the model sees at inference. The merged token
    holds the completion's first character, so it is scored."""
    from dew.data.prompt_completion import PromptCompletion

    tokenizer = _merging_tokenizer(tmp_path / "tok")
    merged = tokenizer.convert_tokens_to_ids("\u010a\u010a")
    record = {"prompt": "List two.", "completion": "\n1. a\n\n2. b"}
    files = _write(tmp_path / "pc.jsonl", [record])
    got = PromptCompletion(files=str(files), tokenizer=str(tmp_path / "tok"), length=200).encoded()[0]
    conversation = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    whole = list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    prompt = list(tokenizer.apply_chat_template(conversation[:1], tokenize=True, add_generation_prompt=True,
                                                return_dict=True)["input_ids"])
    assert got.ids.tolist() == whole and merged in whole
    first = whole.index(merged)
    assert first == len(prompt) - 1 and prompt[first] != merged  # the boundary's two line breaks, merged
    assert got.mask.tolist() == [0] * first + [1] * (len(whole) - first)
    # Text records likewise (a tokenizer without a template): the prompt and completion as one text,
    # then the end of the document.
    _merging_tokenizer(tmp_path / "plain", template=None)
    texts = _write(tmp_path / "text.jsonl", [{"prompt": "List two.\n", "completion": "\n1. a"}])
    got = PromptCompletion(files=str(texts), tokenizer=str(tmp_path / "plain"), length=200).encoded()[0]
    assert got.ids.tolist() == tokenizer("List two.\n\n1. a")["input_ids"] + [tokenizer.eos_token_id]


def test_a_tokenizer_json_given_reads_its_folders_end_of_turn_as_the_template_does(tmp_path):
    """The template comes from the folder beside a tokenizer.json given; its tokenizer was read
    alone, ending documents at <|endoftext|>, so the run trained to end turns with <|im_end|> never
    stopped there when it generated."""
    from dew.data import Chat
    from dew.data.hf_tokenizer import HFTokenizer

    folder = build_tokenizer(tmp_path / "tok")
    data = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[2]}])
    alone = HFTokenizer.from_file(folder / "tokenizer.json")
    beside = HFTokenizer.from_directory(folder)
    assert alone.eos_id != beside.eos_id  # what the test tells apart
    tokenizer = Chat(files=str(data), tokenizer=str(folder / "tokenizer.json"), length=32).text_tokenizer()
    assert tokenizer.eos_id == beside.eos_id == beside.tokenizer.token_to_id("<|im_end|>")


def test_a_template_refusing_a_record_names_the_record(tmp_path):
    from dew.data import Chat, ChatPreferences
    from dew.data.chat_template import ChatTemplateError

    folder = build_tokenizer(tmp_path / "tok", template=(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"))
    system = [{"role": "system", "content": "x"}, *CONVERSATIONS[2]]
    data = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[2]}, {"messages": system}])
    with pytest.raises(ChatTemplateError, match=r"System role not supported \(the conversation in line 2 of "
                                                r"'.*chat\.jsonl'\)"):
        Chat(files=str(data), tokenizer=str(folder), length=64).rows()
    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": system[:2], "chosen": [system[2]], "rejected": [system[2]]}])
    with pytest.raises(ChatTemplateError, match=r"\(the conversation in line 1 of '.*pairs\.jsonl'\)"):
        ChatPreferences(files=str(pairs), tokenizer=str(folder), length=64).rows()


def test_a_template_rewriting_earlier_turns_is_named_as_the_cause_with_the_ways_on(tmp_path):
    """Qwen 3's template drops the reasoning of all but the last assistant turn, so a multi-turn
    conversation cannot be split into turns without markers: the refusal said the data's message
    'changes what came before it'."""
    from dew.data import Chat
    from dew.data.chat_template import ChatTemplateError

    rewrites = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
                "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}>"
                "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think></think>{% endif %}{{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    folder = build_tokenizer(tmp_path / "tok", template=rewrites)
    data = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ChatTemplateError) as refused:
        Chat(files=str(data), tokenizer=str(folder), length=64).rows()
    said = str(refused.value)
    assert "renders the earlier turns of a conversation otherwise once assistant message" in said
    assert "chat_template=" in said and "{% generation %}" in said and "line 1 of" in said


def test_any_reader_given_a_tokenizer_json_stops_where_its_folder_says_keeping_its_own_document_end(tmp_path):
    """An addition (GRPO) or token-windows reader given a folder's tokenizer.json stopped its
    continuations at <|endoftext|> alone where the folder given stops at <|im_end|>: a policy's text
    ran on past its end of turn. Its document end is its own, so windows cut as before."""
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.data.token_windows import resolve_tokenizer

    folder = build_tokenizer(tmp_path / "tok")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    alone = HFTokenizer.from_file(folder / "tokenizer.json")
    given = resolve_tokenizer(str(folder / "tokenizer.json"))
    end_of_turn = alone.tokenizer.token_to_id("<|im_end|>")
    assert end_of_turn not in alone.stop_ids and end_of_turn != alone.eos_id  # what the test tells apart
    assert given.eos_id == alone.eos_id and given.fingerprint == alone.fingerprint
    whole = resolve_tokenizer(str(folder))  # the folder itself ends documents at its end of turn
    assert set(given.stop_ids) == {end_of_turn, 7} == {whole.eos_id, *whole.stop_ids}


def test_text_preference_records_are_sent_to_the_reader_of_text_pairs(tmp_path):
    from dew.data import ChatPreferences
    from dew.data.chat import ChatRecordError

    folder = build_tokenizer(tmp_path / "tok")
    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}])
    with pytest.raises(ChatRecordError, match=r"holds text under 'chosen', where chat_preferences reads a "
                                              r"conversation; for text pairs use prompt_completion with "
                                              r"completion_key: chosen and rejected_key: rejected"):
        ChatPreferences(files=str(pairs), tokenizer=str(folder), length=64).rows()


def test_a_chat_template_path_that_names_no_file_is_refused(marked, tmp_path, monkeypatch):
    """A .jinja path written relative to another folder than the run's was read as the template's
    own text: every record rendered as that path, the loss 0.0000, and nothing said."""
    from dew.data.chat import Chat
    from dew.data.errors import MissingFileError

    files = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "chat.jinja").write_text(MARKED)
    monkeypatch.chdir(tmp_path)
    for given in ("data/chat.jinja", "templates/plain.txt"):
        with pytest.raises(MissingFileError, match=rf"chat_template '{given}' names no file \(a relative path starts "
                                                   rf"at {tmp_path}\) and holds no Jinja"):
            Chat(files=str(files), tokenizer=str(marked), chat_template=given, length=256).encoded()
    found = Chat(files=str(files), tokenizer=str(marked), chat_template="here/chat.jinja", length=256).encoded()
    assert [c.ids.tolist() for c in found] == [c.ids.tolist() for c in
                                                Chat(files=str(files), tokenizer=str(marked), length=256).encoded()]


def test_a_text_prompt_beside_whole_conversations_adds_nothing_and_beside_answers_is_the_user_turn(marked, tmp_path):
    """UltraFeedback's layout (a text prompt that copies the user turn of whole chosen/rejected
    conversations) was refused as no conversation; it reads as the conversations alone, as TRL reads
    it, and a text prompt before assistant-only sides reads as the user's turn."""
    from dew.data.chat import ChatPreferences

    question = "What is two plus two?"
    user = [{"role": "user", "content": question}]
    chosen, rejected = [{"role": "assistant", "content": "It is four."}], [{"role": "assistant", "content": "Five."}]
    ultra = _write(tmp_path / "ultra.jsonl", [{"prompt": question, "chosen": user + chosen, "rejected": user + rejected}])
    plain = _write(tmp_path / "plain.jsonl", [{"chosen": user + chosen, "rejected": user + rejected}])
    text = _write(tmp_path / "text.jsonl", [{"prompt": question, "chosen": chosen, "rejected": rejected}])
    listed = _write(tmp_path / "listed.jsonl", [{"prompt": user, "chosen": chosen, "rejected": rejected}])
    rows = {name: ChatPreferences(files=str(path), tokenizer=str(marked), length=63).rows()
            for name, path in (("ultra", ultra), ("plain", plain), ("text", text), ("listed", listed))}
    for key in ("chosen", "rejected", "chosen_mask", "rejected_mask", "prompt_length"):
        assert np.array_equal(rows["ultra"][key], rows["plain"][key])
        assert np.array_equal(rows["text"][key], rows["listed"][key])
        assert np.array_equal(rows["ultra"][key], rows["listed"][key])  # the same pair, written three ways
    ids, _ = _reference(marked, user + chosen)
    assert rows["ultra"]["chosen"][0, :len(ids)].tolist() == ids  # the question once, not twice
    assert int(rows["ultra"]["prompt_length"][0]) == len(_asked(marked, user))
