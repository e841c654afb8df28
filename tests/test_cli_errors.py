"""`dew train` answers an error dew names with one message and exit status 2, not a traceback
(which stays one flag away, with Python's status 1), and refuses token ids past the model's
vocabulary before step 1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEW = Path(sys.executable).with_name("dew")


def _train(tmp_path, *overrides, env=None):
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    environment.pop("XLA_FLAGS", None)
    return subprocess.run(
        [str(DEW), "train", "tiny-lm", "trainer.steps=2", "data.files={stdlib}/a*.py",
         f"trackers.0.directory={tmp_path}/runs", *overrides],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment)


def test_token_ids_past_the_vocabulary_are_refused_before_step_one(tmp_path):
    result = _train(tmp_path, "model.vocab_size=200")
    assert result.returncode == 2, result.stdout + result.stderr
    first, *rest = result.stderr.strip().splitlines()
    assert first.startswith("dew train: VocabularyMismatchError: The tokenizer has 257 ids but the "
                            "model's vocab_size is 200")
    assert "vocab_size >= 257" in first and "Traceback" not in result.stderr
    assert rest == ["  Nothing was kept: the run failed before it wrote anything.",
                    "  (run with --traceback or DEW_TRACEBACK=1 to see where it was raised)"]
    assert "compiling the step" not in result.stdout  # refused before anything compiled

    shown = _train(tmp_path, "model.vocab_size=200", env={"DEW_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    *_, raised, note = shown.stderr.strip().splitlines()  # Python prints the error's notes after it
    assert "VocabularyMismatchError" in raised and note == "Nothing was kept: the run failed before it wrote anything."


def test_a_mesh_that_does_not_fit_is_one_message(tmp_path):
    result = _train(tmp_path, "trainer.mesh.fsdp=3")  # one CPU device
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("dew train: MeshSizeError: ")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 4


def test_an_unwritable_tracker_directory_is_refused_before_step_one(tmp_path):
    # TensorBoard opens its event file with the first value: without a check before step 1 the
    # run trained to its first log (here its last step) and only then failed.
    (tmp_path / "a-file").write_text("in the way")
    result = _train(tmp_path, "trackers.0.name=tensorboard", "trackers.0.directory=a-file/run",
                    "trainer.log_every=2", "trainer.eval_every=null")
    assert result.returncode == 2, result.stdout + result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith(f"dew train: TrackerWriteError: The tracker directory {tmp_path}/a-file/run "
                            "cannot be written (NotADirectoryError"), result.stderr
    assert "trackers.0.directory" in result.stderr and "Traceback" not in result.stderr
    assert "compiling the step" not in result.stdout and "step 2:" not in result.stdout  # nothing trained
    assert (tmp_path / "a-file").read_text() == "in the way"
    assert not (tmp_path / "runs").exists(), sorted(tmp_path.rglob("*"))  # no run folder left behind


@pytest.mark.slow
def test_a_full_disk_is_one_message_without_orbaxs_thread_tracebacks(tmp_path):
    """Orbax's writer threads log the failed write with tracebacks, and asyncio raises "Event loop
    is closed" behind them; dew train shows only its own line naming the step (issue 37)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        result = _train(tmp_path, "trainer.steps=4", "trainer.checkpoint_every=2",
                        f"trainer.checkpoint_dir={disk}/run")
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"dew train: CheckpointWriteError: Saving checkpoint step 2 into {disk}/run "
                               "failed"), lines[:3]
    assert "RESOURCE_EXHAUSTED" in lines[0] or "No space left on device" in lines[0], lines[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 3 and lines[-1].startswith("  (run with --traceback"), lines


def test_the_checkpoint_writers_leftovers_stay_off_the_console_after_dews_own_line():
    """A failed array write leaves the other fragment writes JAX's serialization gathered: asyncio
    logs each as a future whose exception was never retrieved (its traceback in JAX's
    array_serialization, not Orbax), and Python names the unawaited coroutines at exit. Seen on
    a 200 KB disk, at random (about one run in three), so the two are made here."""
    import logging
    import warnings

    from dew.cli import _FromWriters, _writers_quiet

    where = os.path.join(os.sep, "site-packages", "jax", "experimental", "array_serialization", "serialization.py")
    code = compile("raise ValueError('RESOURCE_EXHAUSTED: No space left on device')", where, "exec")
    try:
        exec(code)
    except ValueError as error:
        failed = error
    record = logging.LogRecord("asyncio", logging.ERROR, os.path.join("asyncio", "base_events.py"), 1,
                               "Future exception was never retrieved", None,
                               (ValueError, failed, failed.__traceback__))
    assert not _FromWriters().filter(record)
    elsewhere = compile("raise ValueError('a user callback failed')", "user_code.py", "exec")
    try:
        exec(elsewhere)
    except ValueError as error:
        other = error
    record.exc_info = (ValueError, other, other.__traceback__)
    assert _FromWriters().filter(record)  # a failure of anything else is still shown
    # TensorStore's own error, raised from its C++ (no Python frame of the writers): named by its driver
    native = ValueError('RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing local file '
                        '"/run/60/state/array_metadatas/process_0": No space left on device')
    record.exc_info = (ValueError, native, None)
    assert not _FromWriters().filter(record)
    # ... and its OCDBT database's, one per array a failed save had under way (3 to 24 blocks seen
    # after dew's line on a nearly full disk, one run in six)
    database = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.1.2.count/0" in OCDBT database at local '
                          'file "/run/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed '
                          'writing: "/run/6.orbax-checkpoint-tmp/d/20ab": No space left on device')
    record.exc_info = (ValueError, database, None)
    assert not _FromWriters().filter(record)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        _writers_quiet()
        warnings.warn("coroutine 'async_serialize_from_host.<locals>.write_fragment' was never awaited",
                      RuntimeWarning, stacklevel=1)
        warnings.warn("coroutine 'fetch' was never awaited", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["coroutine 'fetch' was never awaited"]


def test_a_reader_that_closes_the_pipe_ends_the_command_without_a_traceback():
    """`dew recipes | head -1`: the reader went away before dew wrote; dew stops quietly with the
    status a shell reports for a pipe's writer (128 + SIGPIPE)."""
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([str(DEW), "recipes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=environment)
    process.stdout.close()  # before the interpreter has even imported dew
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err.decode()
    assert not err.strip(), err.decode()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_output_a_full_disk_refuses_is_said_in_one_line_not_a_traceback(tmp_path, unbuffered):
    """`dew recipes > notes.txt` on a full disk (/dev/full), and into a file past the size limit
    (ulimit -f): the failed print ended in an OSError's traceback with status 1, even where the
    command's own files were written whole; output still buffered at the end failed at exit."""
    import resource

    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "wb") as full:
        result = subprocess.run([str(DEW), "recipes"], stdout=full, stderr=subprocess.PIPE, text=True,
                                env=environment, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[0] == (
        "dew recipes: StdoutWriteError: The command's output could not be written to stdout (No space left "
        "on device): free space on the disk it goes to (or raise the file-size limit, ulimit -f), or send it "
        "elsewhere.")
    assert "Traceback" not in result.stderr

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    out = tmp_path / "recipes.txt"
    with open(out, "wb") as file:
        result = subprocess.run([str(DEW), "recipes"], stdout=file, stderr=subprocess.PIPE, text=True,
                                env=environment, timeout=120, preexec_fn=limited)
    assert result.returncode == 2, result.stderr
    assert "could not be written to stdout (File too large)" in result.stderr and "Traceback" not in result.stderr
    listing = subprocess.run([str(DEW), "recipes"], capture_output=True, env=environment, timeout=120).stdout
    assert len(listing) > 1024 and out.read_bytes() == listing[:len(out.read_bytes())]  # what fitted, in order


def test_jax_s_note_about_hidden_frames_is_left_out_of_dew_s_one_line():
    """An error raised under a JAX trace carries JAX's note about the frames it hid from the
    traceback; dew's one line shows no traceback, so the note would only be noise beside dew's own."""
    from dew.cli import refusal

    error = ValueError("the batch has no 'tokens'")
    error.add_note("--------------------\nFor simplicity, JAX has removed its internal frames from the "
                   "traceback of the following exception. Set JAX_TRACEBACK_FILTERING=off to include these.")
    error.add_note("The recipe's data.files names it.")
    assert refusal("train", error).splitlines() == [
        "dew train: ValueError: the batch has no 'tokens'", "  The recipe's data.files names it.",
        "  (run with --traceback or DEW_TRACEBACK=1 to see where it was raised)"]
    # Grain's note about its data pipeline's frames names a flag dew has no option for.
    error = ValueError("record 3 is damaged")
    error.add_note("--------------------\nFor simplicity, Grain has removed its internal frames from the "
                   "traceback of the following exception. Set --grain_py_traceback_filtering=off to "
                   "include these.")
    assert refusal("train", error).splitlines() == [
        "dew train: ValueError: record 3 is damaged",
        "  (run with --traceback or DEW_TRACEBACK=1 to see where it was raised)"]


SIGTERM_AT_START = """
import dataclasses, json, os, signal, sys
sys.path.insert(0, sys.argv[2])
from test_recipe_config import RECIPE, Repeated
from dew import registry
from dew.cli import main


@dataclasses.dataclass(frozen=True)
class Terminating(Repeated):
    def load(self, batch):
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, as the data starts
        return super().load(batch)


recipe = {**RECIPE, "data": {**RECIPE["data"], "name": "terminating"}}
with open("recipe.json", "w") as out:
    json.dump(recipe, out)
with registry.datasets.temporary("terminating", Terminating):
    sys.exit(main(["train", "recipe.json", "trainer.checkpoint_dir=runs/a"]))
"""


def test_a_sigterm_before_the_training_loop_is_one_line_and_leaves_no_half_run(tmp_path):
    """Outside the loop's own watch a SIGTERM killed dew train without a word, leaving a folder
    with no run.json (which --resume then refused) and, at times, the writer's lease."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_AT_START, "recipe.json", str(Path(__file__).parent)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "dew train: stopped (SIGTERM)", done.stderr
    assert not (tmp_path / "runs").exists()  # the folder it had made kept nothing: removed


SIGTERM_AS_IT_RESUMES = """
import dataclasses, json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from test_recipe_config import RECIPE, Repeated
from dew import registry
from dew.cli import main


@dataclasses.dataclass(frozen=True)
class Terminating(Repeated):
    def load(self, batch):
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, as the resumed run's data starts
        return super().load(batch)


with open("recipe.json", "w") as out:
    json.dump(RECIPE, out)
with registry.datasets.temporary("repeated", Repeated):
    assert main(["train", "recipe.json", "trainer.checkpoint_dir=runs/a", "trainer.checkpoint_every=2"]) == 0
with registry.datasets.temporary("repeated", Terminating):
    sys.exit(main(["train", "--resume", "runs/a", "trainer.steps=6"]))
"""


def test_a_sigterm_as_a_resumed_run_starts_says_how_to_resume_it(tmp_path):
    """A stop before the loop's own watch (a --resume restoring its step) said only "stopped (SIGTERM)",
    where the run had kept steps: the command that goes on from them was not printed."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_AS_IT_RESUMES, str(Path(__file__).parent)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-2:] == [
        "dew train: stopped (SIGTERM)",
        "  The run is in runs/a (its newest checkpoint is step 3); resume it with: dew train --resume runs/a"]
    assert sorted(p.name for p in (tmp_path / "runs" / "a").iterdir() if p.name.isdigit()) == ["2", "3"]


STOPPING_COMMAND = """
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from dew import cli

cli.COMMANDS["stopping"] = ("stopping_command", "a command a stop lands in")
sys.argv = ["dew", "stopping", sys.argv[2]]
cli.console()
"""

STOPPING_MODULE = """
import os, signal, threading, time

def add_arguments(parser):
    parser.add_argument("case")

class Dropped:  # a callback whose exceptions Python discards, as JAX's garbage-collection callback
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # the handler runs in here, and what it raises is "ignored"
            pass

def run(args):
    if args.case == "compiling":
        import jax, jax.numpy as jnp

        def long(x):
            for i in range(400):  # about 6 s of XLA compiling on a 2-core machine
                x = jnp.sin(x) @ x + i
            return x

        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        jax.jit(long)(jnp.ones((64, 64))).block_until_ready()
    elif args.case == "discarded":
        Dropped()
        time.sleep(20)  # a stop delivered again arrives here
    elif args.case == "discarded-as-it-ends":
        Dropped()  # the command's work ends before the stop is sent again
    else:  # "after-it-ended": the stop comes while the interpreter ends (it waits for the timer's thread)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    print("done")
    return 0
"""


@pytest.mark.parametrize(("case", "status", "line"), [
    ("compiling", 130, "dew stopping: interrupted (Ctrl-C)"),
    ("discarded", 143, "dew stopping: stopped (SIGTERM)"),
    ("discarded-as-it-ends", 143, "dew stopping: stopped (SIGTERM) as it finished; its work was done, as it says above"),
    ("after-it-ended", 143, "dew: stopped (SIGTERM) as it ended; what it printed above stands")])
def test_a_stop_outside_the_loop_ends_the_command_with_its_status(tmp_path, case, status, line):
    """A Ctrl-C while XLA compiled (dew generate, eval, export at their first program) printed dew's
    line, then the interpreter's teardown freed JAX's backend under the compilation still running on
    its own thread: SIGSEGV, status 139. A SIGTERM that landed in a callback whose exceptions Python
    discards (JAX's garbage collection) printed "Exception ignored ... _Terminated" and the command
    went on to exit 0; it is now sent again and stops the command. Where the command's work ended
    before it was sent again, the command exited 0 as if no stop had come; and a SIGTERM as the
    process ended, after dew export had printed its success, killed it without a word (status -15)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="dew")
    assert script.value == "dew.cli:console"  # the executable ends as this test's process does
    (tmp_path / "stopping_command.py").write_text(STOPPING_MODULE)
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environment.pop("DEW_TRACEBACK", None)
    done = subprocess.run([sys.executable, "-c", STOPPING_COMMAND, str(tmp_path), case], capture_output=True,
                          text=True, timeout=120, env=environment)
    assert done.returncode == status, done.stderr[-3000:]
    assert done.stderr.strip() == line, done.stderr[-3000:]
    assert done.stdout == ("" if case in ("compiling", "discarded") else "done\n")


def _loaded(pid: int, package: str) -> bool:
    """Whether the process has mapped a shared library of the installed package (it is importing it)."""
    try:
        return f"site-packages/{package}/" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("package", ["numpy", "jaxlib"])
def test_a_ctrl_c_while_the_command_is_still_importing_is_one_line(tmp_path, package):
    """Ctrl-C in the first second of `dew train` lands in an import of the command's modules, before
    the command's own handling: it printed a page of import traceback and exited 1. (Landing in a
    callback of JAX's garbage collection instead, it is discarded by Python and the run stops at its
    first step: dew-core/tests/test_preemption.py shows that case; either way, status 130, no traceback.)
    Sent the moment the package's native module is mapped, it lands in that module's initialization,
    which calls back into Python: raised there, numpy's C code printed it as a traceback and jaxlib's
    crashed (SIGSEGV); it now waits for the import to finish."""
    import signal
    import time

    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environment.pop("DEW_TRACEBACK", None)
    process = subprocess.Popen([str(DEW), "train", "tiny-lm", "trainer.steps=2", f"trainer.checkpoint_dir={tmp_path}/run"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=environment)
    # Inside the command's imports: numpy and jaxlib are first loaded there (the entry point's own
    # imports hold neither). A fixed wait could land before the command's handling on a loaded
    # machine, where the signal kills the interpreter itself.
    began = time.monotonic()
    while not _loaded(process.pid, package) and process.poll() is None and time.monotonic() - began < 60:
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err, err
    if err == "dew train: interrupted (Ctrl-C)\n":  # raised in an import, as it almost always is
        assert not (tmp_path / "run").exists()
    else:  # discarded by Python inside a garbage-collection callback: the loop stopped at the next step
        # (the first, or on a busy machine the second and last, where the Ctrl-C came after the first)
        stopped = re.fullmatch(r"dew train: interrupted \(Ctrl-C\) at step ([12]); its checkpoint, data position "
                               r"and journal are in run\. Resume with: dew train --resume run",
                               err.strip().splitlines()[-1])
        assert stopped, err
        assert (tmp_path / "run" / stopped.group(1)).is_dir()


def test_a_command_run_from_a_removed_directory_says_so_in_one_line(tmp_path):
    """Every relative path starts from the working directory: removed under the shell, the commands
    said '[Errno 2] No such file or directory' naming nothing, or printed a traceback."""
    gone = tmp_path / "gone"
    gone.mkdir()
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for command in (["generate", str(tmp_path / "run"), "x"], ["train", "tiny-lm", "trainer.steps=1"]):
        done = subprocess.run(["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" "$@"', str(DEW), *command],
                              capture_output=True, text=True, timeout=120, env=environment)
        gone.mkdir()
        assert done.returncode == 2, done.stderr
        assert done.stderr == ("dew: the current directory was removed (deleted while this shell was in it); cd to "
                               "an existing one and run the command again.\n"), done.stderr


def test_a_pool_process_whose_save_lost_its_peer_exits_75_without_blaming_the_disk(monkeypatch, capsys):
    """A rank whose peer was killed while its checkpoint's save gathered across the pool printed the
    save's CheckpointWriteError, advising to free disk space. Where a kill -9 lands cannot be chosen,
    so the pool and the failed save are stood in for, with the message Gloo gave."""
    import dew.cli as cli
    import dew.cli.train
    from dew.checkpoints.errors import CheckpointWriteError

    lost = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                      "[127.0.0.1]:29068: Connection reset by peer")

    def save_fails(args):
        raise CheckpointWriteError(10, "runs/pool", lost) from lost  # as the manager raises it

    def ended(status):
        raise SystemExit(status)

    monkeypatch.setattr(dew.cli.train, "run", save_fails)
    monkeypatch.setattr(cli, "_in_pool", lambda: True)
    monkeypatch.setattr(cli, "_end_now", ended)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "tiny-lm"])
    err = capsys.readouterr().err
    assert stopped.value.code == 75, err
    assert err.startswith("dew: another process of the pool ended, so this one cannot go on") and "disk" not in err, err
