"""Bad input to the `dew` commands is refused in one line with exit status 2, and nothing a command
writes lands on a run's own files: rescore's --out, report's --out, embed's inputs, a compilation
cache that is a file, an empty plugin name, infinite optimizer values, launch's --per-node and
--connect-timeout, and a config.json naming its architecture as a bare string.

Each command runs through ``dew.cli.main`` in this process, on files dew's own writers made."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dew.cli import main


def _refusal(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one line a refusal printed on stderr (no traceback), with nothing on stdout."""
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dew {command}: "), err
    assert captured.out == "", captured.out  # refused before any of the command's output
    return err


# -- dew rescore --out -------------------------------------------------------------------------------


@pytest.fixture
def journaled(tmp_path):
    """A run folder holding a rollout journal of two kept steps, written by dew's own journal, and
    its run.json."""
    from dew.training.rollout_journal import Rolled, RolloutJournal

    run = tmp_path / "runs" / "grpo"
    journal = RolloutJournal(run)
    journal.opened(0)
    for step in range(2):
        round_ = {"completions": ["4", "5"], "prompts": ["2+2=", "2+2="], "rewards": [1.0, 0.0],
                  "context": {"answer": ["4", "4"]}}
        journal.write(Rolled(step=step, batch={"tokens": np.zeros((2, 3), np.int32)}, data="d",
                             transcript=(round_,)))
    journal.checkpoint(2)
    (run / "run.json").write_text(json.dumps({"recipe": {}}))
    return run


def test_rescore_writes_a_new_file_and_never_the_runs_own(journaled, tmp_path, capsys):
    reward = ["reward=exact_match", "reward.key=answer"]
    for own in ("rollouts.jsonl", "run.json"):
        before = (journaled / own).read_bytes()
        assert main(["rescore", str(journaled), *reward, "--out", str(journaled / own)]) == 2
        assert "one of the files of the run" in _refusal(capsys, "rescore")
        assert (journaled / own).read_bytes() == before
    (tmp_path / "folder").mkdir()
    assert main(["rescore", str(journaled), *reward, "--out", str(tmp_path / "folder")]) == 2
    assert "is a directory" in _refusal(capsys, "rescore")
    assert main(["rescore", str(journaled), *reward, "--out", str(tmp_path / "folder" / "x" / "y")]) == 0
    capsys.readouterr()
    (tmp_path / "afile").write_text("")
    assert main(["rescore", str(journaled), *reward, "--out", str(tmp_path / "afile" / "scores.jsonl")]) == 2
    assert "scores.jsonl' lies under " in _refusal(capsys, "rescore")  # refused before the table was printed
    out = tmp_path / "scores.jsonl"
    out.write_text("a user's notes\n")  # replaced without a word, as a rescore's own scores are
    assert main(["rescore", str(journaled), *reward, "--out", str(out)]) == 2
    assert "holds a file dew rescore did not write" in _refusal(capsys, "rescore")
    assert out.read_text() == "a user's notes\n"
    out.write_text(json.dumps({"step": 9, "round": 0, "reward": 0.0, "rewards": [0.0]}) + "\n")
    assert main(["rescore", str(journaled), *reward, "--out", str(out)]) == 0  # an earlier rescore's: over, whole
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step"], r["rewards"]) for r in rows] == [(1, [1.0, 0.0]), (2, [1.0, 0.0])]
    assert [r["reward"] for r in rows] == [0.5, 0.5]  # each round's mean, as the help says
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".scores")]  # no temporary left
    # Scores written inside the run may be written again there: they are rescore's own, not the run's.
    inside = journaled / "rescored.jsonl"
    assert main(["rescore", str(journaled), *reward, "--out", str(inside)]) == 0
    assert main(["rescore", str(journaled), *reward, "--out", str(inside)]) == 0
    capsys.readouterr()
    # A kept step's files are checked by their hashes: the scores were written among them.
    (journaled / "2" / "state").mkdir(parents=True)
    for out in (journaled / "2" / "scores.jsonl", journaled / "2" / "state" / "scores.jsonl"):
        assert main(["rescore", str(journaled), *reward, "--out", str(out)]) == 2
        assert "lies in step 2 kept in the run" in _refusal(capsys, "rescore")
        assert not out.exists()


def test_rescore_refuses_a_reward_that_returns_text_as_training_does(journaled, capsys):
    """A reward returning ["1.0", ...] was scored 1.0 by dew rescore (numpy reads text of a number as one),
    where dew train refuses it (RewardShapeError)."""
    from dew import registry

    class Texts:
        def __call__(self, completions, context):
            return ["1.0"] * len(completions)

    with registry.rewards.temporary("texts", Texts):
        assert main(["rescore", str(journaled), "reward=texts"]) == 2
    err = _refusal(capsys, "rescore")
    assert "The reward 'texts' returned list ['1.0', '1.0'] for step 1's completions, which are no numbers" in err


def test_a_reward_function_registered_as_itself_is_named_so_not_asked_for_completions(journaled, capsys):
    """An entry point naming def reward(completions, context) was built with the recipe's fields, and
    dew train --check and dew rescore asked for fields 'completions' and 'context'."""
    from dew import registry
    from dew.recipes.components import problems_of

    def two_args(completions, context):
        return [1.0] * len(completions)

    def factory(scale: float = 1.0):  # a function of the fields that returns the reward: taken on trust
        return lambda completions, context: [scale] * len(completions)

    said = "is a function of completions and context: the reward itself, where an entry point of dew.rewards"
    with registry.rewards.temporary("two_args", two_args), registry.rewards.temporary("scaled", factory):
        [(path, message)] = problems_of("rewards", "two_args", {})
        assert path == ("name",) and said in message and "Register a class" in message
        assert main(["rescore", str(journaled), "reward=two_args"]) == 2
        assert said in _refusal(capsys, "rescore")
        assert problems_of("rewards", "scaled", {"scale": 2.0}) == []
        assert main(["rescore", str(journaled), "reward=scaled", "reward.scale=2"]) == 0
    assert "2.0000" in capsys.readouterr().out


LIMITED_RESCORE = """
import resource, signal, sys
from dew.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40, 40))  # writes past 40 bytes fail as on a full disk (EFBIG)
sys.exit(main(["rescore", sys.argv[1], "reward=exact_match", "reward.key=answer", "--out", sys.argv[2]]))
"""


def test_rescore_out_past_the_file_size_limit_asks_for_space_not_another_folder(journaled, tmp_path):
    """A write past ulimit -f (or a full disk) was answered "give a path in a directory you can write
    to", though the folder was writable; the fix is space (or the limit)."""
    import subprocess
    import sys

    out = tmp_path / "scores.jsonl"
    result = subprocess.run([sys.executable, "-c", LIMITED_RESCORE, str(journaled), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert (f"Could not write --out {str(out)!r}: File too large; free space on its disk (or raise the "
            "file-size limit, ulimit -f), or give a path on another.") in result.stderr
    assert not out.exists() and "Traceback" not in result.stderr


def test_a_tracker_folder_that_ran_out_of_space_is_traced_to_its_field_with_the_right_fix(tmp_path):
    """A tracker's journal refused for want of space was traced to trackers.0.directory with "point it at a
    directory this process can write", though it could."""
    import errno

    from dew.recipes.folder import _field_note
    from dew.tracking.background import TrackerWriteError

    for cause, said in ((OSError(errno.EFBIG, "File too large"), "free space on its disk (or raise the file-size "
                         "limit, ulimit -f), or point trackers.0.directory at another disk."),
                        (OSError(errno.ENOSPC, "No space left on device"), "free space on its disk"),
                        (PermissionError(errno.EACCES, "Permission denied"),
                         "point trackers.0.directory at a directory this process can write.")):
        try:
            raise TrackerWriteError("LocalTracker could not write 1 rows") from cause
        except TrackerWriteError as error:
            note = _field_note("trackers.0.directory", tmp_path, error)
        assert note.startswith("The recipe's trackers.0.directory names it: ") and said in note, note


# -- tracebacks turned into refusals ---------------------------------------------------------------------


def test_report_refuses_an_out_that_is_a_file(tmp_path, capsys):
    from dew.tracking.local import LocalTracker

    tracker = LocalTracker(tmp_path / "run")
    tracker.log({"loss": 1.0}, 1)
    tracker.close()
    (tmp_path / "page").write_text("mine")
    for out in (tmp_path / "page", tmp_path / "page" / "under"):
        assert main(["report", str(tmp_path / "run"), "--out", str(out)]) == 2
        assert "dew report writes a folder" in _refusal(capsys, "report")
    assert (tmp_path / "page").read_text() == "mine"
    # another run's folder (or the run's own): the page and its charts would sit among its checkpoints
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "run.json").write_text("{}")
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "other")]) == 2
    assert "is a run's folder (it holds run.json)" in _refusal(capsys, "report")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["run.json"]


def test_embed_names_an_input_it_cannot_read(tmp_path, capsys):
    from dew.cli.embed import InputImagesError, read_inputs

    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "folder.npy").mkdir()
    with pytest.raises(InputImagesError, match="empty.npy is not a NumPy array file"):
        read_inputs([tmp_path / "empty.npy"])
    cases = {"empty.npy": "is not a NumPy array file", "missing.npy": "does not exist",
             "folder.npy": "is a directory", "missing.png": "does not exist"}
    for name, said in cases.items():  # the inputs are read before the run is opened
        assert main(["embed", str(tmp_path / "no-run"), str(tmp_path / name), str(tmp_path / "out.npy")]) == 2
        err = _refusal(capsys, "embed")
        assert name in err and said in err and "Errno" not in err, err
    assert not (tmp_path / "out.npy").exists()


def test_embed_refuses_an_out_that_is_one_of_its_inputs(tmp_path, capsys, monkeypatch):
    """Two inputs given with OUT forgotten made the second input OUT: its images were replaced by vectors."""
    monkeypatch.chdir(tmp_path)
    images = np.zeros((2, 8, 8, 1), np.float32)
    for name in ("train.npy", "test.npy"):
        np.save(name, images)
    before = (tmp_path / "test.npy").read_bytes()
    for out in ("test.npy", "./test.npy", "test", str(tmp_path / "test.npy")):  # "test" is saved as test.npy
        assert main(["embed", str(tmp_path / "no-run"), "train.npy", "test.npy", out]) == 2
        err = _refusal(capsys, "embed")
        assert "is the input 'test.npy'" in err and "The last path given is OUT" in err, err
    (tmp_path / "link.npy").symlink_to(tmp_path / "train.npy")
    assert main(["embed", str(tmp_path / "no-run"), "link.npy", "train.npy"]) == 2
    assert "is the input 'link.npy'" in _refusal(capsys, "embed")
    assert (tmp_path / "test.npy").read_bytes() == before
    assert np.load(tmp_path / "train.npy").shape == (2, 8, 8, 1)


def test_a_compilation_cache_that_is_a_file_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").write_text("not a directory")
    code = main(["train", "tiny-lm", "trainer.compilation_cache_dir=cache", "trainer.steps=1",
                 f"trackers.0.directory={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("dew train: CompilationCacheError: trainer.compilation_cache_dir") and "is a file" in err
    assert (tmp_path / "cache").read_text() == "not a directory"
    # a folder that cannot be made there (a file above it, a read-only disk) is not one to create first
    assert main(["train", "tiny-lm", "trainer.compilation_cache_dir=cache/sub", "trainer.steps=1",
                 f"trackers.0.directory={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err
    assert "cannot be made a directory" in err and "create it first" not in err, err
    assert "point trainer.compilation_cache_dir at a directory this process can write" in err


def test_check_plugin_refuses_an_empty_name(capsys):
    for name in ("", "  "):
        assert main(["check-plugin", name]) == 2
        assert "No distribution was named" in _refusal(capsys, "check-plugin")


@pytest.mark.parametrize("command", [["check-plugin", "dew-trackers"], ["plan", "tiny-lm", "--devices", "1"]])
@pytest.mark.parametrize("value", ["nan", "0", "-5"])
def test_a_timeout_that_is_no_time_is_refused(command, value, capsys):
    """check-plugin: NaN reached subprocess.run as a traceback; 0 and -5 were taken, and every check then
    'failed'. plan: 0 and -5 started the compile, which then 'took longer than -5 s'."""
    with pytest.raises(SystemExit) as ended:
        main([*command, "--timeout", value])
    assert ended.value.code == 2
    assert f"argument --timeout: {value} is not more than 0 seconds" in capsys.readouterr().err


# -- optimizer values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", [
    "optimizer.learning_rate=.inf", "optimizer.learning_rate=.nan", "optimizer.weight_decay=.inf",
    "optimizer.clip_norm=.inf", "optimizer.eps=.inf",
    "optimizer.schedule=cosine optimizer.end_factor=.inf",
])
def test_an_infinite_or_nan_optimizer_value_is_refused(override, capsys):
    assert main(["train", "tiny-lm", *override.split(), "--check"]) == 2
    err = capsys.readouterr().err
    assert "Input should be a finite number" in err and override.split()[-1].split("=")[0] in err, err


@pytest.mark.parametrize(("recipe", "override"), [
    ("tiny-lm", "trainer.steps=null trainer.epochs=.inf"), ("tiny-lm", "trainer.steps=null trainer.epochs=.nan"),
    ("addition-dpo", "objective.beta=.nan"), ("addition-dpo", "objective.beta=.inf"),
    ("tiny-lm-lora", "lora.alpha=.inf"), ("tiny-lm", "objective.expert_loss_weight=.nan"),
])
def test_an_infinite_or_nan_recipe_number_is_refused_before_the_run(recipe, override, capsys):
    """An infinite trainer.epochs ended the run with an OverflowError's traceback; a NaN or infinite
    DPO beta or LoRA alpha trained every step to a rejected NaN loss and exited 0."""
    assert main(["train", recipe, *override.split(), "--check"]) == 2
    err = capsys.readouterr().err
    field = override.split()[-1].split("=")[0]
    assert "finite number" in err and (field in err or field.rpartition(".")[2] in err), err


def test_an_epsilon_that_computes_as_zero_is_refused(capsys):
    """1e-46 passed eps > 0 and computed as 0 in float32: the first update divided 0 by 0 and the
    run trained on, every step rejected, to exit 0."""
    for value in ("1e-46", "1e-40"):
        assert main(["train", "tiny-lm", f"optimizer.eps={value}", "--check"]) == 2
        err = capsys.readouterr().err
        assert "optimizer.eps" in err and f"{float(value):g} computes as 0 in float32" in err, err
    assert main(["train", "tiny-lm", "optimizer.eps=1e-30", "--check"]) == 0
    capsys.readouterr()


def test_an_infinite_group_multiplier_is_refused():
    import pydantic

    from dew.training.optim import OptimizerConfig, ParamGroup

    for value in (float("inf"), float("nan")):
        with pytest.raises(pydantic.ValidationError, match="finite number"):
            ParamGroup(match="*", lr_scale=value)
        with pytest.raises(pydantic.ValidationError, match="finite number"):
            OptimizerConfig(weight_decay=value)


# -- dew launch --print ---------------------------------------------------------------------------------------


def test_launch_refuses_fewer_than_one_rank_per_node(capsys):
    for per_node in ("-2", "0"):
        assert main(["launch", "--print", "slurm", "-n", "2", "--per-node", per_node, "tiny-lm"]) == 2
        assert f"--per-node {per_node}: a node runs at least one rank" in _refusal(capsys, "launch")


def test_launch_carries_the_connect_timeout_as_it_carries_the_grace(capsys):
    for kind in ("slurm", "jobset"):
        assert main(["launch", "--print", kind, "-n", "2", "--grace", "40", "--connect-timeout", "60",
                     "tiny-lm"]) == 0
        text = capsys.readouterr().out
        (written,) = [line for line in text.splitlines() if line.startswith("# written by: ")]
        assert "--grace 40 --connect-timeout 60" in written, written
        if kind == "slurm":
            assert "dew launch --grace 40 --connect-timeout 60 tiny-lm" in text.splitlines()[-1]
        else:
            assert '["dew", "launch", "--grace", "40", "--connect-timeout", "60", "tiny-lm"]' in text
    assert main(["launch", "--print", "slurm", "-n", "2", "tiny-lm"]) == 0
    assert "--connect-timeout" not in capsys.readouterr().out  # left out: each rank's own default


# -- a config.json's architectures ----------------------------------------------------------------------------


def test_an_architecture_named_as_a_string_is_read_as_one_name(tmp_path, capsys):
    from dew.families import family, for_config
    from dew.pretrained.errors import UnsupportedArchitectureError

    assert for_config({"architectures": "Qwen3ForCausalLM"}) is family("qwen3")
    with pytest.raises(UnsupportedArchitectureError, match="a list of model class names"):
        for_config({"architectures": 5})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": "GPT2LMHeadModel", "model_type": "gpt2"}))
    assert main(["generate", str(model), "hi"]) == 2
    err = _refusal(capsys, "generate")
    assert "The checkpoint is a GPT2LMHeadModel;" in err and "G, P, T" not in err, err


def test_a_planning_process_killed_by_a_signal_is_explained(monkeypatch, capsys):
    """Faking too many devices ran the planner out of memory, and dew plan said only that it
    'exited with status -9 and no plan:'. The kill is faked here: it cannot be caused without
    exhausting this machine's memory."""
    import subprocess

    from dew.cli import main

    def killed(*args, **kwargs):
        return subprocess.CompletedProcess(args[0], -9, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", killed)
    assert main(["plan", "tiny-lm", "--devices", "100000"]) != 0
    err = capsys.readouterr().err
    assert "stopped by signal 9 (SIGKILL)" in err and "faking 100000 devices" in err, err
    assert "Traceback" not in err


def test_generate_on_an_export_without_its_tokenizer_says_what_the_folder_lacks(tmp_path, capsys):
    """The refusal gave Python advice (build the objective with tokenizer=) to a user of the CLI."""
    import jax
    import jax.numpy as jnp

    from dew.cli import main
    from dew.nn.backbones import CausalTransformer
    from dew.pretrained import Pretrained

    model = CausalTransformer(vocab_size=64, emb_features=8, num_layers=1, num_heads=1, mlp_features=16,
                              max_seq_len=8)
    folder = Pretrained(model, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "m")
    assert main(["generate", str(folder), "hi"]) == 2
    err = capsys.readouterr().err
    assert "holds its tokenizer.json (and tokenizer_config.json) beside config.json" in err, err
    assert "Traceback" not in err


def test_generate_names_a_prompt_that_is_not_utf8(tmp_path, capsys):
    """Bytes a shell passed undecoded (lone surrogates) ended in "'utf-8' codec can't encode characters in
    position 0-1", naming neither the prompt nor what to do."""
    import jax
    import jax.numpy as jnp

    from dew.cli import main
    from dew.nn.backbones import CausalTransformer
    from dew.pretrained import Pretrained

    model = CausalTransformer(vocab_size=260, emb_features=8, num_layers=1, num_heads=1, mlp_features=16,
                              max_seq_len=8)
    folder = Pretrained(model, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "m")
    for argv in (["\udcff\udcfe abc"], ["abc", "--stop", "\udcff"]):
        assert main(["generate", str(folder), *argv]) == 2
        err = capsys.readouterr().err
        assert "is not UTF-8 text (characters 0 to" in err and "codec" not in err, err


def test_rescore_refuses_a_reward_given_twice():
    """reward=exact_match reward=length scored with the last one, without a word."""
    from dew.cli.rescore import RescoreError, parse_reward

    with pytest.raises(RescoreError, match=r"reward is given twice \('reward=length' after reward='exact_match'\)"):
        parse_reward(["reward=exact_match", "reward=length"])
    with pytest.raises(RescoreError, match=r"reward.key is given twice"):
        parse_reward(["reward=exact_match", "reward.key=a", "reward.key=b"])


def test_embed_refuses_images_that_are_not_finite_and_describe_a_name_it_would_not_read(tmp_path, capsys):
    """All-NaN images were embedded as all-NaN vectors with exit 0; `dew describe lm --markdown`
    printed the whole table and ignored lm."""
    import numpy as np

    from dew.cli import main
    from dew.cli.embed import InputImagesError, read_inputs

    path = tmp_path / "nan.npy"
    np.save(path, np.full((1, 4, 4, 1), np.nan, np.float32))
    with pytest.raises(InputImagesError, match="NaN or infinite pixel values"):
        read_inputs([path])
    assert main(["describe", "lm", "--markdown"]) == 2
    assert "--markdown prints every registered name, so 'lm' is not read" in capsys.readouterr().err


def test_a_run_json_that_is_a_directory_is_named_as_such(tmp_path, capsys):
    """The folder was said to hold neither run.json nor config.json, though it held one of them."""
    from dew.cli import main

    (tmp_path / "run.json").mkdir()
    assert main(["generate", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'run.json'} is not a file" in err and "holds neither" not in err, err


# -- a run folder this user may not read --------------------------------------------------------------


def test_a_run_folder_this_user_may_not_read_is_refused_in_one_line(journaled, tmp_path):
    """report, diff, audit and rescore showed PermissionError's traceback (exit 1) where eval said
    it in one line. The fault is the system's: the folder is made unreadable, and as root (which
    reads anything) the commands run as nobody."""
    import os
    import shutil
    import subprocess
    import sys

    from dew.tracking.local import LocalTracker

    tracker = LocalTracker(journaled)
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close()
    (journaled / "ledger.jsonl").write_text("")
    readable = shutil.copytree(journaled, tmp_path / "readable")
    for folder in (tmp_path, tmp_path / "runs"):
        folder.chmod(0o755)
    root = os.geteuid() == 0
    setpriv = shutil.which("setpriv")  # util-linux's: runs a command as another user, capabilities dropped
    if root and setpriv is None:
        pytest.skip("running as root without setpriv: nothing here can make a folder unreadable")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"] if root else []
    journaled.chmod(0o700 if root else 0o000)
    env = dict(os.environ, HOME=str(tmp_path), DEW_TRACEBACK="")
    try:
        for argv in (["report", str(journaled), "--out", str(tmp_path / "page")], ["diff", str(journaled), str(readable)],
                     ["audit", str(journaled)], ["rescore", str(journaled), "reward=length"]):
            done = subprocess.run([*as_nobody, sys.executable, "-m", "dew.cli", *argv], capture_output=True,
                                  text=True, env=env, cwd=tmp_path, timeout=120)
            err = done.stderr.strip()
            assert done.returncode == 2 and err.startswith(f"dew {argv[0]}: PermissionError: [Errno 13] Permission "
                                                           f"denied: "), (argv, err)
            assert "Traceback" not in err and str(journaled) in err
    finally:
        journaled.chmod(0o755)


def test_a_kept_step_or_a_tracker_folder_given_for_the_run_names_the_run_folder(tmp_path, capsys, monkeypatch):
    """Each command said the folder held no run.json, or to give "the folder dew train printed",
    without naming the run the step sits in or the checkpoint folder the tracker's journal records."""
    import json

    from dew.cli import main
    from dew.recipes.config import RunConfig

    monkeypatch.chdir(tmp_path)
    recipe = RunConfig.load("tiny-lm", ["trainer.checkpoint_dir=runs/ckpt", "trackers.0.directory=runs/logs"])
    recipe.save(tmp_path / "runs" / "ckpt")
    (tmp_path / "runs" / "ckpt" / "6").mkdir()
    (tmp_path / "runs" / "logs").mkdir()
    started = {"step": 0, "type": "run_started", "record": {"config": recipe.recorded()}}
    (tmp_path / "runs" / "logs" / "records.jsonl").write_text(json.dumps(started) + "\n")
    step = "runs/ckpt/6 is step 6 kept inside the run runs/ckpt: give that folder (with --step 6"
    for command in (["eval", "runs/ckpt/6"], ["generate", "runs/ckpt/6", "x"], ["export", "runs/ckpt/6", "exported"],
                    ["audit", "runs/ckpt/6"], ["diff", "runs/ckpt/6", "runs/ckpt"], ["report", "runs/ckpt/6"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert step in err and "Traceback" not in err, (command, err)
    logs = "runs/logs is where the run's tracker wrote; its checkpoints and run.json are in runs/ckpt: give that"
    for command in (["eval", "runs/logs"], ["audit", "runs/logs"], ["diff", "runs/logs", "runs/ckpt"]):
        assert main(command) == 2, command
        assert logs in capsys.readouterr().err, command
    # a folder that is no run and points nowhere says only what it lacks
    (tmp_path / "empty").mkdir()
    assert main(["eval", "empty"]) == 2
    assert "give that folder" not in capsys.readouterr().err


def test_report_says_where_it_read_a_journal_kept_outside_the_run_folder(tmp_path, capsys, monkeypatch):
    """A folder holding a copy of another run's run.json was reported as that run (its journal followed
    through the recipe's tracker directory), titled with the other folder, without a word."""
    import shutil

    from dew.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", "model.num_layers=1", "model.emb_features=32", "model.mlp_features=64",
                 "model.num_heads=2", "model.max_seq_len=32", "objective.seq_len=16", "objective.preview_tokens=8",
                 "data.length=16", "data.batch=4", "data.files={stdlib}/abc.py", "trainer.steps=2",
                 "trainer.checkpoint_dir=runs/a", "trackers.0.directory=runs/a"]) == 0
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "runs/a/run.json", tmp_path / "copy/run.json")
    capsys.readouterr()
    assert main(["report", "runs/a"]) == 0 and "was read from" not in capsys.readouterr().err
    assert main(["report", "copy"]) == 0
    assert (f"dew report: the journal of copy was read from {tmp_path / 'runs/a'}, where its recipe's local "
            "tracker wrote it.") in capsys.readouterr().err


def test_generate_and_export_refuse_to_write_into_a_run_or_its_step(tmp_path, capsys, monkeypatch):
    """--out runs/a/2 wrote samples.txt inside a committed checkpoint step, --out runs/a beside the run's
    journal; dew export refused both, dew generate wrote there."""
    from dew.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", "model.num_layers=1", "model.emb_features=32", "model.mlp_features=64",
                 "model.num_heads=2", "model.max_seq_len=32", "objective.seq_len=16", "objective.preview_tokens=8",
                 "data.length=16", "data.batch=4", "data.files={stdlib}/abc.py", "trainer.steps=2",
                 "trainer.checkpoint_dir=runs/a", "trackers=[]"]) == 0
    capsys.readouterr()
    for out, said in (("runs/a/2", "--out is step 2 of the run runs/a"), ("runs/a", "--out is the run folder runs/a")):
        assert main(["generate", "runs/a", "def", "--max-new-tokens", "2", "--out", out]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / out / "samples.txt").exists()
    assert main(["generate", "runs/a", "def", "--max-new-tokens", "2", "--out", "samples"]) == 0
    assert (tmp_path / "samples/samples.txt").is_file()
    # dew export refused a step for holding "files dew did not write", and --force wrote the export among them.
    capsys.readouterr()
    for force in ([], ["--force"]):
        assert main(["export", "runs/a", "runs/a/2", *force]) == 2
        assert f"OUT is step 2 of the run {tmp_path / 'runs/a'}" in capsys.readouterr().err
    assert not (tmp_path / "runs/a/2/config.json").exists()
