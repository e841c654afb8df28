"""Generation that stops at the end-of-document id, and LMObjective.pipeline."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from dew.data import ByteTokenizer
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, TextGeneration, generate

MODEL = CausalTransformer(vocab_size=257, emb_features=32, num_layers=1, num_heads=4,
                          num_kv_heads=2, mlp_features=64, max_seq_len=48,
                          position_embedding="rotary", mlp_activation="swiglu")


def _variables(seed: int):
    return MODEL.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))


def test_a_row_stops_at_the_end_of_document_id():
    variables = _variables(0)
    prompts = [[100, 101, 119], [106, 97, 120, 32, 116]]
    greedy = Sampling(temperature=0.0)
    free = generate(MODEL, variables, prompts, 20, jax.random.key(0), greedy)
    assert free.stopped == (False, False)
    # The third token row 0 produces on its own becomes the end-of-document id.
    eos = free.new_tokens[0][2]
    stopped = generate(MODEL, variables, prompts, 20, jax.random.key(0), greedy, eos_id=eos)
    for row, unstopped in zip(stopped.new_tokens, free.new_tokens, strict=True):
        if eos in unstopped:
            cut = unstopped.index(eos) + 1
            assert row == unstopped[:cut]
        else:
            assert row == unstopped
    assert stopped.stopped[0] and stopped.new_tokens[0][-1] == eos


def test_pipeline_uses_the_ema_weights_and_matches_generate():
    tokenizer = ByteTokenizer()
    objective = LMObjective(MODEL, seq_len=16, tokenizer=tokenizer,
                            preview_sampling=Sampling(temperature=0.0))
    live, averaged = _variables(0), _variables(1)
    state = types.SimpleNamespace(params=live, averaged=averaged)
    pipeline = objective.pipeline(state)
    assert isinstance(pipeline, TextGeneration)
    for used, wanted in zip(jax.tree.leaves(pipeline.variables), jax.tree.leaves(averaged),
                            strict=True):
        assert used is wanted
    ids = tokenizer.encode("def f(")
    expected = generate(MODEL, averaged, [ids], 10, jax.random.key(0), Sampling(temperature=0.0),
                        eos_id=tokenizer.eos_id)
    assert pipeline("def f(", max_new_tokens=10) == tokenizer.decode(expected.new_tokens[0])
    # A stop string ends the text after its first occurrence: a printable byte it produced.
    new = expected.new_tokens[0]
    first = next(i for i, t in enumerate(new) if 32 <= t < 127)
    stop = chr(new[first])
    assert pipeline("def f(", max_new_tokens=10, stop=[stop]) == tokenizer.decode(new[: first + 1])
    without = objective.pipeline(types.SimpleNamespace(params=live, averaged=None))
    other = generate(MODEL, live, [ids], 10, jax.random.key(0), Sampling(temperature=0.0),
                     eos_id=tokenizer.eos_id)
    assert without(["def f("], max_new_tokens=10) == [tokenizer.decode(other.new_tokens[0])]


def test_pipeline_save_writes_a_pretrained_directory(tmp_path):
    objective = LMObjective(MODEL, seq_len=16, tokenizer=ByteTokenizer())
    variables = _variables(2)
    pipeline = objective.pipeline(variables, sampling={"temperature": 0.0})
    pipeline.save(tmp_path)
    again = TextGeneration.load(tmp_path)
    assert again.model == MODEL and again.tokenizer == ByteTokenizer()
    for a, b in zip(jax.tree.leaves(pipeline.variables), jax.tree.leaves(again.variables),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert again(["abc", "x"], max_new_tokens=6) == pipeline(["abc", "x"], max_new_tokens=6)


def _sentencepiece_like(folder) -> str:
    """A tokenizer.json as Llama 2's and Mistral's are: a '▁' before the text and for each space, and a
    decoder that strips one leading space. '▁x' is id 0, what a model of all-zero logits picks."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"▁x": 0, "▁": 1, "x": 2, "d": 3, "e": 4, "f": 5, "▁d": 6, "▁de": 7, "▁def": 8, "<unk>": 9, "</s>": 10}
    merges = [("▁", "x"), ("▁", "d"), ("▁d", "e"), ("▁de", "f")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "</s>"])
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def test_a_continuation_keeps_the_space_a_sentencepiece_decoder_strips_from_a_texts_start(tmp_path):
    """Decoded alone, '▁x ▁x' reads 'x x': the continuation of 'def' printed as 'defx x x', and a stop
    string ' x' matched only at the second word. It reads as transformers' pipeline reads it: the
    whole sequence's text past the prompt's."""
    from tokenizers import Tokenizer

    from dew.data.hf_tokenizer import HFTokenizer

    path = _sentencepiece_like(tmp_path)
    reference = Tokenizer.from_file(path)
    model = CausalTransformer(vocab_size=11, emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                              max_seq_len=32, position_embedding="rotary", mlp_activation="swiglu")
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    variables = jax.tree_util.tree_map_with_path(  # all-zero logits: greedy picks id 0, '▁x', each time
        lambda p, x: jnp.zeros_like(x) if "final_norm" in jax.tree_util.keystr(p) else x, variables)
    pipeline = TextGeneration(model, variables, HFTokenizer.from_file(path, eos_token="</s>"))
    prompt = reference.encode("def").ids
    new = [0, 0, 0]
    assert reference.decode(new) == "x x x"  # what decoding the continuation alone gives
    expected = reference.decode(prompt + new)[len(reference.decode(prompt)):]
    assert expected == " x x x"
    assert pipeline("def", max_new_tokens=3) == expected
    assert pipeline("def", max_new_tokens=6, stop=[" x"]) == " x"  # the first word completes the stop
    ids = pipeline.tokens(["def"], max_new_tokens=6, stop=[" x"]).new_tokens[0]
    assert ids == [0]  # the engine ended the row at the token that completed it
    objective = LMObjective(model, seq_len=8, tokenizer=pipeline.tokenizer, prompt="def", preview_tokens=3)
    assert objective.preview(variables, jax.random.key(0)).data == "def" + expected  # the run's own sample too
