"""Every objective's pipeline: what it holds, what generate and embed take and refuse, each checked
against the computation written out (generate called by hand, the Euler ODE by hand, the reward
computed on the texts generate makes)."""

from __future__ import annotations

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.models import build
from dew.objectives.base import Objective, Step
from dew.objectives.inference import GenerateRequest, NoPipelineError, UnsupportedRequestError
from dew.sampling import Sampling, TextGeneration, generate

TOKENIZER = ByteTokenizer()
LM = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
           mlp_features=32, max_seq_len=24, position_embedding="rotary", mlp_activation="swiglu")
GREEDY = Sampling(temperature=0.0)


def _step():
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(7), training=False)


def test_an_objective_without_a_pipeline_says_so_in_one_line():
    class Bare(Objective):
        pass

    from dew.objectives.base import PIPELINE_GUIDE
    from dew.objectives.inference import Pipeline

    with pytest.raises(NoPipelineError, match=r"^Bare declares no pipeline") as refused:
        Bare().pipeline({})
    # one line naming the capability the commands need and the doc that shows how to add it
    assert "\n" not in str(refused.value)
    assert "Objective.pipeline(state)" in str(refused.value) and PIPELINE_GUIDE in str(refused.value)

    class Answers(Pipeline):  # a plugin's pipeline that generates, but declares no pretrained()
        accepts = "numbers"

    with pytest.raises(UnsupportedRequestError, match=r"^Answers holds no weights to export") as refused:
        Answers().save("never")
    assert "\n" not in str(refused.value)
    assert "Pipeline.pretrained()" in str(refused.value) and PIPELINE_GUIDE in str(refused.value)


def test_a_pipeline_refuses_an_option_it_does_not_read_saying_what_it_takes():
    pipeline = TextGeneration(LM, LM.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), TOKENIZER)
    with pytest.raises(UnsupportedRequestError,
                       match=r"^--steps, --guidance do not apply here: TextGeneration takes one or "
                             r"more text prompts to continue \(options: --count, --max-new-tokens"):
        pipeline.generate(GenerateRequest(("x",), steps=3, guidance=2.0))
    with pytest.raises(UnsupportedRequestError, match="No prompt was given"):
        pipeline.generate(GenerateRequest())


def test_every_policy_pipeline_holds_the_policy_alone_and_stops_at_the_stop_token():
    from dew.objectives.dpo import DPOObjective
    from dew.objectives.grpo import GRPOObjective
    from dew.objectives.ppo import PPOObjective

    params = LM.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    prompt = TOKENIZER.encode("dew ")
    free = generate(LM, params, [prompt], 8, jax.random.key(0), GREEDY).new_tokens[0]
    stop = free[2]  # the third token greedy writes: every pipeline must end before it
    for make in (lambda: DPOObjective(LM, 8, tokenizer=TOKENIZER, stop_token=stop),
                 lambda: GRPOObjective(LM, tokenizer=TOKENIZER, stop_token=stop),
                 lambda: PPOObjective(LM, tokenizer=TOKENIZER, stop_token=stop)):
        objective = make()
        variables = objective.init(jax.random.key(1), params)  # the policy, a reference, a value head
        assert "reference" in variables
        pipeline = objective.pipeline(variables)
        assert set(pipeline.variables) == {"params"}
        assert set(pipeline.variables["params"]) == set(params["params"]), type(objective).__name__
        jax.tree.map(np.testing.assert_array_equal, pipeline.variables["params"], params["params"])
        assert pipeline("dew ", max_new_tokens=8) == TOKENIZER.decode(free[:free.index(stop)])


def test_an_exported_policy_stops_where_its_run_does_in_dew_and_in_transformers(tmp_path):
    """The export dropped the recipe's stop_token: dew generate on it and transformers' generate ran on
    past the newline an addition policy answers with."""
    import json

    import torch
    import transformers

    from dew.objectives.grpo import GRPOObjective
    from dew.pretrained import Pretrained

    params = LM.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    prompt = TOKENIZER.encode("dew ")
    free = generate(LM, params, [prompt], 8, jax.random.key(0), GREEDY).new_tokens[0]
    stop = free[2]
    pipeline = GRPOObjective(LM, tokenizer=TOKENIZER, stop_token=stop).pipeline(params)
    answer = pipeline("dew ", max_new_tokens=8)
    for layout in ("hf", "dew"):
        pipeline.pretrained().save(tmp_path / layout, format=layout)
        loaded = TextGeneration.load(tmp_path / layout)
        assert set(loaded.stops) == {TOKENIZER.eos_id, stop} and loaded("dew ", max_new_tokens=8) == answer
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == [TOKENIZER.eos_id, stop]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert out == free[:free.index(stop) + 1], (out, free)  # transformers keeps the stop token it ended on
    assert Pretrained.load(tmp_path / "dew").tokenizer.stop_ids == (stop,)
    # A text pipeline's weights record no task; pipeline() continues text as the lm objective's does
    # (it refused, advising the objective.pipeline(state).save that wrote them).
    rebuilt = Pretrained.load(tmp_path / "dew").pipeline()
    assert isinstance(rebuilt, TextGeneration) and rebuilt("dew ", max_new_tokens=8) == answer


def test_grpo_and_ppo_validation_score_greedy_answers_with_the_reward():
    from dew.data.addition import Addition
    from dew.objectives.grpo import GRPOObjective
    from dew.objectives.ppo import PPOObjective

    seen: list[list[str]] = []

    def reward(completions, context):  # records what it scores: the texts must be generate's
        seen.append(list(completions))
        return [float(len(c)) + float(np.sum(np.asarray(a) >= 0)) for c, a in
                zip(completions, context["answer"], strict=True)]

    records = Addition(form="prompts", problems=4, max_operand=9).records()
    batch = {k: np.stack([records[i][k] for i in range(4)]) for k in ("prompt", "prompt_length", "answer")}
    params = LM.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))
    newline = 10
    by_hand = []
    for prompt, length in zip(batch["prompt"], batch["prompt_length"], strict=True):
        new = generate(LM, params, [prompt[:length].tolist()], 4, jax.random.key(0), GREEDY).new_tokens[0]
        by_hand.append(TOKENIZER.decode(new[:new.index(newline)] if newline in new else new))
    expected = np.mean([len(t) + int(np.sum(a >= 0)) for t, a in zip(by_hand, batch["answer"], strict=True)])
    for objective in (GRPOObjective(LM, reward, tokenizer=TOKENIZER, stop_token=newline, max_new_tokens=4),
                      PPOObjective(LM, reward, tokenizer=TOKENIZER, stop_token=newline, max_new_tokens=4)):
        variables = objective.init(jax.random.key(1), params)
        outputs = jax.device_get(jax.jit(objective.evaluate)(variables, batch, _step()))
        (metric,) = objective.metrics()
        value = metric.result(metric.update(metric.empty(), outputs))
        assert seen[-1] == by_hand
        assert value == pytest.approx(expected)


def _dit(classes: int = 3):
    return build("dit", image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1,
                 num_heads=2, mlp_features=32, num_classes=classes)


def test_a_flow_grpo_pipeline_draws_by_the_euler_ode_with_guidance():
    from dew.diffusion import Diffusion, RectifiedFlow
    from dew.objectives.diffusion import to_pixels
    from dew.objectives.flow_grpo import FlowGRPOObjective, FlowPipeline

    model = _dit()
    objective = FlowGRPOObjective(model, image_shape=(8, 8, 1), condition_key="label", steps=3,
                                  data_std=0.5, beta=0.01)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    pipeline = objective.pipeline(variables)
    assert isinstance(pipeline, FlowPipeline) and set(pipeline.variables) == {"params"}
    images = pipeline([1, 2], key=jax.random.key(5), guidance=2.0)

    scaled = Diffusion(RectifiedFlow(), target="velocity", data_std=0.5).model_input
    labels, null = jnp.asarray([1, 2]), jnp.asarray([3, 3])  # label num_classes is the null one

    @jax.jit
    def euler(params, x):  # three steps from t = 1, the velocity guided away from the null label's
        for t in (1.0, 2 / 3, 1 / 3):
            inputs, level = scaled(x, jnp.full((2,), t))
            conditioned = model.apply({"params": params}, inputs, level, labels)
            unconditioned = model.apply({"params": params}, inputs, level, null)
            x = x - (unconditioned + 2.0 * (conditioned - unconditioned)) / 3
        return x

    x = euler(variables["params"], jax.random.normal(jax.random.key(5), (2, 8, 8, 1)))
    assert np.abs(images.astype(int) - to_pixels(x).astype(int)).max() <= 1
    # A scale that is no number drew blank images (a numpy cast warning, exit 0): refused, as the
    # diffusion pipelines refuse it.
    from dew.objectives.diffusion import GuidanceError

    for scale in (float("nan"), float("inf")):
        with pytest.raises(GuidanceError, match=rf"guidance={scale} is no scale: give a finite number"):
            pipeline([1], key=jax.random.key(5), guidance=scale)


def test_pixel_generate_writes_a_grid_and_refuses_what_the_model_cannot_take(tmp_path):
    from PIL import Image

    from dew.objectives.diffusion import DiffusionObjective

    objective = DiffusionObjective(_dit(), schedule="flow", sampler="euler", sample_steps=2)
    pipeline = objective.pipeline(nn.meta.unbox(objective.init(jax.random.key(0))))
    made = pipeline.generate(GenerateRequest(("0", "2"), count=2, out=tmp_path))
    assert [p.name for p in made.files] == ["samples.png", *(f"sample_{i:03d}.png" for i in range(4))]
    drawn = pipeline([0, 0, 2, 2], key=jax.random.key(0))
    for index, path in enumerate(made.files[1:]):
        with Image.open(io.BytesIO(path.read_bytes())) as image:
            np.testing.assert_array_equal(np.asarray(image)[..., None], drawn[index])
    with Image.open(made.files[0]) as grid:  # one row per label, count columns
        assert grid.size == (16, 16)
        np.testing.assert_array_equal(np.asarray(grid)[8:, :8, None], drawn[2])
    # one sample a label (the default count) is still a row per label: the labels shared a row of 8
    alone = pipeline.generate(GenerateRequest(("0", "2", "1"), count=1, out=tmp_path / "one"))
    with Image.open(alone.files[0]) as grid:
        assert grid.size == (8, 24)
    # --seed picks the draws: seed 3 is the key 3 sampler's images, and not seed 0's
    seeded = pipeline.generate(GenerateRequest(("0", "2"), count=2, seed=3, out=tmp_path / "seeded"))
    again = pipeline([0, 0, 2, 2], key=jax.random.key(3))
    for index, path in enumerate(seeded.files[1:]):
        with Image.open(path) as image:
            np.testing.assert_array_equal(np.asarray(image)[..., None], again[index])
    assert not np.array_equal(again, drawn)
    for asked, message in ((("a cat",), r"^'a cat' is not a class label: DiffusionPipeline takes "
                                        r"class labels 0 to 2"),
                           (("3",), r"^Label 3 is out of range"),
                           (("0",), r"^--max-new-tokens does not apply")):
        extra = {"max_new_tokens": 3} if "max" in message else {}
        with pytest.raises(UnsupportedRequestError, match=message):
            pipeline.generate(GenerateRequest(asked, out=tmp_path, **extra))
    # Unconditional samples of a conditional model have no condition for a guidance scale to weigh:
    # at 3 and at 1 they came out the same, pixel for pixel.
    with pytest.raises(UnsupportedRequestError, match="^--guidance weighs a condition against none"):
        pipeline.generate(GenerateRequest(guidance=3.0, out=tmp_path))
    free = DiffusionObjective(_dit(0), sample_steps=2)
    plain = free.pipeline(nn.meta.unbox(free.init(jax.random.key(0))))
    with pytest.raises(UnsupportedRequestError, match="cannot condition this model: .*unconditional"):
        plain.generate(GenerateRequest(("1",), out=tmp_path))
    with pytest.raises(UnsupportedRequestError, match="--guidance does not apply"):
        plain.generate(GenerateRequest(guidance=2.0, out=tmp_path))


def test_text_diffusion_keeps_the_prompt_and_block_diffusion_wants_whole_blocks():
    from dew.objectives.block_diffusion import BlockDiffusionObjective
    from dew.objectives.masked_diffusion import MaskedDiffusionObjective

    denoiser = build("token_denoiser", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                     mlp_features=32, max_seq_len=8)
    masked = MaskedDiffusionObjective(denoiser, 8, tokenizer=TOKENIZER)
    texts = masked.pipeline(masked.init(jax.random.key(0))).generate(GenerateRequest(("ab",), count=2, steps=2)).texts
    assert len(texts) == 2 and all(t.startswith("ab") for t in texts)
    block = BlockDiffusionObjective(denoiser, 8, block_size=4, tokenizer=TOKENIZER)
    writer = block.pipeline(block.init(jax.random.key(0)))
    with pytest.raises(UnsupportedRequestError, match="whole blocks of 4"):
        writer.generate(GenerateRequest(("abc",), steps=2))
    assert writer.generate(GenerateRequest(("abcd",), steps=2)).texts[0].startswith("abcd")


def test_feature_extraction_embeds_images_and_sends_generate_to_dew_embed():
    from dew.nn.vit import ViTEncoder
    from dew.objectives.jepa import JepaObjective

    encoder = ViTEncoder(image_size=8, patch=2, channels=1, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32)
    objective = JepaObjective(encoder, blocks=1, block=(2, 2), pixel_mean=0.3, pixel_std=0.4)
    variables = objective.init(jax.random.key(0))
    pipeline = objective.pipeline(variables)
    pixels = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 1)).astype(np.uint8)
    by_hand = jax.jit(lambda params, x: jnp.mean(encoder.apply({"params": params}, (x / 255.0 - 0.3) / 0.4),
                                                 axis=1))(variables["params"]["encoder"], pixels)
    np.testing.assert_allclose(pipeline.embed(pixels), by_hand, rtol=1e-5, atol=1e-6)
    with pytest.raises(UnsupportedRequestError, match=r"shape \(2, 5, 5\) cannot be embedded"):
        pipeline.embed(np.zeros((2, 5, 5)))
    with pytest.raises(UnsupportedRequestError,
                       match=r"makes no samples; it turns images into vectors: use `dew embed RUN"):
        pipeline.generate(GenerateRequest())


@pytest.mark.slow
def test_a_lora_policy_exports_merged_and_as_peft_adapters_that_compute_it(tmp_path):
    """`dew export`'s writer on a GRPO policy trained with LoRA: the merged Llama and the base with
    PEFT's adapters both compute, in transformers, what the adapted policy computes in dew."""
    import types

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from dew.adapters.lora import Lora, adapters_only, apply_lora, is_adapter, merge_lora
    from dew.cli.export import _write
    from dew.objectives.grpo import GRPOObjective
    from dew.pretrained import Pretrained

    lora = Lora(rank=2, alpha=4.0, targets=("attention", "mlp"))
    objective = adapters_only(GRPOObjective(apply_lora(LM, lora), tokenizer=TOKENIZER, stop_token=10))
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    assert "reference" not in variables  # with LoRA the reference is the base model itself
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    variables = jax.tree.unflatten(tree, [  # the adapters trained: B is no longer zero
        leaf + 0.05 * jax.random.normal(k, leaf.shape) if is_adapter(tuple(p.key for p in path), leaf)
        else leaf for (path, leaf), k in zip(leaves, keys, strict=True)])
    ids = np.random.default_rng(0).integers(0, 257, (2, 9))
    adapted = np.asarray(objective.model.apply(variables, jnp.asarray(ids, jnp.int32)))
    opened = types.SimpleNamespace(pipeline=lambda: objective.pipeline(variables),
                                   config=types.SimpleNamespace(init=None))

    def logits(model):
        with torch.no_grad():
            return model.eval()(torch.tensor(ids)).logits.numpy()

    written, what = _write(opened, lora, tmp_path / "merged", adapters=False, format=None)
    assert "adapters merged (Hugging Face's llama layout)" in what
    merged = transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32)
    np.testing.assert_allclose(logits(merged), adapted, atol=1e-4, rtol=0)
    _write(opened, lora, tmp_path / "adapters", adapters=True, format=None)
    # The base the adapters go onto: the weights with every adapter's B at zero, merged away.
    zero = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if str(p[-1].key).endswith("_lora_b") else x, variables)
    Pretrained(LM, merge_lora(zero, lora), TOKENIZER).save(tmp_path / "base")
    with_peft = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        tmp_path / "adapters")
    np.testing.assert_allclose(logits(with_peft), adapted, atol=1e-4, rtol=0)


def test_text_generation_refuses_what_it_would_ignore_and_starts_an_empty_prompt_after_a_document():
    """A filter or a count above 1 without a temperature, a prompt that fills the cache: refused,
    where they used to give greedy text (the same text count times) or the prompt back without a word. An empty prompt continues from the
    end-of-document id, as the evaluation tasks start one, and equals generating from that id."""
    from dew.sampling.errors import PromptTooLongError

    model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                  mlp_features=32, max_seq_len=16)
    pipeline = TextGeneration(model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), TOKENIZER)
    for name, value in (("top_k", 5), ("top_p", 0.5), ("min_p", 0.1)):
        with pytest.raises(UnsupportedRequestError, match=f"^{name} only narrows .* give a temperature"):
            pipeline.generate(GenerateRequest(("ab",), **{name: value}))
        with pytest.raises(UnsupportedRequestError, match=f"^{name} only narrows"):
            pipeline.generate(GenerateRequest(("ab",), temperature=0.0, **{name: value}))
        assert pipeline.generate(GenerateRequest(("ab",), temperature=1.0, **{name: value})).texts
    for greedy in ({}, {"temperature": 0.0}):  # n copies of the greedy text, where n samples were asked for
        with pytest.raises(UnsupportedRequestError, match="^count=3 without a temperature .* repeats one "
                                                          "continuation 3 times"):
            pipeline.generate(GenerateRequest(("ab", "c"), count=3, **greedy))
    drawn = pipeline.generate(GenerateRequest(("ab",), count=3, temperature=1.0, max_new_tokens=8)).texts
    assert len(drawn) == 3 and len(set(drawn)) > 1
    assert len(pipeline.generate(GenerateRequest(("ab", "c"), count=1)).texts) == 2
    with pytest.raises(PromptTooLongError, match="16 tokens leaves no room .* max_seq_len=16"):
        pipeline.generate(GenerateRequest(("x" * 16,)))
    assert len(pipeline.generate(GenerateRequest(("x" * 15,))).texts[0]) <= 16  # one token of room
    (empty,) = pipeline.generate(GenerateRequest(("",), max_new_tokens=6)).texts
    ids = generate(model, pipeline.variables, [[TOKENIZER.eos_id]], 6, jax.random.key(0),
                   Sampling(temperature=0.0), eos_id=TOKENIZER.eos_id).new_tokens[0]
    assert empty == TOKENIZER.decode([i for i in ids if i != TOKENIZER.eos_id])
