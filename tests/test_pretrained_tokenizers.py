"""A Pretrained directory with the data distribution's tokenizers: a tokenizer larger than the model is refused, and the tokenizer travels with the weights."""

from __future__ import annotations

import pytest

from dew.pretrained import (
    Pretrained,
    VocabularyMismatchError,
)
from perturbed import perturbed_init  # every test folder is on sys.path (conftest.py)
from test_pretrained import _llama, transformers


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from dew.data import ByteTokenizer
    from dew.objectives.lm import LMObjective

    model = _llama(vocab_size=200)
    with pytest.raises(VocabularyMismatchError, match="257 ids but the model's vocab_size is 200"):
        LMObjective(model, seq_len=16, tokenizer=ByteTokenizer())
    with pytest.raises(VocabularyMismatchError):
        Pretrained(model, perturbed_init(model), ByteTokenizer()).save(tmp_path)


def test_the_tokenizer_travels_with_the_weights(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dew.data import ByteTokenizer, HFTokenizer

    model = _llama(vocab_size=257)
    variables = perturbed_init(model)
    Pretrained(model, variables, ByteTokenizer()).save(tmp_path / "byte")
    assert Pretrained.load(tmp_path / "byte").tokenizer == ByteTokenizer()
    # transformers reads the byte-level tokenizer.json with dew's ids, byte for byte.
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "byte")
    # (a text holding the end-of-text token's spelling is its bytes to dew: transformers matched it
    # as the special token, one id for 13)
    for text in ["def f(x):\n\treturn x", "héllo wörld", "日本語 🙂", " two  spaces", "x = '<|endoftext|>'\n"]:
        ids = ByteTokenizer().encode(text)
        assert theirs.encode(text) == ids
        assert theirs.decode(ids + [256], skip_special_tokens=True) == text
    assert theirs.eos_token_id == 256

    vocab = {f"t{i}": i for i in range(59)} | {"[UNK]": 59, "</s>": 60}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(tmp_path / "source.json"))
    tokenizer = HFTokenizer.from_file(tmp_path / "source.json")
    small = _llama()
    Pretrained(small, perturbed_init(small), tokenizer).save(tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    loaded = Pretrained.load(tmp_path / "hf").tokenizer
    assert loaded.eos_id == 60 and loaded.encode("t3 t7") == [3, 7]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.encode("t3 t7") == [3, 7] and theirs.eos_token_id == 60
