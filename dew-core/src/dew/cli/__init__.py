"""The ``dew`` command. Each subcommand lives in its own module, imported only
when that subcommand runs, so ``dew --help`` stays fast; ``main`` dispatches
to it and is the one place a command's errors become its exit status."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import logging
    from collections.abc import Callable
    from sys import UnraisableHookArgs

__all__ = ["INTERRUPTED", "REFUSED", "TRACEBACK", "console", "error_notes", "is_dews", "main", "refusal"]

TRACEBACK = "DEW_TRACEBACK"  # set to 1 to see the traceback of an error dew names
TRACEBACK_HELP = f"show the whole traceback of an error dew names (or set {TRACEBACK}=1)"
REFUSED = 2  # dew named what is wrong: a recipe, a missing prerequisite, bad input
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it
BROKEN_PIPE = 141  # the reader of stdout closed it (128 + SIGPIPE), as a shell reports a pipe's writer
TERMINATED = 143  # SIGTERM (128 + 15) outside a training loop, whose own watch saves the step first

# subcommand -> (module, one-line help). A module defines
# add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "train": ("dew.cli.train", "train from a recipe file, with key=value overrides"),
    "recipes": ("dew.cli.recipes", "list the recipes dew ships"),
    "report": ("dew.cli.report", "render local runs' journals into one page of charts"),
    "describe": ("dew.cli.describe", "a registered component's fields, types and defaults"),
    "generate": ("dew.cli.generate", "samples from a trained run or an exported model: texts, images, clips"),
    "eval": ("dew.cli.evaluate", "a kept step's validation metrics, as its objective defines them"),
    "export": ("dew.cli.export", "write a kept step's model in its published format (or dew's own)"),
    "embed": ("dew.cli.embed", "vectors for images from a representation run's encoder"),
    "launch": ("dew.cli.launch", "train a recipe as a process pool: local, under srun, or on Kubernetes"),
    "plan": ("dew.cli.plan", "compile a recipe's step for a mesh on fake devices: bytes, collectives, FLOPs"),
    "diff": ("dew.cli.diff", "where two runs part: kept states, logged losses and recipes compared"),
    "audit": ("dew.cli.audit", "prove from its ledger which records a run consumed, step by step"),
    "rescore": ("dew.cli.rescore", "score a run's journaled completions with another reward, without the model"),
    "check-plugin": ("dew.cli.check_plugin", "run dew's conformance kits on an installed distribution's components"),
}


def version() -> str:
    """The dew distributions installed, with their versions (installed metadata only).

    >>> version().startswith("dew-core ")
    True
    """
    from dew.versions import DISTRIBUTIONS, installed

    found = installed()
    return ", ".join(f"{name} {found[name]}" for name in DISTRIBUTIONS if name in found) or \
        "dew (no installed distribution found)"


class _Version(argparse.Action):
    """--version, computed only when asked (reading metadata is not free)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the installed dew versions")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version())
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dew`` command with argv; return its exit status (see docs/cli.md, "Exit status").

    Every command's errors end here: an error of dew's own says what is wrong,
    in which file and what to do, so it is printed as ``dew COMMAND: ...``
    and the status is 2; its traceback is one flag away (``--traceback`` or
    ``DEW_TRACEBACK=1``). Anything else is a bug and keeps its traceback. A
    reader of stdout that went away (``dew recipes | head -1``, ``dew --help |
    head``) ends the command quietly with 141.
    """
    from dew import interrupts

    _Unwound.by_stop = False
    interrupts.hold()  # every Ctrl-C noted from here: one Python discards still stops a training loop
    if not os.environ.get(TRACEBACK) and not isinstance(sys.unraisablehook, _QuietClosedLoop):
        sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)  # ... without its "Exception ignored"
    try:
        return _guarded(argv)
    finally:
        interrupts.let_go()


def console() -> NoReturn:
    """The installed ``dew`` executable: main() on the process's arguments, then its exit.

    A stop raised where the main thread stood can leave one of JAX's compilations
    running on a thread of its own; the interpreter's teardown (JAX's exit
    handler frees the backend being compiled for) then crashed the process
    with SIGSEGV after dew's one line. A command that a stop unwound therefore
    ends at once with its status, as a failed pool's process does; its files
    were closed as it unwound.
    """
    from dew.cli.output import guard_stdout

    guard_stdout()  # a failed write of the command's output is said in one line, not a traceback
    _Stop.executable = True
    status = main()
    for signum in (signal.SIGINT, signal.SIGTERM):  # the command is done: a stop now ends the exit, said
        signal.signal(signum, _late)
    if _Unwound.by_stop and not _in_pool():
        import logging

        logging.shutdown()
        _end_now(status)
    sys.exit(status)


class _Unwound:
    by_stop = False  # the last main() ended by a Ctrl-C or SIGTERM raised inside its command


def _guarded(argv: Sequence[str] | None) -> int:
    """main's body: the command, its errors turned into one line and an exit status."""
    try:
        os.getcwd()
    except FileNotFoundError:  # every relative path, and several of dew's notes, start from here
        print("dew: the current directory was removed (deleted while this shell was in it); cd to an existing "
              "one and run the command again.", file=sys.stderr, flush=True)
        return REFUSED
    try:
        status = _main(argv)
    except KeyboardInterrupt:  # while a command's modules were still being imported
        if os.environ.get(TRACEBACK):
            raise
        return _interrupted(argv)
    except BrokenPipeError:
        # Nothing is left to say to the reader; stdout goes to devnull so the interpreter's last
        # flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except Exception as error:
        from dew import interrupts

        if interrupts.pending() and not os.environ.get(TRACEBACK):  # a Ctrl-C a library turned into its own
            return _interrupted(argv)  # error (numpy's import wraps it in an ImportError)
        if not _in_pool():
            raise
        if _peer_lost(error):  # not this process's failure: the one that failed first says what it was
            lost: BaseException = error
            while lost.__cause__ is not None and _peer_lost(lost.__cause__):  # the collective's own words,
                lost = lost.__cause__  # not the advice of dew's error around it (a save's)
            first = str(lost).strip().splitlines()[0] if str(lost).strip() else type(lost).__name__
            print(f"dew: another process of the pool ended, so this one cannot go on (a collective "
                  f"failed: {first}).", file=sys.stderr, flush=True)
            from dew.training.runtime.launcher import PEER_LOST_STATUS

            _end_now(PEER_LOST_STATUS)  # dew launch reports the status of the one that ended first
        traceback.print_exc()  # a bug: its traceback, then the pool is left as below
        _end_now(1)
    if status not in (0, INTERRUPTED, TERMINATED) and _in_pool():
        _end_now(status)
    return status


def _interrupted(argv: Sequence[str] | None) -> int:
    """A Ctrl-C before the command's own handling: one line naming the command, status 130."""
    _Unwound.by_stop = True
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    print(f"dew{' ' + chosen if chosen in COMMANDS else ''}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    return INTERRUPTED


def _in_pool() -> bool:
    """Whether this process joined a pool of several (jax.distributed), without importing JAX."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def _peer_lost(error: BaseException) -> bool:
    """Whether error is a collective that failed because another process of the pool is gone."""
    text = str(error)
    return "Gloo" in text and any(sign in text for sign in _PEER_GONE)


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Read error")


def _end_now(status: int) -> NoReturn:
    """End the process now, with status, without the interpreter's teardown: JAX's exit handler
    would free a backend a compilation abandoned by a stop still runs on (see console), and in a
    pool's process that failed it would shut the distributed client down, which waits for every
    process: the others, inside a step's collective that this one never joins, never arrive, and
    the pool would hang instead of failing (dew launch kills the other ranks once one fails)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _meant(extra: Sequence[str], command: argparse.ArgumentParser, takes_overrides: bool) -> str:
    """What the first unknown option most likely meant: a recipe field written as a flag
    (``--steps 5``: ``trainer.steps=5``), or an option of the command spelt otherwise."""
    import difflib

    flags = [item for item in extra if item.startswith("--")]
    if not flags:
        return ""
    flag, _, value = flags[0].partition("=")
    following = extra[extra.index(flags[0]) + 1:]
    value = value or (following[0] if following and not following[0].startswith("-") else "VALUE")
    if takes_overrides:
        from dew.recipes.config import RunConfig
        from dew.recipes.errors import field_path

        path = field_path(RunConfig, flag.lstrip("-").replace("-", "_"))
        if path is not None:
            return f" (a recipe's fields are key=value words: {path}={value})"
    options = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, options, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _main(argv: Sequence[str] | None) -> int:
    parser = _Parser(prog="dew", description="dew trains JAX models.")
    parser.add_argument("--version", action=_Version)
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, text) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            # SUPPRESS: `dew --traceback train ...` is not undone by the command's own default
            command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                                 help=TRACEBACK_HELP)
            command.set_defaults(_run=module.run)
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a trailing key=value list at the first option, so overrides
    # written after one (`dew plan tiny-lm --devices 2 trainer.steps=4`) come back here.
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if isinstance(getattr(args, "overrides", None), list) and overrides:  # only commands that take overrides
        args.overrides.extend(overrides)
        extra = [item for item in extra if item not in overrides]
    # The same for a command's trailing inputs (`dew generate RUN --step 3 "1+1="`), where it names them.
    trailing = getattr(args, "_trailing", None)
    if trailing is not None and extra:
        getattr(args, trailing).extend(item for item in extra if not item.startswith("-"))
        extra = [item for item in extra if item.startswith("-")]
    if extra:
        command = sub.choices[args.command] if args.command in sub.choices else parser
        command.error(f"unrecognized arguments: {' '.join(extra)}"
                      f"{_meant(extra, command, isinstance(getattr(args, 'overrides', None), list))}")
    if not getattr(args, "_run", None):  # argparse sets it only when a command was chosen
        parser.print_help()
        return 0 if args.command is None else 2
    shown = bool(args.traceback or os.environ.get(TRACEBACK))
    if not shown:
        _writers_quiet()
    try:
        with _warnings_as_lines(args.command), _terminated_as_stop():
            status = _command(args, shown)
    except _Terminated as stop:  # in the moment between the command's own handling and the handler's reset
        status = _said_stopped(args.command, stop, "stopped (SIGTERM)", TERMINATED)
    return _stopped_as_it_ended(args.command, status)


def _command(args: argparse.Namespace, shown: bool) -> int:
    """The chosen command run, its errors and stops turned into lines and an exit status."""
    try:
        status = int(args._run(args) or 0)
        sys.stdout.flush()  # output still buffered fails here, said as the command's, not at exit
        return status
    except KeyboardInterrupt as stop:
        if shown:
            raise
        return _said_stopped(args.command, stop, "interrupted (Ctrl-C)", INTERRUPTED)
    except _Terminated as stop:
        return _said_stopped(args.command, stop, "stopped (SIGTERM)", TERMINATED)
    except Exception as error:
        # A file or folder this user may not read or write, or that is not there (a plugin's reader
        # opening a recipe's path), is the command's input, not a bug.
        if shown or not (is_dews(error) or isinstance(error, _INPUT_ERRORS)):
            raise
        if _in_pool() and _peer_lost(error):  # dew's error around a collective a lost peer failed
            raise  # (a checkpoint's save): said as such, below, not blamed on the disk
        print(refusal(args.command, error), file=sys.stderr, flush=True)
        return REFUSED


def _said_stopped(command: str, stop: BaseException, what: str, status: int) -> int:
    """A Ctrl-C or SIGTERM that stopped command, said with what it noted (where a run it stopped is
    kept); status is the stop's."""
    print("\n".join([f"dew {command}: {what}", *error_notes(stop)]), file=sys.stderr, flush=True)
    _Unwound.by_stop = True
    return status


def _stopped_as_it_ended(command: str, status: int) -> int:
    """status, unless a stop came that the command never met: a SIGTERM or Ctrl-C Python could not
    raise where it landed (a garbage-collection callback), not sent again before the command's work
    was done. Its work is whole; the status says the stop came, as the line does."""
    from dew import interrupts

    if status != 0 or os.environ.get(interrupts.RANK) == "1":
        return status
    if _Stop.requested or interrupts.pending():
        which, status = ("SIGTERM", TERMINATED) if _Stop.requested else ("Ctrl-C", INTERRUPTED)
        print(f"dew {command}: stopped ({which}) as it finished; its work was done, as it says above",
              file=sys.stderr, flush=True)
    return status


_INPUT_ERRORS = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


class _Stop:
    """What the SIGTERM handling of one command keeps: whether a SIGTERM came (requested: raised, or
    discarded where Python could not raise it), the timer sending a discarded one again, and whether
    the process ends with the command (the dew executable; a test calls main in its own process)."""

    requested = False
    again: threading.Timer | None = None
    executable = False


def _stop(signum: int, frame: object) -> None:
    _Stop.requested = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise _Terminated


def _late(signum: int, frame: object) -> None:
    """A stop once the command is done (the dew executable only): the process ends now with the stop's
    status, and says so, rather than being killed without a word after its success was printed."""
    which = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        print(f"dew: stopped ({which}) as it ended; what it printed above stands", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _stop_again() -> None:
    """A SIGTERM raised where Python discards it (a callback of JAX's garbage collection, which
    printed it as "Exception ignored" and the command went on to exit 0): sent again in a moment,
    when the main thread stands in ordinary code."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, _stop):
        return  # a training loop's own watch has SIGTERM now
    signal.signal(signal.SIGTERM, _stop)
    again = _Stop.again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM))
    again.daemon = True
    again.start()


class _Parser(argparse.ArgumentParser):
    """argparse, whose refusal of an option (``--steps 0``) is one line as dew's others are, naming
    where the options are listed, rather than the usage block and then the line."""

    def error(self, message: str) -> NoReturn:
        self.exit(REFUSED, f"{self.prog}: {message} ({self.prog} --help lists its options)\n")


class _Terminated(BaseException):  # a stop, named as KeyboardInterrupt is, not an error
    """SIGTERM arrived outside a training loop: unwound like Ctrl-C, so what is half written (an
    export's fresh folder, a run folder that kept nothing, the writer's lease) is cleaned away."""


@contextlib.contextmanager
def _terminated_as_stop() -> Iterator[None]:
    """Within: a first SIGTERM raises _Terminated in the main thread (a training loop's own watch
    takes it over while it runs, and a pool's JAX service once the pool forms); a second kills."""
    from dew import interrupts

    if threading.current_thread() is not threading.main_thread() or os.environ.get(interrupts.RANK) == "1":
        yield  # a pool's rank holds a SIGTERM until the pool forms (dew.interrupts)
        return

    _Stop.requested = False
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _late if _Stop.executable else previous)
        if _Stop.again is not None:  # a discarded SIGTERM's second sending: the command has ended
            _Stop.again.cancel()
            _Stop.again = None


def is_dews(error: BaseException) -> bool:
    """Whether error is one of dew's own, whose message says what went wrong and what to do:
    an instance of the root ``dew.errors.DewError``, or a class a ``dew`` module defines."""
    from dew.errors import DewError

    return isinstance(error, DewError) or (
        isinstance(error, Exception) and type(error).__module__.split(".")[0] == "dew")


def refusal(command: str, error: BaseException) -> str:
    """error as a dew command prints it: its class, its message, its notes, and how to see more.

    A recipe's problems are printed as they are (they name the file and each
    path in it).

    >>> print(refusal("train", ValueError("the batch has no 'tokens'")))
    dew train: ValueError: the batch has no 'tokens'
      (run with --traceback or DEW_TRACEBACK=1 to see where it was raised)
    """
    from dew.recipes.errors import RecipeError

    notes = error_notes(error)
    if isinstance(error, RecipeError):
        return "\n".join([f"dew {command}: {error}", *notes])
    return "\n".join([f"dew {command}: {type(error).__name__}: {error}", *notes,
                      f"  (run with --traceback or {TRACEBACK}=1 to see where it was raised)"])


def error_notes(error: BaseException) -> list[str]:
    """The notes dew added to error (where its path came from, what to do), each a line indented
    under the message; JAX's note about the frames it hid is left out."""
    return [f"  {note}" for note in getattr(error, "__notes__", ())  # set by add_note only
            if not _hidden_frames_note(note)]


def _hidden_frames_note(note: str) -> bool:
    """Whether note is the one JAX (under a trace) or Grain (in a data pipeline) adds to an
    exception about the frames it hid from the traceback: there is no traceback in dew's one line
    for it to speak of, and its flag is no option of dew's."""
    return "has removed its internal frames" in note


def _writers_quiet() -> None:
    """Keep the tracebacks of Orbax's writer threads off the console for the rest of the process.

    A failed checkpoint write (a full disk) is logged with its traceback by each
    of Orbax's background threads, asyncio reports the futures it gathered as
    never retrieved when they are collected (at exit, too), and callbacks that
    arrive after its event loop closed raise "Event loop is closed" as
    unraisable errors; the same failure reaches dew, which names the step and
    what to do in one line. With --traceback all of it is shown.
    """
    import logging

    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FromWriters) for f in logger.filters):
            logger.addFilter(_FromWriters())
    if not isinstance(sys.unraisablehook, _QuietClosedLoop):
        sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)
    # A write that failed leaves JAX's other fragment writes unawaited; Python says so as it exits.
    warnings.filterwarnings("ignore", message=r"coroutine '.*write_fragment' was never awaited",
                            category=RuntimeWarning)


_WRITERS = (f"{os.sep}orbax{os.sep}", f"{os.sep}array_serialization{os.sep}", f"{os.sep}tensorstore{os.sep}")
"""Where the checkpoint writers' code lives: Orbax, and the JAX serialization and TensorStore it writes through."""


_WRITER_DRIVERS = ('"zarr" driver', '"zarr3" driver', '"ocdbt" driver', '"file" driver', " in OCDBT database at ")
"""How TensorStore's own errors name the storage it failed on (Error opening "zarr" driver: ...,
Error writing "step/0" in OCDBT database at local file ...)."""


def _writers_traceback(error: BaseException | None) -> bool:
    """Whether error was raised inside the checkpoint writers: a frame of its traceback is theirs,
    or, raised from TensorStore's C++ (no frame of Python's), its message names a driver of theirs."""
    if error is not None and any(driver in str(error) for driver in _WRITER_DRIVERS):
        return True
    frames = error.__traceback__ if error is not None else None
    while frames is not None:
        if any(part in frames.tb_frame.f_code.co_filename for part in _WRITERS):
            return True
        frames = frames.tb_next
    return False


class _FromWriters:
    """A logging filter dropping records that carry a traceback from the checkpoint writers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        return not (any(part in record.pathname for part in _WRITERS) or _writers_traceback(record.exc_info[1]))


class _QuietClosedLoop:
    """sys.unraisablehook, less asyncio's "Event loop is closed" after Orbax's loop ended, and less
    a Ctrl-C or SIGTERM Python could not raise (inside a garbage-collection callback): dew.interrupts
    noted the Ctrl-C, and the training loop stops for it; the SIGTERM is sent again (_stop_again)."""

    def __init__(self, previous: Callable[[UnraisableHookArgs], object]) -> None:
        self.previous = previous

    def __call__(self, failure: UnraisableHookArgs) -> None:
        if isinstance(failure.exc_value, RuntimeError) and str(failure.exc_value) == "Event loop is closed":
            return
        if isinstance(failure.exc_value, KeyboardInterrupt):
            return
        if isinstance(failure.exc_value, _Terminated):
            _stop_again()
            return
        self.previous(failure)


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Print dew's own warnings as ``dew COMMAND: message`` lines, without Python's source line, and
    the warnings dew's loggers log (a writer's lease recovered) the same way, rather than in the
    ``WARNING:dew.checkpoints:`` format of the root handler Orbax installs.

    Only the formatting changes: filters, and anything that records warnings
    (pytest.warns, catch_warnings(record=True)), see them as before.
    """
    import logging

    logger = logging.getLogger("dew")
    handler = logging.StreamHandler()  # sys.stderr as it is when a line is logged
    handler.setFormatter(logging.Formatter(f"dew {command}: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    propagates, logger.propagate = logger.propagate, False
    original = warnings.formatwarning

    def formatted(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  line: str | None = None) -> str:
        if category.__module__.split(".")[0] == "dew":
            return f"dew {command}: {message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning = original
        logger.removeHandler(handler)
        logger.propagate = propagates


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
