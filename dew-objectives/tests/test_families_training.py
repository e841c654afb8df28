"""Objectives take a published family unchanged: SFT and GRPO start from checkpoints transformers
wrote (Qwen 3 and Gemma 2, through the shipped recipes qwen3-sft and gemma-grpo).

Each checkpoint is what ``python -m dew.families.examples`` writes: transformers' own model class
with its own random initialization, saved with save_pretrained beside the family's tokenizer.
"""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from dew.plugins import hookimpl, registered
from dew.recipes.config import RunConfig
from dew.recipes.run import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


class _Metrics:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    @hookimpl
    def dew_step_end(self, step, metrics):
        self.rows.append({k.removeprefix("train/"): float(v) for k, v in metrics.items()})


def _run(recipe: str, overrides: list[str]) -> tuple[list[dict[str, float]], object]:
    seen = _Metrics()
    config = RunConfig.load(recipe, ["trainer.log_every=1", *overrides])
    with registered(seen), contextlib.redirect_stdout(io.StringIO()):
        state = train(config)
    return seen.rows, state


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from dew.families.examples import main

    directory = tmp_path_factory.mktemp("families")
    for name in ("qwen3", "gemma2"):  # the recipes' first step, as a user runs it
        assert main([name, str(directory / "checkpoints" / f"{name}-tiny"), "--seed", "1"]) == 0
    return directory


def _family(name: str, run: str) -> list[str]:
    return [f"model.name={name}", f"init.pretrained=checkpoints/{name}-tiny",
            f"data.tokenizer=checkpoints/{name}-tiny",
            f"trainer.checkpoint_dir=runs/{run}", f"trackers.0.directory=runs/{run}"]


def _transformers_loss(directory, batch) -> float:
    """transformers' cross-entropy of a packed batch, completion tokens only, record by record."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    text, mask, segments = (np.asarray(batch[k]) for k in ("text", "loss_mask", "segment_ids"))
    total, count = 0.0, 0
    for row in range(text.shape[0]):
        for number in set(segments[row].tolist()) - {0}:
            where = np.nonzero(segments[row] == number)[0]
            ids = text[row, where]
            with torch.no_grad():
                logits = hf(torch.tensor(ids[None, :-1], dtype=torch.long)).logits[0]
            scored = mask[row, where][1:] == 1
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], dtype=torch.long),
                                                   reduction="none")
            total += float(ce.numpy()[scored].sum())
            count += int(scored.sum())
    return total / count


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_sft_starts_at_the_checkpoints_own_loss_learns_and_exports_verified(workdir, monkeypatch, capsys, name):
    from dew.cli import main
    from dew.data.base import DataPartition
    from dew.objectives.inference import GenerateRequest
    from dew.recipes.run import build_parts

    monkeypatch.chdir(workdir)
    overrides = ["trainer.steps=6", "optimizer.warmup_steps=0", "objective.prompt=null",
                 "objective.seq_len=48", "data.length=48", "data.batch=4", *_family(name, f"sft-{name}")]
    rows, _ = _run("qwen3-sft", overrides)
    losses = [row["loss"] for row in rows]
    assert len(losses) == 6 and np.all(np.isfinite(losses))
    # Step 1 is scored by the checkpoint as transformers computes it, over the completions only.
    batch = next(build_parts(RunConfig.load("qwen3-sft", overrides)).dataset.train(DataPartition()))
    assert losses[0] == pytest.approx(_transformers_loss(workdir / f"checkpoints/{name}-tiny", batch),
                                      abs=2e-4)
    assert np.mean(losses[-2:]) < np.mean(losses[:2])
    # Each record is its two turns as transformers' chat template renders them; what the
    # assistant's turn adds after the generation prompt (its end of turn included) is scored.
    reader = RunConfig.load("qwen3-sft", overrides).data.build("datasets")
    _, *texts, _ = next(reader.pairs())  # (where, prompt, completion, label)
    record = dict(zip(("prompt", "completion"), texts, strict=True))
    hf = transformers.AutoTokenizer.from_pretrained(workdir / f"checkpoints/{name}-tiny")
    user = [{"role": "user", "content": record["prompt"]}]
    head = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = hf.apply_chat_template([*user, {"role": "assistant", "content": record["completion"]}], tokenize=False)
    prompt, completion = (hf(text, add_special_tokens=False)["input_ids"] for text in (head, whole[len(head):]))
    first = reader.encoded()[0]
    assert first.ids.tolist() == prompt + completion
    assert first.mask.tolist() == [0] * len(prompt) + [1] * len(completion)
    if name != "qwen3":  # one certified export is enough to show the trained run exports
        return
    # `dew generate --chat` on the run sends a question as the user turn the run was tuned on
    # (the template of its data.tokenizer folder), and prints the reply alone.
    from dew.recipes.opening import open_run

    pipeline = open_run(f"runs/sft-{name}").pipeline()
    question = record["prompt"]
    made = pipeline.tokens([question], max_new_tokens=4, chat=True)
    assert made.tokens[0][: made.prompt_lengths[0]] == prompt
    reply = pipeline([question], max_new_tokens=4, chat=True)[0]
    assert pipeline.generate(GenerateRequest((question,), max_new_tokens=4, chat=True)).texts == (reply,)
    capsys.readouterr()
    assert main(["generate", f"runs/sft-{name}", "--chat", "--max-new-tokens", "4", question]) == 0
    assert capsys.readouterr().out == reply + "\n"
    assert main(["export", f"runs/sft-{name}", "exported", "--verify"]) == 0
    assert json.loads((workdir / "exported" / "verification.json").read_text())["passed"]
    template = (workdir / f"checkpoints/{name}-tiny/chat_template.jinja").read_text()
    assert (workdir / "exported" / "chat_template.jinja").read_text() == template


@pytest.mark.parametrize("name", ["gemma2", "qwen3"])
def test_grpo_moves_the_policy_and_keeps_the_checkpoint_as_its_reference(workdir, monkeypatch, name):
    from dew.pretrained import Pretrained

    monkeypatch.chdir(workdir)
    # A reward that a random model's completions already differ in (their length), so every
    # group has an advantage to follow from the first step.
    rows, state = _run("gemma-grpo", ["trainer.steps=3", "objective.group_size=4", "data.batch=2",
                                      "objective.max_new_tokens=3", "objective.reward={name: length, target: 2}",
                                      *_family(name, f"grpo-{name}")])
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    assert {"reward", "kl", "clip_fraction"} <= set(rows[0])
    assert abs(rows[0]["kl"]) < 1e-6  # the first rollout's policy is the reference itself
    loaded = Pretrained.load(workdir / f"checkpoints/{name}-tiny", max_seq_len=32)
    reference = jax.tree_util.tree_leaves_with_path(state.params["reference"])
    start = dict(jax.tree_util.tree_leaves_with_path(loaded.variables["params"]))
    assert len(reference) == len(start)
    for path, leaf in reference:
        assert np.array_equal(np.asarray(leaf), np.asarray(start[path])), jax.tree_util.keystr(path)
    moved = [not np.array_equal(np.asarray(leaf), np.asarray(start[path]))
             for path, leaf in jax.tree_util.tree_leaves_with_path(state.params["params"])]
    assert any(moved)
    # The journal (and a reward) reads each prompt as the policy saw it, as transformers' decode
    # spells it: Gemma's beginning-of-text token was left out ("3+4=" for "<bos>3+4=").
    from dew.training.rollout_journal import read_journal

    hf = transformers.AutoTokenizer.from_pretrained(workdir / f"checkpoints/{name}-tiny")
    prompts = [p for entry in read_journal(workdir / f"runs/grpo-{name}") for r in entry.transcript for p in r["prompts"]]
    assert prompts
    for prompt in prompts:
        plain = hf.decode(hf(prompt, add_special_tokens=False).input_ids, skip_special_tokens=True)
        assert prompt == hf.decode(hf(plain).input_ids), (prompt, plain)
    assert name != "gemma2" or all(p.startswith(hf.bos_token) for p in prompts)


def test_addition_problems_are_written_in_the_checkpoints_own_tokenizer(workdir):
    from dew.data.addition import Addition
    from dew.data.tokenizers import ByteTokenizer

    directory = workdir / "checkpoints" / "gemma2-tiny"
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    records = Addition(form="prompts", problems=6, max_operand=40, tokenizer=str(directory / "tokenizer.json"))
    assert records.text_tokenizer().eos_id == theirs.eos_token_id
    columns = records.records().columns
    a, b = (int(x) for x in np.random.default_rng(0).integers(0, 41, size=(6, 2))[2])  # the third problem
    prompt = columns["prompt"][2][: columns["prompt_length"][2]].tolist()
    assert prompt == theirs(f"{a}+{b}=")["input_ids"]  # a prompt starts as transformers starts it: <bos> first
    assert prompt[0] == theirs.bos_token_id
    answer = [i for i in columns["answer"][2].tolist() if i >= 0]
    assert answer == theirs.encode(str(a + b), add_special_tokens=False)
    # Without a tokenizer the problems are bytes, and the tokenizer handed on (so `dew generate` can
    # read and write the run's text) is the one that writes exactly those bytes.
    default = Addition(form="prompts", problems=6, max_operand=40)
    tokenizer = default.text_tokenizer()
    assert isinstance(tokenizer, ByteTokenizer)
    byte_columns = default.records().columns
    byte_prompt = byte_columns["prompt"][2][: byte_columns["prompt_length"][2]].tolist()
    assert byte_prompt == list(f"{a}+{b}=".encode()) == tokenizer.encode(f"{a}+{b}=")
    assert [i for i in byte_columns["answer"][2].tolist() if i >= 0] == list(str(a + b).encode())


def _start(workdir, name: str) -> dict:
    from dew.pretrained import Pretrained

    loaded = Pretrained.load(workdir / f"checkpoints/{name}-tiny", max_seq_len=32)
    return dict(jax.tree_util.tree_leaves_with_path(loaded.variables["params"]))


def _assert_reference_is_the_checkpoint_and_the_policy_moved(state, start: dict) -> None:
    reference = jax.tree_util.tree_leaves_with_path(state.params["reference"])
    assert len(reference) == len(start)
    for path, leaf in reference:
        assert np.array_equal(np.asarray(leaf), np.asarray(start[path])), jax.tree_util.keystr(path)
    policy = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params["params"])
              if path in start]  # PPO's value head is the policy's own, beside the checkpoint's weights
    assert len(policy) == len(start)
    assert any(not np.array_equal(np.asarray(leaf), np.asarray(start[path])) for path, leaf in policy)


# The addition recipes (issue 26, item 5: every objective takes any family), with their model and
# start swapped for a published family's checkpoint and its tokenizer.
def _addition_from(name: str, run: str) -> list[str]:
    return [f"model={{name: {name}, preset: tiny, max_seq_len: 32}}", f"init={{pretrained: checkpoints/{name}-tiny}}",
            f"data.tokenizer=checkpoints/{name}-tiny", f"trainer.checkpoint_dir=runs/{run}",
            f"trackers.0.directory=runs/{run}", "trainer.eval_every=null", "data.load.val_fraction=0",
            "optimizer.warmup_steps=0"]


def test_dpo_starts_from_a_family_checkpoint_as_policy_and_reference(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    rows, state = _run("addition-dpo", ["trainer.steps=3", "data.batch=4", "optimizer.learning_rate=1e-2",
                                        *_addition_from("qwen3", "dpo-qwen3")])
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    # Step 1: the policy is its reference, so every log-ratio is 0 and the loss is -log sigmoid(0).
    assert rows[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    assert abs(rows[0]["reward_margin"]) < 1e-5
    _assert_reference_is_the_checkpoint_and_the_policy_moved(state, _start(workdir, "qwen3"))


def test_a_stage_started_from_a_dpo_run_takes_its_policy_and_exports_as_the_checkpoint(workdir, monkeypatch, capsys):
    """Post-training stages chained by init.run (a checkpoint, then DPO, then GRPO): the DPO run's
    frozen reference was refused as leaves GRPO's variables lack, the init.ignore that error advised
    gave GRPO a random reference, and the chained run's export lost the checkpoint's chat template
    and context length (its init.run was not followed back to the checkpoint)."""
    from dew.cli import main

    monkeypatch.chdir(workdir)
    _, dpo = _run("addition-dpo", ["trainer.steps=2", "data.batch=4", "optimizer.learning_rate=1e-2",
                                   *_addition_from("qwen3", "chain-dpo")])
    policy = dict(jax.tree_util.tree_leaves_with_path(dpo.params["params"]))
    for run, ignore in (("chain-grpo", []), ("chain-grpo-ignoring", ['init.ignore=["reference/*"]'])):
        rows, grpo = _run("addition-grpo", [
            *[a for a in _addition_from("qwen3", run) if not a.startswith("init=")], "init={run: runs/chain-dpo}",
            *ignore, "trainer.steps=1", "objective.group_size=2", "data.batch=2", "objective.max_new_tokens=2",
            "objective.reward={name: length, target: 2}"])
        assert abs(rows[0]["kl"]) < 1e-6, run  # the first rollout's policy is its reference
        reference = jax.tree_util.tree_leaves_with_path(grpo.params["reference"])
        assert len(reference) == len(policy)
        for path, leaf in reference:  # the DPO run's policy, not its reference nor a fresh draw
            assert np.array_equal(np.asarray(leaf), np.asarray(policy[path])), (run, jax.tree_util.keystr(path))
    assert main(["export", "runs/chain-grpo", "exported-chain", "--verify"]) == 0, capsys.readouterr().err
    checkpoint = workdir / "checkpoints/qwen3-tiny"
    assert (workdir / "exported-chain/chat_template.jinja").read_text() == (checkpoint / "chat_template.jinja").read_text()
    exported, original = (json.loads((folder / "config.json").read_text())
                          for folder in (workdir / "exported-chain", checkpoint))
    assert exported["max_position_embeddings"] == original["max_position_embeddings"]
    # The policy's stop token (the recipe's newline) ends transformers' generation as it ends dew's: it was
    # written into config.json's eos ids but not generation_config.json's, which generate reads.
    stops = exported["eos_token_id"]
    assert isinstance(stops, list) and len(stops) == 2, stops
    assert set(transformers.GenerationConfig.from_pretrained(workdir / "exported-chain").eos_token_id) == set(stops)


def test_an_export_takes_nothing_of_a_checkpoints_tokenizer_the_run_did_not_use(workdir, monkeypatch, capsys):
    """DPO from a Qwen3 checkpoint on dew's byte tokenizer: its export held the byte tokenizer's
    tokenizer.json beside the checkpoint's chat template, special tokens and generation settings,
    so transformers read an end-of-text id the model was never trained on."""
    from dew.cli import main

    monkeypatch.chdir(workdir)
    _run("addition-dpo", ["trainer.steps=1", "data.batch=4", "data.tokenizer=byte",
                          *[a for a in _addition_from("qwen3", "dpo-byte") if not a.startswith("data.tokenizer=")]])
    capsys.readouterr()
    assert main(["export", "runs/dpo-byte", "exported-byte"]) == 0
    assert "the run's tokenizer is not the one of" in capsys.readouterr().err
    assert not (workdir / "exported-byte/chat_template.jinja").exists()
    assert not (workdir / "exported-byte/generation_config.json").exists()
    hf = transformers.AutoTokenizer.from_pretrained(workdir / "exported-byte")
    assert hf.chat_template is None and hf.eos_token_id == 256  # the byte tokenizer's own end of text


def _chat_pairs(workdir) -> list[dict]:
    """Chat preference pairs on addition, written to workdir/pairs.jsonl and returned."""
    records = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "chosen": [{"role": "assistant", "content": str(a + b)}],
                "rejected": [{"role": "assistant", "content": str(a + b + 3)}]} for a in range(6) for b in range(6)]
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_a_reward_model_scores_a_rollouts_chat_turn_where_its_pairs_were_scored(workdir, monkeypatch):
    """A reward model trained on Qwen3 chat pairs scored each completion of a chat rollout without the
    end of its assistant turn (<|im_end|>\\n, where the pairs were scored): unless the user guessed
    that suffix, its preference accuracy through the `model` reward fell below chance."""
    from dew.rewards.model import RewardModel

    monkeypatch.chdir(workdir)
    records = _chat_pairs(workdir)
    _run("addition-reward-model", [
        "model={name: qwen3, preset: tiny, max_seq_len: 64}", "init={pretrained: checkpoints/qwen3-tiny}",
        "objective.seq_len=48", "data={name: chat_preferences, files: pairs.jsonl, tokenizer: checkpoints/qwen3-tiny, "
        "length: 48, batch: 4}", "trainer.steps=3", "trainer.eval_every=null", "optimizer.warmup_steps=0",
        "optimizer.learning_rate=1e-2", "trainer.checkpoint_dir=runs/rm-chat", "trackers.0.directory=runs/rm-chat"])
    reward = RewardModel(run="runs/rm-chat")
    hf = transformers.AutoTokenizer.from_pretrained(workdir / "checkpoints/qwen3-tiny")
    asked = records[7]["prompt"]
    prompt = hf.decode(hf.apply_chat_template(asked, add_generation_prompt=True, tokenize=True, return_dict=False))
    for reply in ("3", "6"):  # the rollout's completion text, its stop id cut off
        whole = hf.apply_chat_template([*asked, {"role": "assistant", "content": reply}], tokenize=False)
        scored = float(reward([reply], {"prompt_text": [prompt]})[0])
        assert scored == pytest.approx(float(reward.scoring([whole])[0]), abs=1e-6), (reply, whole)
        assert scored != pytest.approx(float(reward.scoring([prompt + reply])[0]), abs=1e-6)


def _published_reward_model(workdir, name: str, base: str = "checkpoints/qwen3-tiny",
                            **settings: object) -> tuple[object, object]:
    """transformers' own one-label ...ForSequenceClassification (a reward model, as TRL writes one) over
    the config of the tiny checkpoint base (Qwen 3's by default; settings over it), every weight redrawn,
    saved beside that checkpoint's tokenizer."""
    config = transformers.AutoConfig.from_pretrained(workdir / base, num_labels=1, **settings)
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(workdir / base)
    model.save_pretrained(workdir / name)
    tokenizer.save_pretrained(workdir / name)
    return model, tokenizer


def test_a_reward_model_of_another_family_reads_the_conversation_in_its_own_template(workdir, monkeypatch):
    """A Gemma-style policy's chat prompts reached a Qwen reward model in Gemma's template (Gemma's turn
    markers split into bytes, the turn left unclosed): its scores were not TRL's, their order reversed in
    the audit's case. Prompts given as messages are now rendered, with the completion as the assistant's
    turn, by the reward model's own template, as TRL's GRPO renders them; a Mistral-style template, which
    has no generation prompt, closes the turn of a text prompt too."""
    from dew.data.prompts import Prompts
    from dew.families.examples import main
    from dew.rewards.model import RewardModel

    monkeypatch.chdir(workdir)
    model, theirs = _published_reward_model(workdir, "qwen-rm")
    chats = [[{"role": "user", "content": "What is 3 plus 4?"}],
             [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 9?"}],
             [{"role": "user", "content": "What is 5 plus 5?"}, {"role": "assistant", "content": "It is"}]]
    # A text prompt beside them is scored as written, without the policy's <bos> spelt into it.
    given = [*chats, "plain 3+4="]
    (workdir / "chat-prompts.jsonl").write_text("".join(json.dumps({"prompt": c}) + "\n" for c in given))
    records = Prompts(files="chat-prompts.jsonl", tokenizer="checkpoints/gemma2-tiny").records()
    policy = transformers.AutoTokenizer.from_pretrained("checkpoints/gemma2-tiny")
    rows = [records[i] for i in range(len(given))]
    context = {"prompt_text": [policy.decode(r["prompt"][: r["prompt_length"]]) for r in rows],
               "prompt_given": np.stack([r["prompt_given"] for r in rows])}  # as the rollout hands them
    assert all(text.startswith("<bos>") for text in context["prompt_text"])  # the policy's own template
    completions = [" It is 7.", "11", " 10.", "7"]
    trl = [chat[:-1] + [{"role": "assistant", "content": chat[-1]["content"] + c}] if chat[-1]["role"] == "assistant"
           else [*chat, {"role": "assistant", "content": c}] for chat, c in zip(chats, completions[:3], strict=True)]
    texts = [theirs.apply_chat_template(conversation, tokenize=False) for conversation in trl] + ["plain 3+4=7"]
    assert context["prompt_text"][3] == "<bos>plain 3+4="  # what the policy read
    with torch.no_grad():  # TRL tokenizes the rendered text without adding special tokens again
        expected = model(**theirs(texts, padding=True, add_special_tokens=False, return_tensors="pt")).logits[:, 0]
    np.testing.assert_allclose(RewardModel(run="qwen-rm")(completions, context), expected.numpy(), atol=1e-5)

    # Mistral's template writes no generation prompt: a text prompt's turn is closed with its </s> all the same.
    assert main(["mistral", str(workdir / "checkpoints" / "mistral-tiny"), "--seed", "2"]) == 0
    model, theirs = _published_reward_model(workdir, "mistral-rm", base="checkpoints/mistral-tiny")
    asked = [{"role": "user", "content": "What is 3 plus 4?"}]
    prompt = theirs.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    whole = theirs.apply_chat_template([*asked, {"role": "assistant", "content": "It is 7."}], tokenize=False)
    assert whole.endswith("</s>") and not prompt.endswith("</s>")
    with torch.no_grad():
        expected = model(**theirs([whole], add_special_tokens=False, return_tensors="pt")).logits[:, 0]
    scored = RewardModel(run="mistral-rm")(["It is 7."], {"prompt_text": [prompt]})
    np.testing.assert_allclose(scored, expected.numpy(), atol=1e-5)


def test_a_published_reward_model_scores_as_transformers_does_and_serves_as_a_reward(workdir, monkeypatch, capsys):
    """A reward model in the layout published ones ship in (transformers' ForSequenceClassification,
    one label) was refused as an unknown architecture: it now scores text as transformers does, rewards
    an RL run's chat turns, starts a reward-model run with its own score, and exports back."""
    from dew.cli import main
    from dew.pretrained import Pretrained
    from dew.rewards.model import RewardModel

    monkeypatch.chdir(workdir)
    model, tokenizer = _published_reward_model(workdir, "published-rm")
    asked = [{"role": "user", "content": "What is 2 plus 3?"}]
    texts = [tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": reply}], tokenize=False)
             for reply in ("5", "seven or so")] + ["plain text, no template"]
    with torch.no_grad():  # one batch, padded at the end: transformers pools each row's last real token
        theirs = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0].numpy()
    assert len(set(np.round(theirs, 3))) == 3  # the redrawn head tells the texts apart

    reward = RewardModel(run="published-rm")  # the `model` reward of an RL recipe, given the folder
    np.testing.assert_allclose(reward.scoring(texts), theirs, atol=1e-5)
    prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    scored = reward(["5", "seven or so"], {"prompt_text": [prompt, prompt]})  # the turn closed as the pairs were
    np.testing.assert_allclose(scored, theirs[:2], atol=1e-5)
    assert main(["generate", "published-rm", texts[2]]) == 0
    assert capsys.readouterr().out.startswith(f"{theirs[2]:.4f}\t")

    # A reward-model run started from it keeps its score (a tiny step moves it by about 1e-6).
    _chat_pairs(workdir)
    _run("addition-reward-model", [
        "model={name: qwen3, preset: tiny, max_seq_len: 64}", "init={pretrained: published-rm}",
        "objective.seq_len=48", "data={name: chat_preferences, files: pairs.jsonl, tokenizer: published-rm, "
        "length: 48, batch: 4}", "trainer.steps=1", "trainer.eval_every=null", "optimizer.warmup_steps=0",
        "optimizer.learning_rate=1e-6", "trainer.checkpoint_dir=runs/rm-published",
        "trackers.0.directory=runs/rm-published"])
    # With LoRA too (the objective's score head trains in full beside the adapters).
    rows, _ = _run("addition-reward-model", [
        "model={name: qwen3, preset: tiny, max_seq_len: 64}", "init={pretrained: published-rm}", "lora={rank: 4}",
        "objective.seq_len=48", "data={name: chat_preferences, files: pairs.jsonl, tokenizer: published-rm, "
        "length: 48, batch: 4}", "trainer.steps=1", "trainer.eval_every=null", "optimizer.warmup_steps=0",
        "trainer.checkpoint_dir=runs/rm-published-lora", "trackers.0.directory=runs/rm-published-lora"])
    assert rows and np.isfinite(rows[0]["loss"]) and rows[0]["loss"] != pytest.approx(np.log(2.0))  # a head's
    assert main(["export", "runs/rm-published", "exported/rm-published", "--verify"]) == 0
    assert "Qwen3ForSequenceClassification matches dew's scores" in capsys.readouterr().out
    again = transformers.AutoModelForSequenceClassification.from_pretrained("exported/rm-published").eval()
    np.testing.assert_allclose(again.score.weight.detach().numpy(), model.score.weight.detach().numpy(), atol=1e-5)
    # transformers' own save of dew's export comes back to dew bit for bit.
    again.save_pretrained(workdir / "resaved-rm")
    tokenizer.save_pretrained(workdir / "resaved-rm")
    exported, resaved = Pretrained.load("exported/rm-published"), Pretrained.load("resaved-rm")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(exported.variables),
                                                   jax.tree.leaves(resaved.variables), strict=True))

    # Another objective cannot start from it (its decoder ends in a score), and says what to do instead.
    assert main(["train", "qwen3-sft", "init.pretrained=published-rm", "data.tokenizer=published-rm",
                 "trainer.steps=1", "trainer.checkpoint_dir=runs/sft-from-rm",
                 "trackers.0.directory=runs/sft-from-rm"]) == 2
    refused = capsys.readouterr().err
    assert "RewardModelStartError" in refused and "is a reward model" in refused
    assert "objective.reward: {name: model, run: " in refused  # the recipe's key, as it is written
    # One that says tie_word_embeddings: false (Llama 3's reward models) stores no head to untie: the run
    # is told to tie its embedding (it was told the checkpoint said true, which it does not).
    from dew.recipes.run import RewardModelStartError, build_parts, initial_variables

    _published_reward_model(workdir, "untied-rm", tie_word_embeddings=False)
    untied = ["model={name: qwen3, preset: tiny, max_seq_len: 64, tie_embeddings: false}",
              "init={pretrained: untied-rm}", "objective.seq_len=48",
              "data={name: chat_preferences, files: pairs.jsonl, tokenizer: untied-rm, length: 48, batch: 4}"]
    config = RunConfig.load("addition-reward-model", untied)
    with pytest.raises(RewardModelStartError, match="stores no language-model head.*Set model.tie_embeddings=true"):
        initial_variables(config, build_parts(config, with_data=False).objective)
    config = RunConfig.load("addition-reward-model", [*untied, "model.tie_embeddings=true"])
    assert initial_variables(config, build_parts(config, with_data=False).objective) is not None
    # A classifier with several labels is no reward model: refused by its labels.
    config = json.loads((workdir / "published-rm" / "config.json").read_text())
    (workdir / "classifier").mkdir()
    for file in (workdir / "published-rm").iterdir():
        (workdir / "classifier" / file.name).write_bytes(file.read_bytes())
    config.update(id2label={"0": "NEGATIVE", "1": "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    (workdir / "classifier" / "config.json").write_text(json.dumps(config))
    assert main(["generate", "classifier", "hello"]) == 2
    assert "with 2 labels, a classifier" in capsys.readouterr().err


def test_ppo_starts_from_a_family_checkpoint_with_a_value_head_beside_it(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    rows, state = _run("addition-ppo", ["trainer.steps=2", "data.batch=4", "objective.max_new_tokens=3",
                                        "objective.reward={name: length, target: 2}",
                                        "objective.epochs=1", "objective.minibatches=1",
                                        *_addition_from("gemma2", "ppo-gemma2")])
    assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
    assert abs(rows[0]["kl"]) < 1e-6  # the first sample's policy is the reference itself
    assert "value_head" in state.params["params"]
    _assert_reference_is_the_checkpoint_and_the_policy_moved(state, _start(workdir, "gemma2"))


def test_lora_trains_a_reward_models_score_and_a_ppo_value_head_in_full_and_exports_them(workdir, monkeypatch,
                                                                                          capsys):
    """A LoRA run froze every leaf but the adapters, so an objective's own head (a reward model's score,
    PPO's value head) never trained, and the base weights, lacking it, were refused at the start: LoRA
    reward models and LoRA PPO could not run. The heads now train in full beside the adapters (PEFT's
    modules_to_save), and the reward model's PEFT adapters carry its score."""
    import flax.linen as nn
    import peft

    from dew.cli import main

    monkeypatch.chdir(workdir)
    records = _chat_pairs(workdir)
    rows, state = _run("addition-reward-model", [
        "model={name: qwen3, preset: tiny, max_seq_len: 64}", "init={pretrained: checkpoints/qwen3-tiny}",
        "lora={rank: 4}", "objective.seq_len=48", "data={name: chat_preferences, files: pairs.jsonl, "
        "tokenizer: checkpoints/qwen3-tiny, length: 48, batch: 4}", "trainer.steps=2", "trainer.eval_every=null",
        "optimizer.warmup_steps=0", "optimizer.learning_rate=1e-2", "trainer.checkpoint_dir=runs/rm-lora",
        "trackers.0.directory=runs/rm-lora"])
    params = jax.device_get(nn.meta.unbox(state.params))["params"]
    assert np.any(params["reward_head"]["dense"]["kernel"])  # it starts at zero: only training moves it
    assert rows[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6) and rows[-1]["loss"] != rows[0]["loss"]
    b = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
         if jax.tree_util.keystr(path).endswith("_lora_b']")]
    assert b and any(np.any(np.asarray(leaf)) for leaf in b)  # the adapters trained too

    assert main(["export", "runs/rm-lora", "exported/rm-lora"]) == 0
    assert main(["export", "runs/rm-lora", "exported/rm-lora-adapters", "--adapters", "--verify"]) == 0
    said = capsys.readouterr().out
    assert "with the reward model's score" in said
    assert "Verified: transformers' PeftModel on Qwen3ForSequenceClassification matches dew's scores" in said
    hf = transformers.AutoTokenizer.from_pretrained("checkpoints/qwen3-tiny")
    texts = [hf.apply_chat_template([*r["prompt"], *r["chosen"]], tokenize=False) for r in records[:3]]
    encoded = hf(texts, padding=True, return_tensors="pt")
    merged = transformers.AutoModelForSequenceClassification.from_pretrained("exported/rm-lora").eval()
    base = transformers.AutoModelForSequenceClassification.from_pretrained("checkpoints/qwen3-tiny", num_labels=1)
    adapted = peft.PeftModel.from_pretrained(base, "exported/rm-lora-adapters").eval()
    with torch.no_grad():
        by_merge, by_adapters = (m(**encoded).logits[:, 0].numpy() for m in (merged, adapted))
    from dew.rewards.model import RewardModel

    ours = RewardModel(run="runs/rm-lora").scoring(texts)
    from dew.rewards.model import NotARewardModelError

    with pytest.raises(NotARewardModelError, match="holds LoRA adapters alone"):  # it was "holds neither run.json"
        RewardModel(run="exported/rm-lora-adapters")
    with pytest.raises(NotARewardModelError, match="published reward model's folder"):
        RewardModel(run="checkpoints/qwen3-tiny")
    np.testing.assert_allclose(by_merge, ours, atol=1e-5)
    np.testing.assert_allclose(by_adapters, ours, atol=1e-5)
    # dew reads those adapters back onto the base, the score with them.
    from dew.families import family
    from dew.pretrained.peft import load_adapters

    blank = jax.tree_util.tree_map_with_path(
        lambda path, leaf: np.zeros_like(leaf) if "lora_b" in jax.tree_util.keystr(path)
        or "reward_head" in jax.tree_util.keystr(path) else leaf, {"params": params})
    back = load_adapters("exported/rm-lora-adapters", family("qwen3").build("tiny", max_seq_len=64), blank)
    for ours_leaf, read in zip(jax.tree.leaves({"params": params}), jax.tree.leaves(back), strict=True):
        np.testing.assert_allclose(np.asarray(read), np.asarray(ours_leaf), atol=1e-7)

    rows, ppo = _run("addition-ppo", ["trainer.steps=2", "data.batch=4", "objective.max_new_tokens=3",
                                      "objective.reward={name: length, target: 2}", "objective.epochs=1",
                                      "objective.minibatches=1", "lora={rank: 4}",
                                      *_addition_from("gemma2", "ppo-lora-gemma2")])
    head = jax.device_get(nn.meta.unbox(ppo.params))["params"]["value_head"]["dense"]
    assert np.any(head["kernel"]) and np.any(head["bias"])  # both start at zero: only training moves them
    # The reference is the base itself (a fresh random copy gave a first KL of 3.8), and no copy is kept.
    assert abs(rows[0]["kl"]) < 1e-6 and "reference" not in ppo.params


# DeepSeek-V3's latent attention samples through the generation engine's paged pools (issue 29,
# item 1: the engine runs on any registered causal decoder): GRPO and `dew generate` from its checkpoint.
@pytest.fixture(scope="module")
def deepseek(workdir):
    from dew.families.examples import main

    assert main(["deepseek_v3", str(workdir / "checkpoints" / "deepseek_v3-tiny"), "--seed", "1"]) == 0
    return workdir


def test_grpo_and_generate_run_on_deepseek_v3s_latent_attention(deepseek, monkeypatch, capsys):
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from dew.cli import main
    from dew.recipes.opening import open_run

    monkeypatch.chdir(deepseek)
    rows, state = _run("gemma-grpo", ["trainer.steps=3", "objective.group_size=4", "data.batch=2",
                                      "objective.max_new_tokens=3", "objective.reward={name: length, target: 2}",
                                      *_family("deepseek_v3", "grpo-deepseek_v3"),
                                      # the folder: its tokenizer_config.json names DeepSeek's end token
                                      "data.tokenizer=checkpoints/deepseek_v3-tiny",
                                      "trainer.eval_every=null", "data.load.val_fraction=0"])
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    assert abs(rows[0]["kl"]) < 1e-6  # the first rollout's policy is the reference itself
    _assert_reference_is_the_checkpoint_and_the_policy_moved(state, _start(deepseek, "deepseek_v3"))

    # `dew generate` on the trained run continues a prompt as argmax of a full forward pass does.
    capsys.readouterr()
    assert main(["generate", "runs/grpo-deepseek_v3", "3+4=", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    opened = open_run("runs/grpo-deepseek_v3")
    tokenizer = opened.tokenizer
    forward = jax.jit(opened.model.apply)  # one program: a causal model's scores ignore the padding after
    ids = transformers_ids = AutoTokenizer.from_pretrained("checkpoints/deepseek_v3-tiny")("3+4=")["input_ids"]
    assert ids[0] == tokenizer.prefix[0]  # its beginning-of-text id first, as transformers starts a prompt
    for _ in range(4):
        logits = forward(opened.variables, jnp.asarray([ids + [0] * (16 - len(ids))], jnp.int32))
        ids = [*ids, int(jnp.argmax(logits[0, len(ids) - 1]))]
        if ids[-1] == tokenizer.eos_id:
            break
    new = ids[len(transformers_ids):]
    assert printed == "3+4=" + tokenizer.decode(new[:-1] if new[-1] == tokenizer.eos_id else new) + "\n"


# QLoRA and distillation (issue 26, item 5) from a family this issue added: the base held as int8
# codes of the checkpoint's weights, the teacher the checkpoint itself, frozen.
def test_qlora_holds_a_family_checkpoint_as_int8_codes_and_trains_its_adapters(workdir, monkeypatch):
    import flax.linen as nn

    from dew.pretrained import Pretrained

    monkeypatch.chdir(workdir)
    rows, state = _run("tiny-lm-qlora", [
        "model={name: gemma2, preset: tiny, max_seq_len: 64}", "lora.base=int8",
        "init.pretrained=checkpoints/gemma2-tiny", "data.tokenizer=checkpoints/gemma2-tiny/tokenizer.json",
        "trainer.steps=3", "trainer.eval_every=null", "data.load.val_fraction=0", "objective.prompt=null",
        "data.batch=4", "trainer.checkpoint_dir=runs/qlora-gemma2", "trackers.0.directory=runs/qlora-gemma2"])
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    start = jax.device_get(Pretrained.load("checkpoints/gemma2-tiny").variables["params"])
    held = jax.device_get(nn.meta.unbox(state.params))["params"]
    quantized = 0
    for path, want in jax.tree_util.tree_leaves_with_path(start):
        leaf = held
        for key in path:
            leaf = leaf[key.key]
        want = np.asarray(want)
        if hasattr(leaf, "array"):  # an adapted weight, held as int8 codes and a scale per channel
            codes, scale = np.asarray(leaf.array.qvalue), np.asarray(leaf.array.scale)
            assert codes.dtype == np.int8, jax.tree_util.keystr(path)
            assert np.all(np.abs(codes * scale - want) <= scale / 2 + 1e-7), jax.tree_util.keystr(path)
            quantized += 1
        else:  # norms and the embedding: the checkpoint's, untouched
            assert np.array_equal(np.asarray(leaf), want), jax.tree_util.keystr(path)
    assert quantized == 2 * 7  # two layers: query, key, value, out, wi, wi_gate, wo
    moved = [np.any(np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(held)
             if jax.tree_util.keystr(path).endswith("_lora_b']")]
    assert moved and any(moved)  # B starts at zero: only training moves it


def test_distillation_reads_its_teacher_from_a_family_checkpoint_and_holds_it_frozen(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    rows, state = _run("tiny-distill", [
        "model={name: gemma2, preset: tiny, num_layers: 1, max_seq_len: 64}", "objective.teacher=null",
        "objective.teacher_checkpoint=null", "objective.teacher_pretrained=checkpoints/gemma2-tiny",
        "data.tokenizer=checkpoints/gemma2-tiny/tokenizer.json", "trainer.steps=3", "trainer.eval_every=null",
        "data.load.val_fraction=0", "data.batch=4", "trainer.checkpoint_dir=runs/distill-gemma2",
        "trackers.0.directory=runs/distill-gemma2"])
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    start = _start(workdir, "gemma2")
    teacher = jax.tree_util.tree_leaves_with_path(state.params["params"]["teacher"])
    assert len(teacher) == len(start)
    for path, leaf in teacher:  # the checkpoint's weights, bit for bit, after three steps
        assert np.array_equal(np.asarray(leaf), np.asarray(start[path])), jax.tree_util.keystr(path)
    # That run as the next one's teacher holds the student beside its teacher, not one model: the
    # refusal advised init.within and init.ignore, which set the student's start, not the teacher's.
    from dew.training.initializers import InitializerMismatchError

    with pytest.raises(InitializerMismatchError, match=r"objective.teacher_checkpoint=runs/distill-gemma2: .* export "
                                                       r"it \(dew export runs/distill-gemma2 DIR\) and set "
                                                       r"objective.teacher_pretrained=DIR"):
        _run("tiny-distill", [
            "model={name: gemma2, preset: tiny, num_layers: 1, max_seq_len: 64}",
            "objective.teacher={name: gemma2, preset: tiny, num_layers: 1, max_seq_len: 64}",
            "objective.teacher_checkpoint=runs/distill-gemma2", "objective.teacher_pretrained=null",
            "data.tokenizer=checkpoints/gemma2-tiny/tokenizer.json", "trainer.steps=1", "trainer.eval_every=null",
            "data.load.val_fraction=0", "data.batch=4", "trainer.checkpoint_dir=runs/distill-again",
            "trackers.0.directory=runs/distill-again"])


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(workdir, monkeypatch):
    """A Qwen3 teacher whose tokenizer spells text as other ids (Llama 2 beside Mistral: 32000 ids each)
    was distilled from id by id without a word, on unrelated tokens."""
    import shutil

    from dew.objectives.distillation import TeacherVocabularyError

    monkeypatch.chdir(workdir)
    shutil.copytree(workdir / "checkpoints/qwen3-tiny", workdir / "checkpoints/qwen3-other-ids", dirs_exist_ok=True)
    file = workdir / "checkpoints/qwen3-other-ids/tokenizer.json"
    spec = json.loads(file.read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swap ids: same size, other ids
    file.write_text(json.dumps(spec))
    with pytest.raises(TeacherVocabularyError, match=r"comes with another tokenizer than the student's data"):
        _run("tiny-distill", [
            "model={name: qwen3, preset: tiny, num_layers: 1, max_seq_len: 64}", "objective.teacher=null",
            "objective.teacher_checkpoint=null", "objective.teacher_pretrained=checkpoints/qwen3-other-ids",
            "data.tokenizer=checkpoints/qwen3-tiny", "trainer.steps=1", "trainer.eval_every=null",
            "data.load.val_fraction=0", "data.batch=4", "trainer.checkpoint_dir=runs/distill-other-ids",
            "trackers.0.directory=runs/distill-other-ids"])
