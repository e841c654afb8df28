"""A prompt reaches the model as transformers' tokenizer(prompt) puts it: Gemma's and Llama's
beginning-of-text id first, nothing before Qwen's. Without it a published Gemma continues text it
was never trained to start from, so dew generate disagreed with transformers on the same weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dew.data.base import prompt_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)

PROMPT = "the plus is 12 plus"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    return {name: write_checkpoint(name, root / name, seed=11, redrawn=True) for name in ("gemma2", "llama", "qwen3")}


@pytest.mark.parametrize("name", ["gemma2", "llama", "qwen3"])
def test_a_prompt_encodes_as_transformers_tokenizer_encodes_it(checkpoints, name):
    from dew.pretrained import Pretrained

    theirs = transformers.AutoTokenizer.from_pretrained(checkpoints[name])
    loaded = Pretrained.load(checkpoints[name])
    assert prompt_ids(loaded.tokenizer, PROMPT) == theirs(PROMPT)["input_ids"]
    has_bos = name != "qwen3"
    assert (loaded.tokenizer.prefix == (theirs.bos_token_id,)) if has_bos else loaded.tokenizer.prefix == ()
    assert loaded.tokenizer.encode(PROMPT) == theirs(PROMPT, add_special_tokens=False)["input_ids"]
    # A prompt spelt with its beginning-of-text token (a rollout's prompt as a reward model reads it
    # back) keeps its one: a reward model on Llama scored ids starting with two.
    spelt = theirs.decode(theirs(PROMPT)["input_ids"])
    assert prompt_ids(loaded.tokenizer, spelt) == theirs(PROMPT)["input_ids"], spelt


@pytest.mark.slow
def test_dew_generate_on_a_published_directory_continues_as_transformers_does(checkpoints):
    from dew.objectives.inference import GenerateRequest
    from dew.pretrained import Pretrained
    from dew.sampling import TextGeneration

    directory = checkpoints["gemma2"]
    loaded = Pretrained.load(directory)
    pipeline = TextGeneration(loaded.model, loaded.variables, loaded.tokenizer)
    ours = pipeline.tokens([PROMPT], max_new_tokens=8, key=jax.random.key(0)).new_tokens[0]
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = theirs_tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        made = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=theirs_tokenizer.eos_token_id)
    theirs = made[0, ids.shape[1]:].tolist()
    stop = loaded.tokenizer.eos_id  # both end a continuation at the end-of-document id
    assert ours == theirs[: theirs.index(stop) + 1] if stop in theirs else ours == theirs, (ours, theirs)
    shown = pipeline.generate(GenerateRequest((PROMPT,), max_new_tokens=8)).texts[0]
    assert shown == PROMPT + loaded.tokenizer.decode([i for i in ours if i != stop])
    assert np.asarray(ids)[0, 0] == theirs_tokenizer.bos_token_id  # the case this is about: a BOS first


@pytest.mark.slow
def test_a_continuation_ends_at_any_id_of_the_checkpoints_eos_list(checkpoints, tmp_path):
    """Llama 3 lists <|eot_id|> beside <|end_of_text|> in eos_token_id, and transformers' generate
    stops at either; dew stopped at the first alone and ran on past a chat turn's end."""
    import json
    import shutil

    from dew.data.hf_tokenizer import HFTokenizer
    from dew.sampling import TextGeneration

    directory = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], directory)
    free = TextGeneration.load(directory).tokens([PROMPT], max_new_tokens=12).new_tokens[0]
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    second = next(t for t in free[3:] if t != eos)  # an id the model emits, made a second end id
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        (directory / name).write_text(json.dumps({**config, "eos_token_id": [eos, second]}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        theirs = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    pipeline = TextGeneration.load(directory)
    ours = pipeline.tokens([PROMPT], max_new_tokens=12).new_tokens[0]
    assert ours == theirs == free[: free.index(second) + 1]
    assert pipeline([PROMPT], max_new_tokens=12)[0] == tokenizer.decode(theirs[:-1], skip_special_tokens=True)
    # A recipe's data.tokenizer naming the directory reads the same ends.
    assert HFTokenizer.from_directory(directory).stop_ids == (second,)


@pytest.mark.slow
def test_an_eos_id_config_json_alone_lists_does_not_stop_where_a_generation_config_lists_its_own(checkpoints,
                                                                                            tmp_path):
    """transformers' generate reads config.json's eos_token_id only to make a missing generation config:
    an id config.json alone listed stopped dew's continuation, and transformers' ran on past it."""
    import json
    import shutil

    from dew.data.hf_tokenizer import HFTokenizer
    from dew.sampling import TextGeneration

    directory = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], directory)
    free = TextGeneration.load(directory).tokens([PROMPT], max_new_tokens=12).new_tokens[0]
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    second = next(t for t in free[3:] if t != eos)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": [eos, second]}))
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] in (eos, [eos])  # what the test tells apart: second is config.json's alone
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        theirs = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    ours = TextGeneration.load(directory).tokens([PROMPT], max_new_tokens=12).new_tokens[0]
    assert ours == theirs == free and second in ours
    assert second not in HFTokenizer.from_directory(directory).stop_ids
    (directory / "generation_config.json").unlink()  # without one, config.json's list is what generate reads
    assert second in HFTokenizer.from_directory(directory).stop_ids
    assert TextGeneration.load(directory).tokens([PROMPT], max_new_tokens=12).new_tokens[0] == \
        free[: free.index(second) + 1]


def test_a_stop_naming_a_special_token_ends_the_continuation_at_its_id(checkpoints, tmp_path):
    """The decoded text leaves special tokens out, so --stop "<|im_start|>" never matched and the
    continuation ran on past the token."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from dew.sampling import TextGeneration

    directory = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], directory)
    free = TextGeneration.load(directory).tokens([PROMPT], max_new_tokens=8).new_tokens[0]
    weights = load_file(directory / "model.safetensors")  # tied: <|im_start|> made likelier than free[1]
    start = transformers.AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids("<|im_start|>")
    embedding = next(name for name in weights if "embed_tokens" in name)
    weights[embedding][start] = 3 * weights[embedding][free[1]]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    pipeline = TextGeneration.load(directory)
    running = pipeline.tokens([PROMPT], max_new_tokens=8).new_tokens[0]
    assert start in running and running.index(start) < 7, running  # not an end id: it runs on past it
    stopped = pipeline.tokens([PROMPT], max_new_tokens=8, stop=["<|im_start|>"]).new_tokens[0]
    assert stopped == running[: running.index(start) + 1], (stopped, running)
    # text stops still match the decoded text, beside it
    both = pipeline.tokens([PROMPT], max_new_tokens=8, stop=["<|im_start|>", "zzz"]).new_tokens[0]
    assert both == stopped

@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_chat_prompt_is_what_apply_chat_template_makes_and_the_reply_is_transformers(checkpoints, name):
    """dew generate --chat sends each prompt as a user turn in the checkpoint's own template with
    its generation prompt (Llama 3's starts with <|begin_of_text|> in the template itself, so
    nothing is added before it), and shows the reply alone; both ways of reading the folder (an
    exported directory, a recipe's data.tokenizer) carry the template."""
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.objectives.inference import GenerateRequest
    from dew.sampling import TextGeneration

    directory = checkpoints[name]
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    turn = [{"role": "user", "content": PROMPT}]
    wanted = theirs.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
    pipeline = TextGeneration.load(directory)
    made = pipeline.tokens([PROMPT], max_new_tokens=6, chat=True)
    assert made.tokens[0][: made.prompt_lengths[0]] == list(wanted)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(wanted)]), max_new_tokens=6, do_sample=False,
                             pad_token_id=theirs.eos_token_id)[0, len(wanted):].tolist()
    ends = [i for i, t in enumerate(out) if t in pipeline.stops]
    assert made.new_tokens[0] == (out[: ends[0] + 1] if ends else out)
    reply = pipeline.generate(GenerateRequest((PROMPT,), max_new_tokens=6, chat=True)).texts[0]
    assert reply == theirs.decode(out[: ends[0]] if ends else out, skip_special_tokens=True)
    assert HFTokenizer.from_directory(directory).chat_template.source == pipeline.tokenizer.chat_template.source


def test_chat_without_a_template_is_refused_in_one_line_saying_what_carries_one():
    import jax.numpy as jnp

    from dew.data import ByteTokenizer
    from dew.models import build
    from dew.objectives.inference import GenerateRequest, UnsupportedRequestError
    from dew.sampling import TextGeneration

    model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                  mlp_features=32, max_seq_len=24)
    pipeline = TextGeneration(model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), ByteTokenizer())
    with pytest.raises(UnsupportedRequestError, match=r"^--chat renders each prompt .* ByteTokenizer carries none\. "
                                                      r"Give the tokenizer as the folder") as refused:
        pipeline.generate(GenerateRequest(("hi",), chat=True))
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_longrope_row_generates_as_it_would_alone_whatever_the_batch(tmp_path):
    """LongRoPE picked its long list by the largest position of the whole call: a 5-token prompt batched
    with a 22-token one (past the original context of 16) was rotated with the long list, and its greedy
    tokens parted from its own from the second new token. Each row now picks by its own positions."""
    from dew.sampling import Sampling
    from dew.sampling.generate import generate

    directory = write_checkpoint("phi3", tmp_path / "phi3", seed=1, redrawn=True, overrides={
        "max_position_embeddings": 128, "original_max_position_embeddings": 16, "sliding_window": 4,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 1.5, 2, 3], "long_factor": [2, 4, 8, 16]}})
    from dew.pretrained import Pretrained

    loaded = Pretrained.load(directory)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(300, 500, n)] for n in (5, 22)]
    both = generate(loaded.model, loaded.variables, prompts, 12, jax.random.key(0), Sampling(temperature=0.0))
    for row, prompt in enumerate(prompts):
        alone = generate(loaded.model, loaded.variables, [prompt], 12, jax.random.key(0), Sampling(temperature=0.0))
        assert list(both.tokens[row]) == list(alone.tokens[0])
        np.testing.assert_allclose(both.logprobs[row], alone.logprobs[0], atol=1e-5)
