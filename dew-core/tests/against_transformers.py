"""What the family tests share: transformers' model of a saved directory, its logits, and
the check that dew's export loads back in transformers and returns to dew bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dew.families import family

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = np.random.default_rng(0).integers(0, 300, (3, 19))


def hf_model(directory: Path) -> object:
    """transformers' own causal LM read from directory, in float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(model, ids=PROMPTS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def flat(variables) -> dict[str, np.ndarray]:
    """Every leaf of a variables tree by its key path, as numpy."""
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]}


def check_exports_back(loaded, theirs: np.ndarray, name: str, out: Path) -> None:
    """dew's export of loaded is read by transformers as family name with logits theirs
    (within 1e-4), and transformers' own save of it comes back to dew bitwise."""
    from dew.pretrained import Pretrained

    loaded.save(out / "dew")
    config = json.loads((out / "dew" / "config.json").read_text())
    assert config["architectures"] == [family(name).architecture]
    hf = hf_model(out / "dew")
    assert type(hf).__name__ == family(name).architecture
    assert np.abs(hf_logits(hf) - theirs).max() <= 1e-4
    # `dew export --verify`'s own check certifies the export too (issue 26: every family verifies).
    from dew.pretrained.verify import VERIFICATION_FILE, verify

    record = verify(out / "dew", loaded.model, loaded.variables, tokenizer=loaded.tokenizer)
    assert record.passed and record.architecture == family(name).architecture
    assert record.max_abs_difference <= 1e-4 and (out / "dew" / VERIFICATION_FILE).is_file()
    hf.save_pretrained(out / "hf")  # transformers' own writer, from dew's export
    back = Pretrained.load(out / "hf")
    assert back.model == loaded.model
    original, again = flat(loaded.variables), flat(back.variables)
    assert original.keys() == again.keys()
    for key, value in original.items():
        assert again[key].dtype == value.dtype and np.array_equal(again[key], value), key


TEXTS = ["the plus is 12 plus 30", "héllo wörld 日本語 🙂", "  two  spaces\nand a newline",
         "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>model\nok<end_of_turn>"]
CHAT = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]


def check_tokenizer_reads(directory: Path):
    """dew's tokenizer of directory encodes TEXTS as AutoTokenizer does and keeps its end token and
    chat template; returns what dew loaded and transformers' tokenizer."""
    from dew.pretrained import Pretrained

    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    loaded = Pretrained.load(directory)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert loaded.tokenizer.eos_id == theirs.eos_token_id
    assert loaded.chat_template == theirs.chat_template and "messages" in loaded.chat_template
    return loaded, theirs


def check_tokenizer_written(saved: Path, theirs) -> None:
    """The tokenizer dew saved in saved reads in transformers as theirs: the same ids with the
    specials it adds itself, the same chat template, the same special tokens."""
    again = transformers.AutoTokenizer.from_pretrained(saved)
    for text in TEXTS:
        assert again.encode(text) == theirs.encode(text), text
    assert again.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(CHAT, tokenize=False)
    assert (again.bos_token, again.eos_token, again.pad_token) == (theirs.bos_token, theirs.eos_token,
                                                                    theirs.pad_token)
