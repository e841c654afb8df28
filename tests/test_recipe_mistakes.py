"""Recipes a person gets wrong, refused where they are written: by `dew train --check` when the recipe
alone says so, else in one line before the first step (never a traceback, never a run that trains
nothing or something else)."""

from __future__ import annotations

import json

import pytest

from dew.cli import main

CHECKED = [
    ("tiny-lm", ["model.num_heads=3"], "model: emb_features=128 is not divisible by num_heads=3"),
    ("tiny-lm", ["model.num_layers=0"], "model: CausalTransformer.num_layers must be at least 1, got 0"),
    # An integer compute dtype passed the check and failed in the first trace ("logistic does not accept int8").
    ("tiny-lm", ["model.dtype=int8"], "model: CausalTransformer.dtype='int8' is not a floating dtype"),
    ("digits-diffusion", ["model.patch_size=3"], "model.patch_size: image_size=8 is not divisible by patch_size=3"),
    # A published family's model was built, not checked: both passed --check and were refused at the start.
    ("qwen3-sft", ["model.preset=0.7b"], "model.preset: The qwen3 family has no preset '0.7b'; its presets are"),
    ("qwen3-sft", ["model.num_kv_heads=3"], "model: CausalTransformer.num_kv_heads=3 must divide num_heads=4"),
    ("tiny-lm", ["optimizer.eps=0"], "optimizer.eps: Input should be greater than 0"),
    # A division by zero's traceback (exit 1), a head width of 0 read as unset, NaN at every step.
    ("tiny-lm", ["model.query_pre_attn_scalar=0"], "model: CausalTransformer.query_pre_attn_scalar=0 must be above 0"),
    ("tiny-lm", ["model.head_features=0"], "model: CausalTransformer.head_features=0 must be above 0"),
    ("tiny-lm", ["model.rope_base=-1"], "model: CausalTransformer.rope_base=-1 must be above 0."),
    ("tiny-lm", ["model.logit_softcap=0"], "model: CausalTransformer.logit_softcap=0 must be above 0"),
    ("tiny-lm", ["model.norm_epsilon=-1"], "model: CausalTransformer.norm_epsilon=-1 must be 0 or above"),
    # A completion as long as the model's window: the first rollout refused every prompt (PromptTooLongError).
    ("addition-grpo", ["objective.max_new_tokens=1000"],
     "GRPOObjective.max_new_tokens=1000 leaves no position for a prompt in the model's max_seq_len=32"),
    # Refused at the first preview, naming no field.
    ("tiny-lm", ["objective.prompt="], "LMObjective.prompt='' gives the preview no token to start from"),
    # XLA read the word as a file of flags and aborted the run (exit 1), naming no field.
    ("tiny-lm", ["trainer.xla_flags=[notaflag]"], "trainer.xla_flags: 'notaflag' is not one XLA flag"),
    ("tiny-jepa", ["objective.predictor_features=0"], "refused the recipe's objective values: JepaObjective's predictor needs predictor_features"),
    ("tiny-jepa", ["objective.momentum=[1.5, 1.0]"], "objective values: JepaObjective.momentum=[1.5, 1.0] is the target"),
    # An objective's own values passed --check, and were refused as the run built the objective.
    ("block-diffusion", ["objective.block_size=5"],
     "objective: BlockDiffusionObjective.seq_len=64 must be a positive multiple of block_size=5"),
    ("masked-diffusion", ["objective.preview_steps=0"],
     "objective: MaskedDiffusionObjective.preview_steps must be at least 1, got 0"),
    ("masked-diffusion", ["objective.t_min=0"], "objective: t_min must lie in (0, 1), got 0"),
    ("masked-diffusion", ["objective.temperature=-1"], "objective: MaskedDiffusionObjective.temperature must be 0 "
                                                       "(greedy) or at least 1.18e-38, got -1"),
    ("tiny-lm", ["optimizer.b1=1.5"], "optimizer.b1: Input should be less than 1"),
    # A literal folder named "$HOME" was made in the working directory, and the run trained there.
    ("tiny-lm", ["trainer.checkpoint_dir=$HOME/runs/x"],
     "trainer.checkpoint_dir: $HOME is an environment variable, which dew does not expand"),
    ("tiny-lm", ["data.files=$DATA/*.py"], "data.files: $DATA is an environment variable"),
    # A decay to twice its peak trained without a word.
    ("tiny-lm", ["optimizer.schedule=cosine", "optimizer.end_factor=2"],
     "optimizer.end_factor: Input should be less than or equal to 1"),
    # Fields the solver or schedule does not read: accepted, they changed nothing (bitwise).
    ("tiny-lm", ["optimizer.solver=sgd", "optimizer.b2=0.5"], "b2 applies to adamw and lion, not sgd"),
    ("tiny-lm", ["optimizer.solver=lion", "optimizer.eps=0.5"], "eps applies to adamw and adafactor, not lion"),
    ("tiny-lm", ["optimizer.nesterov=true"], "nesterov applies to sgd, not adamw"),
    ("tiny-lm", ["optimizer.schedule=constant", "optimizer.end_factor=0.5"],
     "decay_steps and end_factor shape a decay, and schedule='constant' has none"),
    ("tiny-lm", ["trainer.steps=2", "trainer.accumulation=3"],
     "trainer.accumulation: 3 microbatches make one optimizer update, but trainer.steps=2 stops before the first"),
    ("tiny-lm-lora", ["quantization.dtype=int8"], "quantization: set beside lora, where it would be ignored"),
    ("tiny-lm-lora", ["lora.alpha=0"], "Lora.alpha must be above 0"),
    # A dropout no training step draws a key for (it stopped the first step with flax's traceback).
    ("tiny-lm-lora", ["lora.dropout=0.1"], "Lora.dropout=0.1 is not applied by dew"),
    # Ignored leaves start fresh, and lora freezes them: random for the whole run.
    ("tiny-lm-lora", ["init.pretrained=exported", "init.ignore=[params/head]"],
     "init.ignore: leaves those weights at a fresh initialization, and the lora section freezes"),
    ("addition-grpo", ["objective.reward.name=exact_mach"],
     "objective.reward.name: no reward named 'exact_mach'. Did you mean 'exact_match'?"),
    ("addition-grpo", ["objective.reward.ky=answer"], "objective.reward.ky: reward 'exact_match' has no field 'ky'"),
    # Passed the check, then a TypeError's traceback as the run started.
    ("addition-grpo", ["objective.reward=[exact_match, format]"],
     "objective.reward: names a registered reward: give its name, or a mapping of its name and fields"),
    ("addition-grpo", ["objective.reward={key: answer}"], "several rewards combine through the `weighted` reward"),
    # A braced word that is no placeholder named a folder after itself, beside the run's own.
    ("tiny-lm", ["trainer.checkpoint_dir=runs/{timestmap}"],
     "trainer.checkpoint_dir: {timestmap} is no placeholder: dew replaces {timestamp}, {stdlib} and {recipes}"),
    ("tiny-lm", ["trainer.profile={directory: 'runs/${timestamp}', steps: 2}"],
     "trainer.profile.directory: ${timestamp} is a shell's form"),
    # Passed the check, then an OverflowError's traceback drawing the run's key.
    ("tiny-lm", ["seed=9223372036854775808"], "seed: Input should be less than 9223372036854775808"),
    ("tiny-distill", ["objective.teacher.emb_feature=64"],
     "objective.teacher.emb_feature: model 'causal_transformer' has no field 'emb_feature'"),
    ("tiny-sft", ["trainer.evaluate.0.evrey=5"], "did you mean 'every'?"),
    # Names other trainers use were matched by spelling alone: save_every was told eval_every.
    ("tiny-lm", ["trainer.save_every=3"], "trainer.save_every: unknown field (given 3). Allowed here: steps,"),
    ("tiny-lm", ["trainer.save_every=3"], "did you mean 'checkpoint_every'?"),
    ("tiny-lm", ["trainer.max_steps=3"], "did you mean 'steps'?"),
    ("tiny-lm", ["optimizer.lr=0.1"], "did you mean 'learning_rate'?"),
    # data.batch sits beside the reader's fields: the list of allowed keys left it out.
    ("tiny-lm", ["data.batch_size=2"], "Allowed: batch, load, files, dataset,"),
    ("tiny-lm", ["data.batch_size=2"], "did you mean 'batch'?"),
    ("tiny-sft", ["trainer.evaluate=[{task: multiple_choice, file: a.jsonl}, {task: multiple_choice, file: b.jsonl}]"],
     "trainer.evaluate.1.label: trainer.evaluate entries 0 and 1 both log their scores as "
     "eval/multiple_choice/..., so one would overwrite the other: give each a label of its own"),
    # pydantic reads true as 1: each trained one step, one row, one layer, one fsdp device.
    ("tiny-lm", ["trainer.steps=true"], "trainer.steps: a number is wanted, not a flag (given True)"),
    ("tiny-lm", ["data.batch=true"], "data.batch: a number is wanted, not a flag (given True)"),
    ("tiny-lm", ["model.num_layers=true"], "model.num_layers: a number is wanted, not a flag (given True)"),
    ("tiny-lm", ["trainer.mesh.fsdp=true"], "trainer.mesh: fsdp: a number is wanted, not a flag"),
    ("tiny-lm", ["seed=false"], "seed: a number is wanted, not a flag (given False)"),
    ("tiny-lm", ["data.load.seed=true"], "data.load.seed: a number is wanted, not a flag (given True)"),
    # cuDNN's fused kernel computes in bfloat16 or float16: a float32 model failed at its first trace on a GPU.
    ("tiny-lm", ["model.attention=cudnn"], "model: CausalTransformer.attention='cudnn' runs cuDNN's fused kernel"),
    # A routing given as a mapping reached the model's check as one: an AttributeError's traceback.
    ("qwen3-sft", ["model.name=qwen3_moe", "model.routing={dropless: true}", "model.expert_capacity=2.0"],
     "model: CausalTransformer.expert_capacity=2.0 sizes capacity routing"),
    # Passed the check, then a ValueError's (or a reshape's) traceback as the model was first traced.
    ("digits-diffusion", ["model.num_heads=5"], "model.num_heads: emb_features=96 is not divisible by num_heads=5"),
    ("moving-digits", ["model.num_heads=5"], "model.num_heads: emb_features=96 is not divisible by num_heads=5"),
    ("moving-digits", ["model.patch_size=3"], "model.patch_size: image_size=16 is not divisible by patch_size=3"),
    ("block-diffusion", ["model.num_heads=5"], "model.num_heads: emb_features=128 is not divisible by num_heads=5"),
    ("tiny-jepa", ["model.num_heads=5"], "model.num_heads: emb_features=32 is not divisible by num_heads=5"),
    ("tiny-jepa", ["model.patch=3"], "model.patch: image_size=8 is not divisible by patch=3"),
    # An image of no pixels passed the check (0 tiles by any patch), then the first batch was refused.
    ("digits-diffusion", ["model.image_size=0"], "model.image_size: image_size=0 describes no image: it is at least 1."),
    ("digits-diffusion", ["model.channels=0"], "model.channels: channels=0 describes no image: it is at least 1."),
    ("moving-digits", ["model.frames=0"], "model.frames: frames=0 describes no image: it is at least 1."),
    # A KeyError's traceback at the first step (no submodule captured), a ZeroDivisionError's at the first KL
    # update, an adaptive coefficient of inf trained on, completions of no token refused by the engine's
    # buckets, and as many tokens as the window refused at the first rollout.
    ("addition-reward-model", ["objective.features_module=nope"],
     "RewardModelObjective.features_module='nope' names no submodule of the model, so no head can read its "
     "hidden states; its top-level submodules are embed, final_norm, layers_0, layers_1"),
    ("addition-ppo", ["objective.features_module=nope"], "PPOObjective.features_module='nope' names no submodule"),
    ("addition-ppo", ["objective.kl_target=0"], "PPOObjective.kl_target and kl_horizon must be above 0"),
    ("addition-ppo", ["objective.kl_horizon=0"], "PPOObjective.kl_target and kl_horizon must be above 0"),
    ("addition-ppo", ["objective.lam=2"], "PPOObjective.gamma and lam must lie in [0, 1]"),
    ("addition-ppo", ["objective.gamma=-1"], "PPOObjective.gamma and lam must lie in [0, 1]"),
    ("addition-ppo", ["objective.max_new_tokens=0"], "PPOObjective.max_new_tokens must be at least 1"),
    ("addition-ppo", ["objective.max_new_tokens=100"],
     "PPOObjective.max_new_tokens=100 leaves no position for a prompt in the model's max_seq_len=32"),
    # Rows of no token, and a reward model's rows longer than its model reads, trained without a word.
    ("addition-dpo", ["objective.seq_len=0"], "DPOObjective.seq_len must be at least 1"),
    ("addition-reward-model", ["objective.seq_len=100"],
     "RewardModelObjective.seq_len=100 exceeds the model's max_seq_len=32"),
    # A teacher with no weights to read: the student was distilled from a randomly drawn one.
    ("tiny-distill", ["objective.teacher_checkpoint=null"],
     "objective.teacher_checkpoint: the teacher's weights come from nowhere"),
    # A teacher declared in the recipe and a teacher_pretrained that is not there: --check passed, the run
    # refused it as its initializer read the weights.
    ("tiny-distill", ["objective.teacher_checkpoint=null", "objective.teacher_pretrained=checkpoints/no-teacher"],
     "holds no config.json (the directory does not exist), so there is no model to load"),
    # A diffusion time above 1 trained; a preview prompt of part of a block lost its last bytes unsaid.
    ("block-diffusion", ["objective.t_min=1.5"], "BlockDiffusionObjective.t_min must lie in (0, 1), got 1.5"),
    ("block-diffusion", ["objective.prompt=abc"],
     "The prompt 'abc' is 3 tokens; block diffusion writes whole blocks of 8"),
    # No validation problem: "max() arg is an empty sequence" at the start, blamed on data.load; windows of
    # one id refused at the first step.
    ("addition-reward-model", ["data.val_problems=0"],
     "Addition needs problems, val_problems and max_operand of at least 1, got 2048, 0 and 9"),
    ("addition-lm", ["data.length=0"], "Addition.length is the ids of each 'text' window"),
    # LoRA's fit to the model was checked by its init only: the run refused these at its start.
    ("tiny-lm-lora", ["lora.targets=[nothing]"], "LoraError: Lora target 'nothing' (nothing) matches no module"),
    ("tiny-lm-lora", ["lora.rank=1000"], "LoraError: Lora rank 1000 is larger than layer"),
    # A batch the objective cannot split or pair: refused at the first rollout or step.
    ("addition-ppo", ["objective.minibatches=3"],
     "MinibatchSplitError: PPOObjective(minibatches=3) does not divide the rollout of 64 completions"),
    ("addition-kto", ["data.batch=1"], "LoneRowError: KTO estimates its KL term from each completion under another"),
]


@pytest.mark.parametrize("recipe, overrides, said", CHECKED, ids=[" ".join(c[1]) for c in CHECKED])
def test_a_mistake_the_recipe_shows_is_refused_by_check(recipe, overrides, said, capsys):
    assert main(["train", recipe, *overrides, "--check"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


STARTING = [
    # Refused as the recipe is read now (its --check case above), before the run builds anything.
    ("masked-diffusion", ["objective.preview_steps=0"],
     "The recipe {recipe} has 1 problem(s):\n  objective: MaskedDiffusionObjective.preview_steps must be at least 1, "
     "got 0."),
    ("tiny-lm", ["objective.seq_len=256"],
     "objective 'lm' refused the recipe's objective values: LMObjective.seq_len=256 exceeds the model's "
     "max_seq_len=128"),
    ("tiny-lm", ["data.load.val_fraction=1.5"],
     "dataset 'token_windows' refused the recipe's data.load (and data.batch) values: val_fraction must lie in"),
    # Read as no workers, without a word.
    ("tiny-lm", ["data.load.workers=-1", "data.load.val_fraction=0", "trainer.eval_every=null"],
     "dataset 'token_windows' refused the recipe's data.load (and data.batch) values: workers and prefetch count "
     "processes and batches: each must be at least 0, got workers=-1 and prefetch=4."),
    ("tiny-lm", ["data.tokenizer=5"],
     "dataset 'token_windows' refused the recipe's data.tokenizer values: A tokenizer must have encode(text) "
     "and eos_id; int 5 lacks encode."),
    ("tiny-lm", ["data.tokenizer=bytes"], "MissingFileError: The tokenizer 'bytes' does not exist. Pass 'byte' (dew's byte-level"),
    # A ramp starting above the batch: the reader's words named no field of the recipe.
    ("tiny-lm", ["trainer.batch_ramp={start: 64, steps: 2}", "data.load.val_fraction=0", "trainer.eval_every=null"],
     "RampError: trainer.batch_ramp (start=64, steps=2, data.batch=32): A ramp must start at 1 to 32 rows (the "
     "full batch); got start=64. Give trainer.batch_ramp.start at most data.batch."),
    # An objective's length other than the data's: the message named the objective's field alone.
    ("tiny-lm", ["objective.seq_len=32", "data.load.val_fraction=0", "trainer.eval_every=null"],
     "BatchKeyError: Batch key 'text' has shape (32, 65), but LMObjective(seq_len=32) expects ('batch', 33): "
     "seq_len + 1 ids per row (inputs are the first seq_len, targets the last seq_len). In a recipe, give the "
     "data reader's length (data.length) the value of objective.seq_len."),
    ("masked-diffusion", ["objective.seq_len=32", "data.load.val_fraction=0", "trainer.eval_every=null"],
     "BatchKeyError: Batch key 'text' has shape (32, 65); MaskedDiffusionObjective(seq_len=32) expects [batch, 32] "
     "(or token_windows' [batch, 33]). In a recipe, give the data reader's length (data.length) the value of "
     "objective.seq_len."),
    # cuDNN's kernel on a CPU: a 40-frame traceback ending "cuDNN is not detected".
    ("tiny-lm", ["model.attention=cudnn", "model.dtype=bfloat16", "data.load.val_fraction=0", "trainer.eval_every=null"],
     "FusedAttentionError: attention='cudnn' runs cuDNN's fused kernel, on an NVIDIA GPU only"),
]


@pytest.mark.parametrize("recipe, overrides, said", STARTING, ids=[" ".join(c[1]) for c in STARTING])
def test_a_value_only_its_component_refuses_is_one_line_before_the_first_step(recipe, overrides, said, tmp_path,
                                                                               monkeypatch, capsys):
    """A plain ValueError of the component's own checks printed a traceback as if dew had a bug; the
    masked-diffusion one trained until its first preview and failed there, keeping no step."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", recipe, *overrides, "trainer.steps=2", "data.files={stdlib}/abc.py",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    from dew.recipes.config import recipe_path

    said = said.format(recipe=recipe_path(recipe))
    assert err.startswith(f"dew train: {said}") and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was kept: no folder left


OBJECTIVE_VALUES = [
    # A ValueError's traceback as the objective's init traced a longer sequence than the model reads.
    ("addition-dpo", ["objective.seq_len=64"], "dpo", "DPOObjective.seq_len=64 exceeds the model's max_seq_len=32"),
    ("addition-kto", ["objective.seq_len=64"], "kto", "KTOObjective.seq_len=64 exceeds the model's max_seq_len=32"),
    ("addition-orpo", ["objective.seq_len=64"], "orpo", "ORPOObjective.seq_len=64 exceeds the model's max_seq_len=32"),
    # Trained, as GRPO's objectives refused them: a negative clip range, a stop token no completion holds.
    ("addition-ppo", ["objective.clip=-0.2"], "ppo", "PPOObjective.clip and value_clip must be at least 0"),
    ("addition-ppo", ["objective.value_clip=-1"], "ppo", "PPOObjective.clip and value_clip must be at least 0"),
    ("addition-ppo", ["objective.stop_token=999"], "ppo", "PPOObjective.stop_token=999 is outside the model's vocabulary"),
    ("addition-dpo", ["objective.stop_token=999"], "dpo", "DPOObjective.stop_token=999 is outside the model's vocabulary"),
    # DiT's ValueError traceback from the first trace ("DiT takes images [batch, 8, 8, 1], got shape (1, 10, 10, 1)").
    ("flow-grpo-digits", ["objective.image_shape=[10,10,1]"], "flow_grpo",
     "image_shape=[10, 10, 1] is not the shape the model draws: DiT with image_size=8 and channels=1 draws [8, 8, 1]"),
]


@pytest.mark.parametrize("recipe, overrides, objective, said", OBJECTIVE_VALUES,
                         ids=[f"{c[0]} {' '.join(c[1])}" for c in OBJECTIVE_VALUES])
def test_an_objective_value_its_model_cannot_serve_is_one_line_before_anything_is_kept(
        recipe, overrides, objective, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", recipe, *overrides, "init=null", "trainer.steps=2", f"trainer.checkpoint_dir={tmp_path}/run",
                 f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dew train: objective {objective!r} refused the recipe's objective values: {said}"), err
    assert not (tmp_path / "run").exists()


_TOKENS = "{vocab_size: 257, emb_features: 32, num_layers: 1, num_heads: 2, mlp_features: 64, max_seq_len: 128}"
_PIXELS = "{image_size: 8, channels: 1, emb_features: 32, num_layers: 1, num_heads: 2, mlp_features: 64}"
# Each a traceback from inside the model at the first trace: "DiT.__call__() missing 1 required positional
# argument: 'level'", "'CausalTransformer' object has no attribute 'grid'", "TokenDenoiser.__call__() got an
# unexpected keyword argument 'decode'", "not enough values to unpack (expected 5, got 2)".
OTHER_KIND = [
    ("tiny-lm", "{name: dit, patch_size: 2, num_classes: 10, " + _PIXELS[1:], "lm", "a causal decoder", "DiT"),
    ("tiny-lm", "{name: token_denoiser, " + _TOKENS[1:], "lm", "a causal decoder", "TokenDenoiser"),
    ("addition-grpo", "{name: vit_encoder, patch: 2, " + _PIXELS[1:], "grpo", "a causal decoder", "ViTEncoder"),
    ("masked-diffusion", "{name: unet, image_size: 8, channels: 1, emb_features: 32}", "masked_diffusion", "a token model", "UNet"),
    ("digits-diffusion", "{name: vit_encoder, patch: 2, " + _PIXELS[1:], "diffusion", "a pixel denoiser",
     "ViTEncoder"),
    ("tiny-jepa", "{name: qwen3, num_layers: 1}", "jepa", "a patch encoder", "CausalTransformer"),
    ("tiny-jepa", "{name: dit, patch_size: 2, " + _PIXELS[1:], "jepa", "a patch encoder", "DiT"),
]


@pytest.mark.parametrize("recipe, model, objective, kind, built", OTHER_KIND, ids=[f"{c[0]} {c[4]}" for c in OTHER_KIND])
def test_a_model_of_another_kind_than_the_objective_trains_is_refused_by_check_and_at_the_start(
        recipe, model, objective, kind, built, tmp_path, monkeypatch, capsys):
    name = model.split(",")[0].removeprefix("{name: ")
    said = (f"dew train: objective {objective!r} trains {kind} (")
    assert main(["train", recipe, f"model={model}", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and f"model.name={name!r} builds a {built}, which is not one" in err, err
    monkeypatch.chdir(tmp_path)
    assert main(["train", recipe, f"model={model}", "init=null", "trainer.steps=2",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe, model", [("masked-diffusion", "{name: causal_transformer, " + _TOKENS[1:]),
                                           ("block-diffusion", "{name: qwen3, num_layers: 1, vocab_size: 257}")])
def test_a_token_diffusion_objective_takes_a_causal_decoder_too(recipe, model, capsys):
    assert main(["train", recipe, f"model={model}", "--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("schedule, said", [
    ("foo", "objective 'diffusion' refused the recipe's objective values: Unknown noise schedule 'foo'; use one of"),
    ("{name: edm, sigmax: 20}", "The edm schedule has no setting 'sigmax'; its settings are sigma_min, sigma_max"),
])
def test_a_diffusion_schedule_nothing_defines_is_one_line_before_the_first_step(schedule, said, capsys, tmp_path,
                                                                                 monkeypatch):
    """An unknown schedule stopped the run inside its first compiled step with a traceback; a name
    with settings ({name: edm, sigma_max: 20}) could not be given at all."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "digits-diffusion", f"objective.schedule={schedule}", "trainer.steps=1",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and err.count("\n") <= 3, err
    assert not (tmp_path / "run").exists()


def test_a_schedule_with_its_settings_builds_that_schedule():
    from dew import registry
    from dew.diffusion import EDM

    model = registry.models.build("dit", image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1,
                                  num_heads=2, mlp_features=32)
    objective = registry.objectives.build("diffusion", model=model, schedule={"name": "edm", "sigma_max": 20.0})
    assert objective.process.schedule == EDM(sigma_max=20.0)
    assert hash(objective)  # held as the Schedule, so the objective still hashes


class _NotAnObjective:
    """A plugin's class with no init or loss: the run would call what Objective declares on it."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale


class _NotAModel:
    def __init__(self, features: int = 4):
        self.features = features


def _declares_a_model_it_does_not_take():
    from dew.objectives.base import Objective

    class NoModelParameter(Objective):
        run_inputs = frozenset({"model"})

        def __init__(self, scale: float = 2.0):
            self.scale = scale

    return NoModelParameter


@pytest.mark.parametrize("group, component, overrides, said", [
    ("objectives", _NotAnObjective, ["objective={name: planted}"],
     "objective.name: objective 'planted' from <test> (.*) is a _NotAnObjective, not a subclass of dew's Objective"),
    ("models", _NotAModel, ["model={name: planted}"],
     "model.name: model 'planted' from <test> (.*) is a _NotAModel, not a subclass of flax's Module"),
    ("objectives", _declares_a_model_it_does_not_take(), ["objective={name: planted}"],
     "objective.name: objective 'planted' from <test> declares run_inputs model .*, but its constructor takes "
     "no model parameter"),
])
def test_a_plugin_class_of_the_wrong_kind_is_refused_by_check(group, component, overrides, said, capsys):
    """A plugin's objective that is no Objective, a model that is no Flax module, or an objective whose
    constructor takes no run input it declares: --check passed them and the run stopped with an
    AttributeError (or a refusal of a field the recipe never wrote)."""
    import re

    from dew import registry

    with registry.registry(group).temporary("planted", component):
        assert main(["train", "tiny-lm", *overrides, "--check"]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err), err


def test_a_plugin_pipeline_that_returns_no_pipeline_ends_its_run_well_and_commands_refuse_it(tmp_path, monkeypatch,
                                                                                             capsys):
    """A plugin objective's pipeline() returned a dict: the finished run exited 1 on the console's last
    line (with a resume hint for a run with nothing left), and generate and export printed tracebacks."""
    from dew import registry
    from dew.objectives.lm import LMObjective

    class DictPipeline(LMObjective):
        def pipeline(self, state, **options):
            return {"not": "a pipeline"}

    monkeypatch.chdir(tmp_path)
    with registry.objectives.temporary("planted_lm", DictPipeline):
        assert main(["train", "tiny-lm", "objective.name=planted_lm", "trainer.steps=1", "data.batch=2",
                     f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out[-1].startswith(f"Use the run: dew eval {tmp_path}/run (DictPipeline.pipeline() returned a dict, "
                                  "not a dew.objectives.inference.Pipeline"), out[-1]
        for command in (["generate", f"{tmp_path}/run", "x"], ["export", f"{tmp_path}/run", f"{tmp_path}/out"]):
            assert main(command) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"dew {command[0]}: DictPipeline.pipeline() returned a dict") and "Traceback" not in err
    assert not (tmp_path / "out").exists()


class _FailingTracker:
    """A plugin's tracker with a bug that shows at step 4."""

    def __init__(self, at: int = 4):
        self.at = at

    def log(self, scalars, step):
        if step >= self.at:
            raise RuntimeError("plugin tracker failing on purpose")

    def artifact(self, value, step):
        pass

    def close(self):
        pass


def _refused_with_tracker(tracker: type, tmp_path, capsys, *, checkpoint_every: int) -> str:
    """stderr of a 6-step tiny-lm run into tmp_path/run whose only tracker is tracker, refused (status 2)."""
    from dew import registry

    run = ["train", "tiny-lm", "trainer.steps=6", "trainer.log_every=2", f"trainer.checkpoint_every={checkpoint_every}",
           "data.batch=2", f"trainer.checkpoint_dir={tmp_path}/run", "trackers=[{name: planted_tracker}]"]
    with registry.trackers.temporary("planted_tracker", tracker):
        assert main(run) == 2
    return capsys.readouterr().err


def test_a_plugin_trackers_own_error_stops_the_run_naming_it_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """A tracker that raised mid-run printed a traceback through dew's fan-out (exit 1: "a bug, please
    report it") without naming the tracker; the steps saved before it are kept."""
    monkeypatch.chdir(tmp_path)
    err = _refused_with_tracker(_FailingTracker, tmp_path, capsys, checkpoint_every=2)
    assert err.startswith(f"dew train: TrackerFailedError: The tracker {_FailingTracker.__module__}._FailingTracker failed in log at "
                          "step 4: RuntimeError: plugin tracker failing on purpose. Fix it"), err
    # Step 4's checkpoint waits for step 4's reports, which the tracker failed to take: what was saved
    # before it stays, and the resume trains step 4 again with the tracker fixed.
    assert "Traceback (" not in err and "(its newest checkpoint is step 2); once fixed, resume it with: dew train " \
           "--resume run" in err, err
    assert (tmp_path / "run" / "2" / "dew.json").is_file() and not (tmp_path / "run" / "4").exists()
    # started.json records who registered each installed component the recipe named (the test's tracker
    # is registered in code, by no distribution, so it is not among them)
    from importlib import metadata

    started = json.loads((tmp_path / "run" / "started.json").read_text())
    assert started["components"] == {"objectives/lm": f"dew-objectives {metadata.version('dew-objectives')}",
                                     "datasets/token_windows": f"dew-data {metadata.version('dew-data')}",
                                     "models/causal_transformer": f"dew-core {metadata.version('dew-core')}"}


class _FailingAtTheEnd(_FailingTracker):
    """A tracker whose disk fills once the last checkpoint is in: the run's goodput does not reach it."""

    def log(self, scalars, step):
        pass

    def artifact(self, value, step):
        if getattr(value, "type", None) == "goodput":
            raise RuntimeError("no space left for the closing records")


def test_a_run_failing_after_its_last_checkpoint_is_told_it_is_done_not_to_resume(tmp_path, monkeypatch, capsys):
    """The closing records failed after step 6 was committed, and the note said to resume: the resume
    found nothing to train and wrote nothing, so the advice recovered nothing."""
    monkeypatch.chdir(tmp_path)
    err = _refused_with_tracker(_FailingAtTheEnd, tmp_path, capsys, checkpoint_every=3)
    assert "no space left for the closing records" in err and "Traceback (" not in err, err
    assert ("The run is in run: its checkpoints reach step 6, the last of its 6, so its training is done" in err
            and "dew eval run scores it again; to train further, dew train --resume run trainer.steps=N." in err), err
    assert "once fixed, resume it with" not in err


def test_a_run_whose_plugin_is_gone_is_told_to_install_it_not_to_edit_its_recipe(tmp_path, capsys):
    """generate, eval and export read the recipe a run trained with; with its plugin uninstalled they
    said "Fix them in the file or with key=value overrides" (commands that take none)."""
    import json

    from dew.recipes.config import RunConfig

    RunConfig.load("tiny-lm").save(tmp_path / "run")
    recipe = json.loads((tmp_path / "run" / "run.json").read_text())
    recipe["objective"]["name"] = "uninstalled_objective"
    (tmp_path / "run" / "run.json").write_text(json.dumps(recipe))
    (tmp_path / "run" / "started.json").write_text(json.dumps({  # as the run wrote it when it started
        "timestamp": "2026-12-05_10:00:00", "cwd": str(tmp_path),
        "components": {"objectives/uninstalled_objective": "dew-gone-plugin 1.2.3"}}))
    for command in (["generate", str(tmp_path / "run"), "x"], ["eval", str(tmp_path / "run")],
                    ["export", str(tmp_path / "run"), str(tmp_path / "out")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "objective.name: no objective named 'uninstalled_objective'" in err, err
        assert "This is the recipe the run trained with: install the distributions that register the names " \
               "above" in err and "Fix them in the file" not in err, err
        assert "The run trained with objective 'uninstalled_objective' from dew-gone-plugin 1.2.3: pip install " \
               "'dew-gone-plugin==1.2.3' to read it again." in err, err
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert "pip install 'dew-gone-plugin==1.2.3'" in capsys.readouterr().err


def test_a_component_of_another_version_than_the_run_trained_with_is_named_with_both(tmp_path, capsys):
    """A plugin upgraded between a run and its resume: the resume said nothing and started.json kept
    the first version, so a later reader was told to install the wrong one; a recipe the new version
    refuses was not told which version the run trained with."""
    import json
    from importlib import metadata

    from dew.recipes.config import RunConfig
    from dew.recipes.folder import RunFolder

    installed = f"dew-objectives {metadata.version('dew-objectives')}"
    config = RunConfig.load("tiny-lm")
    config.save(tmp_path / "run")
    started = tmp_path / "run" / "started.json"
    started.write_text(json.dumps({"timestamp": "2026-12-05_10:00:00", "cwd": str(tmp_path),
                                   "components": {"objectives/lm": "dew-objectives 0.0.1"}}))
    RunFolder(tmp_path / "run", "2026-12-05_11:00:00", tmp_path).record(config)
    assert capsys.readouterr().out == (f"The run trained with objective 'lm' from dew-objectives 0.0.1; it goes on "
                                       f"with {installed}.\n")
    recorded = json.loads(started.read_text())
    assert recorded["components"]["objectives/lm"] == installed and recorded["timestamp"] == "2026-12-05_10:00:00"
    RunFolder(tmp_path / "run", "2026-12-05_12:00:00", tmp_path).record(config)
    assert capsys.readouterr().out == ""  # said once, when it changed

    started.write_text(json.dumps({"timestamp": "2026-12-05_10:00:00", "cwd": str(tmp_path),
                                   "components": {"objectives/lm": "dew-objectives 0.0.1"}}))
    recipe = json.loads((tmp_path / "run" / "run.json").read_text())
    recipe["objective"]["seq_length"] = 64  # a field the old version took, say
    (tmp_path / "run" / "run.json").write_text(json.dumps(recipe))
    assert main(["eval", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "objective 'lm' has no field 'seq_length'" in err, err
    assert (f"The run trained with objective 'lm' from dew-objectives 0.0.1; installed is {installed}: pip install "
            "'dew-objectives==0.0.1' to read it as it trained") in err, err


def test_the_routing_a_refusal_advises_starts_the_run(tmp_path, monkeypatch):
    """A Qwen3-MoE checkpoint normalizing its top-k gates (the tiny preset does not) is refused with the
    routing to set; setting it, as every mapping-valued model field, crashed in the recipe's check."""
    import re

    from dew.families.examples import write_checkpoint
    from dew.pretrained import ConfigurationMismatchError
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts, initial_variables

    monkeypatch.chdir(tmp_path)
    write_checkpoint("qwen3_moe", tmp_path / "moe", redrawn=True, overrides={"norm_topk_prob": True})
    start = ["model.name=qwen3_moe", "init.pretrained=moe", "data.tokenizer=moe", "objective.prompt=null"]

    def started(overrides: list[str]) -> object:  # what a run reads first: the recipe, then its start
        config = RunConfig.load("qwen3-sft", overrides)
        return initial_variables(config, build_parts(config, with_data=False).objective)

    with pytest.raises(ConfigurationMismatchError) as refused:
        started(start)
    advice = re.search(r"Set '(model\.routing=[^']+)'", str(refused.value))
    assert advice is not None and "hidden_features: 32" in advice[1]
    assert started([*start, advice[1]]) is not None


def test_ppo_minibatches_that_do_not_split_the_rollout_are_named_in_one_line(tmp_path, monkeypatch, capsys):
    """Found in the rollout, as a plain ValueError: a traceback, as if dew had a bug."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "addition-ppo", "init=null", "objective.minibatches=3", "trainer.steps=2",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dew train: MinibatchSplitError: PPOObjective(minibatches=3) does not divide the "
                          "rollout of 64 completions") and "Traceback" not in err, err


def test_lora_over_a_base_no_init_section_gives_is_noted_once(tmp_path, monkeypatch, capsys):
    """A fresh DiT's blocks start gated shut and lora freezes their modulation: its adapters got no
    gradient in any step, and the run ended well, saying nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "digits-diffusion", r"lora={rank: 2, alpha: 4.0, targets: [blocks_\d+/attention]}",
                 "trainer.steps=1", "trainer.eval_every=null", "data.load.val_fraction=0",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: lora freezes every weight but the adapters, and no init section gives them") == 1, out


class _ReaderOfAPath:
    """A plugin's dataset reader that opens its recipe's path as it loads, as a third party's might."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0):
        with open(self.path) as handle:  # the builtin's own FileNotFoundError, nothing of dew's
            handle.read()


def test_a_plugin_readers_missing_file_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A third party's reader opening a path that is not there printed Python's 39-line traceback with
    exit 1, the status of a bug, though dew's own note already named the recipe field that gave the path."""
    from dew import registry

    monkeypatch.chdir(tmp_path)
    with registry.datasets.temporary("planted_reader", _ReaderOfAPath):
        assert main(["train", "tiny-lm", "trainer.steps=2", "trainer.checkpoint_dir=run", "trackers=[]",
                     "data={name: planted_reader, path: nope.jsonl, batch: 2}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dew train: FileNotFoundError: [Errno 2] No such file or directory: 'nope.jsonl'"), err
    assert "Traceback (" not in err and err.count("\n") == 3, err


def test_the_last_line_offers_dew_export_only_for_a_pipeline_that_exports(monkeypatch):
    """A plugin's pipeline without pretrained() (the plugins docs' example) was sent to dew export by
    the run's last line, which export then refused."""
    from dew.objectives import inference
    from dew.recipes.run import usage

    class Answers(inference.Pipeline):  # generate alone
        pass

    class Weights(inference.Pipeline):
        def pretrained(self):
            raise AssertionError("the last line reads no weights")

    for pipeline, said in ((Answers(), "dew eval reads it too."), (Weights(), "dew eval and dew export read it too.")):
        monkeypatch.setattr(inference, "pipeline_of", lambda objective, state, made=pipeline: made)
        assert usage(None, None, "RUN") == f"Use the run: dew generate RUN INPUT...; {said}"


@pytest.mark.parametrize(("overrides", "said", "field"), [
    (["init={pretrained: runs/missing-export}"], "holds no config.json (the directory does not exist)", "init.pretrained"),
    (["trainer.evaluate=[{task: perplexity, every: 5, file: data/missing.jsonl}]"], "does not exist", "trainer.evaluate.0.file"),
])
def test_check_refuses_a_start_or_task_file_that_is_not_there_naming_its_field(overrides, said, field, tmp_path,
                                                                                 monkeypatch, capsys):
    """--check built the model and objective only: a missing published checkpoint or task file passed
    it, and the run then failed on it before its first step. Another run (init.run) is still not read:
    a recipe is checked on a machine where that run is not (docs/cli.md)."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", *overrides, "--check"]) == 2
    err = capsys.readouterr().err
    assert said in err and f"The recipe's {field} names it" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []  # nothing written
    assert main(["train", "tiny-lm", "init={run: runs/missing-run}", "--check"]) == 0


def test_check_refuses_a_pretrained_start_of_another_size_without_reading_its_weights(tmp_path, monkeypatch, capsys):
    """init.pretrained's description (config.json, tensor headers) is checked against the recipe's model;
    its weights are not read (Pretrained.describe), so a checkpoint of gigabytes is checked in a moment."""
    import dew.pretrained.model as reading
    from dew.families.examples import main as write_example
    from dew.pretrained import Pretrained

    assert write_example(["qwen3", str(tmp_path / "qwen3-tiny")]) == 0
    base = ["model={name: qwen3, preset: tiny, max_seq_len: 32}", "objective.seq_len=32",
            f"init={{pretrained: {tmp_path / 'qwen3-tiny'}}}", f"data.tokenizer={tmp_path / 'qwen3-tiny'}"]
    described = Pretrained.describe(tmp_path / "qwen3-tiny", max_seq_len=32)
    loaded = Pretrained.load(tmp_path / "qwen3-tiny", max_seq_len=32)
    assert described.model == loaded.model and described.variables == {} and loaded.variables["params"]

    def unread(*args, **kwargs):
        raise AssertionError("--check read the weights")

    monkeypatch.setattr(reading, "_read_params", unread)
    assert main(["train", "tiny-lm", *base, "--check"]) == 0
    capsys.readouterr()
    assert main(["train", "tiny-lm", *base, "model.num_layers=3", "--check"]) == 2
    err = capsys.readouterr().err
    assert "ConfigurationMismatchError" in err and "Set model.num_layers=2 so" in err and "Traceback" not in err
    # Another size of the family: named as its preset, where the advice was one field a run (vocab_size, then
    # emb_features, ...); the tokenizer field naming the same folder is not blamed for the model's size.
    assert main(["train", "tiny-lm", *base, "model.preset=0.6b", "--check"]) == 2
    err = capsys.readouterr().err
    assert "Set model.preset=tiny, the qwen3 size the checkpoint is, so the weights mean what they meant" in err
    assert "The recipe's init.pretrained names it." in err and "data.tokenizer names it" not in err


def test_a_batch_without_a_key_the_objective_reads_says_which_side_of_the_recipe_to_change(tmp_path, monkeypatch,
                                                                                            capsys):
    """A precomputed DPO reference over pairs that carry none named the missing keys and nothing to do."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "addition-dpo", "objective.reference=precomputed", "init=null", "trainer.steps=2",
                 f"trainer.checkpoint_dir={tmp_path}/run", f"trackers.0.directory={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert "has no key 'chosen_reference_logp', 'rejected_reference_logp', which the objective reads" in err
    assert "the data reader writes the batch's keys and the objective's settings choose those it reads" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_run_whose_tokenizer_moved_says_where_its_recipe_names_it(tmp_path, monkeypatch, capsys):
    """dew generate and export rebuild a run from its run.json: a tokenizer folder moved since was named
    with advice to pass another, which neither command takes. The note names the run.json field, and
    setting it there to the new place exports the run."""
    from dew.families.examples import main as write_example

    monkeypatch.chdir(tmp_path)
    assert write_example(["qwen3", "ck/qwen3"]) == 0
    assert main(["train", "tiny-lm", "model={name: qwen3, preset: tiny, max_seq_len: 32}", "objective.seq_len=16",
                 "data.length=16", "data.batch=4", "data.files={stdlib}/abc.py", "data.load.val_fraction=0",
                 "trainer.eval_every=null", "trainer.steps=1", "init={pretrained: ck/qwen3}", "data.tokenizer=ck/qwen3",
                 "trainer.checkpoint_dir=runs/q", "trackers=[]"]) == 0
    (tmp_path / "ck/qwen3").rename(tmp_path / "ck/moved")
    capsys.readouterr()
    for command in (["export", "runs/q", "exported"], ["generate", "runs/q", "def"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert (f"  The run's recipe ({tmp_path / 'runs/q/run.json'}) names it at data.tokenizer: put it back where "
                "it was, or set data.tokenizer in that file to where it is now.") in err
        assert "init.pretrained" not in err and "Traceback" not in err
    recipe = json.loads((tmp_path / "runs/q/run.json").read_text())
    recipe["data"]["tokenizer"] = "ck/moved"
    (tmp_path / "runs/q/run.json").write_text(json.dumps(recipe))
    assert main(["export", "runs/q", "exported"]) == 0 and (tmp_path / "exported/config.json").is_file()


def test_check_traces_on_the_cpu_and_gives_the_platforms_back(monkeypatch, capsys):
    """--check traces the objective's init (and a features module's check) abstractly: on the CPU, so that
    checking a recipe on a machine whose accelerator another job holds neither opens it nor takes its memory."""
    import jax

    import dew.recipes.run as run

    seen = []
    build = run.build_parts

    def recording(*args, **kwargs):
        seen.append(jax.config.values["jax_platforms"])
        return build(*args, **kwargs)

    before = jax.config.values["jax_platforms"]
    monkeypatch.setattr(run, "build_parts", recording)
    assert main(["train", "tiny-lm-lora", "--check"]) == 0
    assert seen == ["cpu"] and jax.config.values["jax_platforms"] == before
