"""Every shipped recipe makes a usable run: `dew train` a few steps, then `dew generate`, `dew eval`
and `dew export` on it (and `dew embed` where the run makes vectors), each as a user types it.

The matrix enumerates the shipped recipes, so a recipe added later is trained here too. Each
recipe's cell runs its commands through ``dew.cli.main``, the function the ``dew`` console script
calls (``test_the_console_script_is_main`` checks they agree, exit codes included), in one worker
interpreter that runs cell after cell (started again if one dies): dew is imported and JAX
started once. Every model is shrunk by the same rules for its registered name, so a recipe
that starts from another recipe's run (``init.run: runs/addition-lm``) or export
(``exported/tiny-lm``) finds a base of its own shape: that recipe's cell, trained once and shared;
a checkpoint a recipe reads (``checkpoints/gemma2-tiny``) is written once by the command its
description gives. The cells share one persistent compilation cache and compile without XLA's
backend optimizations: two training steps do not repay them.

What each cell proves, against an independent computation where there is one:
- `dew eval RUN` with no flags reproduces the validation the trainer itself logged at the last
  step, metric for metric (the objective's own: perplexity, reward, preference accuracy, the
  loss per noise band, the collapse figures);
- `dew generate` writes what the run's pipeline takes and makes (texts; a PNG grid and one PNG
  per image; GIFs for clips), and refuses an input it cannot take in one line saying what it takes;
- `dew export` writes every model: a language model (and every RL/preference policy) as a Llama
  that transformers loads and computes as dew did from the checkpoint, the rest in dew's own
  layout that ``Pretrained.load`` reads back with its task;
- no command ends in a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import queue
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dew.recipes.config import recipe_path, shipped
from dew.recipes.reading import read_recipe_file
from dew.testing.processes import device_env, shared_compilation_cache

RECIPES = sorted(shipped())

# Each registered model, shrunk: the same fields for the same model, so bases and their
# dependents (a DPO policy and its language model, a teacher and its run) keep one shape.
SMALL_MODELS = {
    "causal_transformer": {"emb_features": 16, "num_layers": 1, "num_heads": 2, "mlp_features": 32},
    "token_denoiser": {"emb_features": 16, "num_layers": 1, "num_heads": 2, "mlp_features": 32},
    "dit": {"emb_features": 16, "num_layers": 1, "num_heads": 2, "mlp_features": 32},
    "video_dit": {"emb_features": 16, "num_layers": 1, "num_heads": 2, "mlp_features": 32},
    "vit_encoder": {"emb_features": 16, "num_layers": 1, "num_heads": 2, "mlp_features": 32},
    "unet": {"emb_features": 16, "features": 8, "multipliers": [1]},
}
# Objective fields a recipe sets that only cost time here: previews, sampling lengths, group sizes.
SMALL_OBJECTIVE = {"prompt": None, "preview_steps": 2, "preview_rows": 1, "preview_count": 2,
                   "preview_tokens": 2, "sample_steps": 2, "group_size": 2, "steps": 2,
                   "max_new_tokens": 2, "epochs": 1}
PROMPTS = ["12+3=", "def "]
SCORED = ["3+4=7", "3+4=9"]  # texts a reward model scores
# One device, compiled without the backend's optimizations (numbers differ in the last bits from
# an optimized program's, so every process of the matrix compiles this way).
FLAGS = "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, f"{prefix}{key}.")]
    if isinstance(tree, list):
        return [leaf for i, value in enumerate(tree) for leaf in _leaves(value, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def references(recipe: dict) -> list[tuple[str, str, str]]:
    """(dotted key, "runs", "exported" or "checkpoints", name) for each path in recipe naming another
    recipe's run (runs/NAME/...) or export (exported/NAME), or a checkpoint its description says
    how to write (checkpoints/NAME/...)."""
    found = []
    for key, value in _leaves(recipe):
        if key.startswith("trackers.") or key == "trainer.checkpoint_dir" or not isinstance(value, str):
            continue
        parts = Path(value).parts
        if len(parts) >= 2 and ((parts[0] in ("runs", "exported") and parts[1] in RECIPES)
                                or parts[0] == "checkpoints"):
            found.append((key, parts[0], parts[1]))
    return found


def checkpoint_command(recipe: dict, name: str) -> list[str]:
    """The command recipe's description gives for writing checkpoints/name, as a user types it."""
    found = re.search(rf"python -m ([\w.]+) ([\w-]+) checkpoints/{re.escape(name)}\b",
                      " ".join(recipe.get("description", "").split()))
    assert found, f"the recipe reads checkpoints/{name}, but its description says no command that writes it"
    return ["-m", found[1], found[2]]


def overrides(name: str, runs: Path, exported: Path) -> list[str]:
    """dew train's key=value overrides that make recipe name a two-step run of tiny models."""
    recipe = read_recipe_file(recipe_path(name))
    run = runs / name
    out = ["trainer.steps=2", "trainer.log_every=1", "trainer.eval_every=null",
           "trainer.checkpoint_every=null", "trainer.preview=false", f"trainer.checkpoint_dir={run}",
           "data.batch=4"]
    out += [f"trackers.{i}.directory={run}" for i, t in enumerate(recipe.get("trackers") or [])
            if t.get("name") == "local"]
    sections = [("model", recipe.get("model"))]
    sections += [(f"objective.{k}", v) for k, v in recipe["objective"].items()
                 if isinstance(v, dict) and "name" in v]  # a teacher's model, say
    for where, section in sections:
        if section and section.get("name") in SMALL_MODELS:
            out += [f"{where}.{k}={json.dumps(v)}" for k, v in SMALL_MODELS[section["name"]].items()]
    out += [f"objective.{k}={json.dumps(v)}" for k, v in SMALL_OBJECTIVE.items()
            if k in recipe["objective"]]
    files = recipe["data"].get("files")
    if isinstance(files, str) and files.startswith("{stdlib}"):
        out.append("data.files={stdlib}/a*.py")
    for key, kind, base in references(recipe):
        if kind == "checkpoints":  # the checkpoint's directory, or a file in it (its tokenizer)
            out.append(f"{key}={runs.parent.joinpath(*Path(_value(recipe, key)).parts)}")
        else:  # the base cell's run (checkpoints in its top folder) or export
            out.append(f"{key}={(runs if kind == 'runs' else exported) / base}")
    return out


def _value(recipe: dict, key: str) -> Any:
    return dict(_leaves(recipe))[key]


# The cells' worker: one interpreter runs cell after cell (a spec per line on stdin), each cell's
# dew commands through dew.cli.main as the console script calls it, writing every result (exit
# code, stdout, stderr) to the cell's JSON file; a line DONE ends each cell. One interpreter for
# all cells imports dew and starts JAX once, and programs the cells share compile once.
WORKER = r'''
import contextlib, io, json, os, sys, time, traceback
from pathlib import Path

def dew(results, *argv):
    from dew.cli import main
    out, err = io.StringIO(), io.StringIO()
    began = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as stop:  # argparse's refusals, as the console script exits with them
            code = stop.code
        except BaseException:
            code = "traceback"
            traceback.print_exc()
    results.append({"argv": [str(a) for a in argv], "code": code, "out": out.getvalue(),
                    "err": err.getvalue(), "cpu": time.process_time() - began})
    return results[-1]

def finish(spec, results, **extra):
    Path(spec["result"]).write_text(json.dumps({"commands": results, **extra}))

def cell(spec):
    results = []
    os.chdir(spec["work"])
    run, exported, name = spec["run"], spec["exported"], spec["name"]
    if dew(results, "train", name, *spec["overrides"])["code"] != 0:
        return finish(spec, results)

    from dew.recipes.opening import open_run

    opened = open_run(Path(run))
    pipeline = opened.pipeline()
    kind = type(pipeline).__name__
    bad = []
    dew(results, "eval", run, "--json")
    if kind == "TextGeneration":
        dew(results, "generate", run, *spec["prompts"], "--max-new-tokens", "3")
        bad.append(dew(results, "generate", run, "x", "--guidance", "2"))
        bad.append(dew(results, "generate", run))
    elif kind == "FeatureExtraction":
        import numpy as np
        from dew.data.base import SINGLE
        from dew.recipes.run import build_parts

        batch = next(iter(build_parts(opened.config).dataset.val(SINGLE)))
        key = pipeline.objective.input_key
        np.save("inputs.npy", batch[key][:3])
        dew(results, "embed", run, "inputs.npy", "vectors.npy")
        bad.append(dew(results, "generate", run))
        np.save("wrong.npy", np.zeros((2, 5, 5, 3), np.uint8))
        bad.append(dew(results, "embed", run, "wrong.npy", "never.npy"))
    elif kind == "TextDiffusionPipeline":
        dew(results, "generate", run, "--count", "2", "--steps", "2", "--out", "texts")
        dew(results, "generate", run, "abc", "--steps", "2")  # block diffusion refuses a partial block
        bad.append(dew(results, "generate", run, "--guidance", "2"))
    elif kind == "RewardScoring":
        dew(results, "generate", run, *spec["scored"])
        bad.append(dew(results, "generate", run))
        bad.append(dew(results, "generate", run, spec["scored"][0], "--count", "2"))
    else:  # images or clips
        accepts = pipeline.accepts
        labels = ["0", "1"] if "label" in accepts else []
        guidance = ["--guidance", "2"] if "guidance" in pipeline.options else []
        dew(results, "generate", run, *labels, "--count", "2", "--steps", "2", *guidance, "--out", "samples")
        if labels:
            bad.append(dew(results, "generate", run, "a cat"))
            bad.append(dew(results, "generate", run, "99"))
    dew(results, "export", run, exported)
    extra = {"kind": kind, "accepts": pipeline.accepts, "reprs": [repr(opened), repr(pipeline)]}
    if kind == "TextGeneration":
        import jax.numpy as jnp
        import numpy as np

        ids = np.random.default_rng(0).integers(0, 256, (2, 9))
        np.save("ids.npy", ids)
        np.save("logits.npy", np.asarray(pipeline.model.apply(pipeline.variables, jnp.asarray(ids, jnp.int32))))
        dew(results, "generate", exported, *spec["prompts"], "--max-new-tokens", "3")
        if opened.config.lora is not None:
            dew(results, "export", run, exported + "-adapters", "--adapters")
    else:
        import jax
        import numpy as np
        from dew.pretrained import Pretrained

        loaded = Pretrained.load(exported)
        saved = dict(jax.tree_util.tree_leaves_with_path(jax.device_get(dict(pipeline.variables))))
        read = dict(jax.tree_util.tree_leaves_with_path(loaded.variables))
        # Every variable the run's pipeline holds comes back bit for bit (a reward model's export
        # leaves out the language-model head it never reads).
        extra["bitwise"] = all(np.array_equal(saved.get(path), leaf) for path, leaf in read.items())
        extra["left_out"] = sorted(jax.tree_util.keystr(path) for path in saved.keys() - read.keys())
        extra["task"] = (loaded.task or {}).get("name")
        extra["reloaded"] = type(loaded.pipeline()).__name__
        if kind == "RewardScoring":  # the export scores through every command as the run does
            dew(results, "generate", exported, *spec["scored"])
            np.save("scores.npy", pipeline(spec["scored"]))
    finish(spec, results, bad=[len(results) - 1 - results[::-1].index(b) for b in bad], **extra)


for line in sys.stdin:
    spec = json.loads(line)
    try:
        cell(spec)
    except BaseException:
        Path(spec["result"]).write_text(json.dumps({"failed": traceback.format_exc()}))
    print("\nDONE", flush=True)
'''


class Matrix:
    """The cells, each trained once and shared (a dependent's base first)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cells: dict[str, dict] = {}
        self.cache = shared_compilation_cache(root / "xla-cache")
        self.worker: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _worker(self) -> subprocess.Popen:
        """The cells' interpreter (see WORKER), started again when one died or overran."""
        if self.worker is None or self.worker.poll() is not None:
            self.lines = queue.Queue()
            self.worker = subprocess.Popen(
                [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=(self.root / "worker.log").open("a"), text=True, cwd=self.root,
                env=device_env(1, {"XLA_FLAGS": FLAGS}, compilation_cache=self.cache))
            threading.Thread(target=_forward, args=(self.worker.stdout, self.lines), daemon=True).start()
        return self.worker

    def _run(self, spec: dict, timeout: float = 400) -> str:
        """Run one cell in the worker; what it printed besides its results (its failure, if any)."""
        worker = self._worker()
        assert worker.stdin is not None
        worker.stdin.write(json.dumps(spec) + "\n")
        worker.stdin.flush()
        printed, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                worker.kill()
                return "".join(printed) + f"\nthe cell ran past {timeout} s"
            if line is None:  # the worker died
                return "".join(printed) + (self.root / "worker.log").read_text()[-6000:]
            if line == "DONE\n":
                return "".join(printed)
            printed.append(line)

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            assert self.worker.stdin is not None
            self.worker.stdin.close()
            self.worker.wait(timeout=60)

    def cell(self, name: str) -> dict:
        if name in self.cells:
            assert "failed" not in self.cells[name], self.cells[name]["failed"]
            return self.cells[name]
        recipe = read_recipe_file(recipe_path(name))
        for _, kind, base in references(recipe):
            if kind == "checkpoints":
                self.checkpoint(recipe, base)
            else:
                assert self.cell(base)["commands"][0]["code"] == 0, f"{name}'s base {base} did not train"
        runs, exported = self.root / "runs", self.root / "exported"
        result = self.root / f"{name}.json"
        spec = {"name": name, "run": str(runs / name), "exported": str(exported / name),
                "overrides": overrides(name, runs, exported), "prompts": PROMPTS, "scored": SCORED, "result": str(result)}
        work = self.root / "work" / name
        work.mkdir(parents=True, exist_ok=True)
        spec["work"] = str(work)
        printed = self._run(spec)
        self.cells[name] = json.loads(result.read_text()) if result.is_file() else {"failed": printed}
        cell = self.cells[name]
        assert "failed" not in cell, cell.get("failed")
        cell.update(name=name, run=runs / name, exported=exported / name, work=work)
        return cell


    def checkpoint(self, recipe: dict, name: str) -> Path:
        """checkpoints/name, written once by the command the recipe's description gives."""
        target = self.root / "checkpoints" / name
        if not (target / "config.json").is_file():  # the command's module, run here (it imports torch)
            _, module, *args = checkpoint_command(recipe, name)
            with contextlib.redirect_stdout(io.StringIO()):
                assert importlib.import_module(module).main([*args, str(target)]) == 0, (module, args)
        return target


def _forward(stream: Any, lines: queue.Queue) -> None:
    """Every line the worker prints, then None when it exits."""
    for line in stream:
        lines.put(line)
    lines.put(None)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Iterator[Matrix]:
    made = Matrix(tmp_path_factory.mktemp("matrix"))
    yield made
    made.close()


def _command(cell: dict, verb: str, *, index: int = 0) -> dict:
    found = [c for c in cell["commands"] if c["argv"][0] == verb]
    assert len(found) > index, f"{cell['name']}: no dew {verb} ran: {cell['commands'][-1]}"
    return found[index]


def _ok(command: dict) -> dict:
    assert command["code"] == 0, f"dew {' '.join(command['argv'])} exited {command['code']}:\n" \
                                 f"{command['out'][-2000:]}\n{command['err'][-4000:]}"
    return command


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _logged_validation(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines() if line]
    scores = [row for row in rows if any(k.startswith("val/") for k in row)]
    assert scores, f"{run} logged no validation"
    return {k: v for k, v in scores[-1].items() if k.startswith("val/")}


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_run_generates_evaluates_and_exports(name, matrix):
    cell = matrix.cell(name)
    train = _ok(cell["commands"][0])
    for command in cell["commands"]:
        assert command["code"] != "traceback" and "Traceback" not in command["err"], command
    run, kind = cell["run"], cell["kind"]
    usage = [line for line in train["out"].splitlines() if line.startswith("Use the run: ")]
    assert usage and str(run) in usage[0]
    assert ("dew embed" if kind == "FeatureExtraction" else "dew generate") in usage[0]

    # dew eval, no flags: the objective's validation of the last step, as the trainer logged it.
    scores = json.loads(_ok(_command(cell, "eval"))["out"])
    logged = _logged_validation(run)
    assert scores["step"] == 2
    assert {k for k in scores if k.startswith("val/")} == set(logged)
    for key, value in logged.items():
        assert scores[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

    # Bad input: one line saying what the pipeline takes, exit 2.
    for index in cell["bad"]:
        refused = cell["commands"][index]
        assert refused["code"] == 2, refused
        lines = refused["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"dew {refused['argv'][0]}: "), refused

    # Printed in a notebook, the opened run and its pipeline show a line per variable tree.
    assert "variables=<" in cell["reprs"][0] and "live=<" in cell["reprs"][0]
    assert all("Array(" not in shown for shown in cell["reprs"]), cell["reprs"]

    export = _ok(_command(cell, "export"))
    assert str(cell["exported"]) in export["out"]
    assert "is not the one of" not in export["err"], export["err"]  # every recipe trains on its start's tokenizer
    if kind == "TextGeneration":
        _check_text(cell)
    elif kind == "FeatureExtraction":
        _check_embeddings(cell)
    elif kind == "TextDiffusionPipeline":
        _check_text_diffusion(cell)
    elif kind == "RewardScoring":
        _check_scores(cell)
    else:
        _check_pixels(cell)
    if kind != "TextGeneration":  # read back bit for bit with the task it serves
        assert cell["bitwise"] and cell["task"] == read_recipe_file(recipe_path(name))["objective"]["name"]
        assert cell["reloaded"] == kind
    if kind not in ("TextGeneration", "RewardScoring"):  # no published format computes them: dew's own
        config = json.loads((cell["exported"] / "config.json").read_text())
        assert config["format"] == "dew" and "dew's own layout" in export["out"] and not cell["left_out"]


def _check_text(cell: dict) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    shown = _ok(_command(cell, "generate"))["out"]  # each prompt and its continuation, in order
    assert shown.startswith(PROMPTS[0]) and f"\n{PROMPTS[1]}" in shown
    # The export reads back through every command: generating from it says the same.
    assert _ok(_command(cell, "generate", index=3))["out"] == shown
    # A family's model in its family's layout; dew's own transformer, exactly a Llama, in Llama's.
    model = read_recipe_file(recipe_path(cell["name"]))["model"]["name"]
    layout = "llama" if model == "causal_transformer" else model
    assert f"Hugging Face's {layout} layout" in _command(cell, "export")["out"]
    # transformers computes from the export what dew computes from the checkpoint.
    work = cell["work"]
    ids, ours = np.load(work / "ids.npy"), np.load(work / "logits.npy")
    model = transformers.AutoModelForCausalLM.from_pretrained(cell["exported"], dtype=torch.float32)
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4
    # The export's tokenizer is the run's: bytes, or the checkpoint's the recipe read (as transformers reads it).
    tokenizer = transformers.AutoTokenizer.from_pretrained(cell["exported"])
    source = read_recipe_file(recipe_path(cell["name"]))["data"].get("tokenizer")
    read = source is not None and Path(source).parts[0] == "checkpoints"
    expected = transformers.AutoTokenizer.from_pretrained(cell["run"].parent.parent.joinpath(
        *Path(source).parts[:2])).encode("12+3=") if read else list(b"12+3=")
    assert tokenizer.encode("12+3=") == expected
    # A run from a published checkpoint keeps its context length, whatever decode cache it trained with.
    start = (read_recipe_file(recipe_path(cell["name"])).get("init") or {}).get("pretrained")
    if start is not None and Path(start).parts[0] == "checkpoints":
        published = json.loads(cell["run"].parent.parent.joinpath(start, "config.json").read_text())
        written = json.loads((cell["exported"] / "config.json").read_text())
        assert written["max_position_embeddings"] == published["max_position_embeddings"]
    if any(c["argv"][-1] == "--adapters" for c in cell["commands"]):
        export = _ok([c for c in cell["commands"] if c["argv"][-1] == "--adapters"][0])
        assert (Path(export["argv"][2]) / "adapter_config.json").is_file()


def _check_embeddings(cell: dict) -> None:
    _ok(_command(cell, "embed"))
    vectors, inputs = np.load(cell["work"] / "vectors.npy"), np.load(cell["work"] / "inputs.npy")
    assert vectors.shape[0] == inputs.shape[0] == 3 and vectors.ndim == 2 and np.isfinite(vectors).all()
    refused = _command(cell, "generate")
    assert refused["code"] == 2 and "dew embed" in refused["err"]


def _check_scores(cell: dict) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    shown = _ok(_command(cell, "generate"))["out"].splitlines()  # "score<TAB>text", one per text, in order
    assert [line.split("\t", 1)[1] for line in shown] == SCORED
    assert all(np.isfinite(float(line.split("\t", 1)[0])) for line in shown)
    assert _ok(_command(cell, "generate", index=3))["out"].splitlines() == shown  # from the export
    assert "No text was given" in cell["commands"][cell["bad"][0]]["err"]
    # dew's transformer, exactly a Llama, with its score: a reward model as TRL writes one, which
    # transformers scores as the run does (one text at a time: dew's byte tokenizer names no pad).
    assert "Hugging Face's LlamaForSequenceClassification layout" in _command(cell, "export")["out"]
    assert cell["left_out"] == ["['params']['head']"]  # the language-model head, which it never reads
    model = transformers.AutoModelForSequenceClassification.from_pretrained(cell["exported"], dtype=torch.float32)
    with torch.no_grad():
        theirs = [float(model.eval()(torch.tensor([list(text.encode())])).logits[0, 0]) for text in SCORED]
    np.testing.assert_allclose(theirs, np.load(cell["work"] / "scores.npy"), atol=1e-5)


def _check_text_diffusion(cell: dict) -> None:
    made = _ok(_command(cell, "generate"))["out"]
    assert made.endswith("Wrote 2 sample(s) to texts: samples.txt\n")  # where the file went
    written = (cell["work"] / "texts" / "samples.txt").read_bytes().decode("utf-8")  # \r kept
    assert written.count("\n---\n") == 1  # two samples, a rule between them
    assert all(text in made for text in written[:-1].split("\n---\n"))
    prompted = _command(cell, "generate", index=1)
    if "block" in cell["name"]:
        assert prompted["code"] == 2 and "whole blocks" in prompted["err"]
    else:
        assert _ok(prompted)["out"].startswith("abc")


def _check_pixels(cell: dict) -> None:
    made = _ok(_command(cell, "generate"))
    samples = cell["work"] / "samples"
    labelled = "label" in cell["accepts"]
    count = 4 if labelled else 2
    singles = sorted(samples.glob("sample_*"))
    assert len(singles) == count
    assert f"Wrote {count} sample(s) to samples: samples{singles[0].suffix}" in made["out"]
    if singles[0].suffix == ".png":
        side, _ = _png_size(singles[0])
        width, height = _png_size(samples / "samples.png")
        assert (width, height) == ((2 if labelled else count) * side, (2 if labelled else 1) * side)
    else:
        from PIL import Image

        with Image.open(samples / "samples.gif") as grid, Image.open(singles[0]) as clip:
            assert grid.n_frames == clip.n_frames > 1
    if labelled:
        for index in cell["bad"]:
            assert "class labels 0 to" in cell["commands"][index]["err"]


@pytest.mark.slow
def test_the_console_script_is_main(matrix):
    """The installed `dew` script gives what dew.cli.main gave the cells: output and exit codes."""
    # A class-conditional run's cell (one the matrix made already, when it ran first).
    order = sorted(RECIPES, key=lambda n: n not in matrix.cells)
    cell = next(c for c in map(matrix.cell, order) if "label" in c["accepts"] and c["bad"])
    script = Path(sys.executable).parent / "dew"
    env = device_env(1, {"XLA_FLAGS": FLAGS}, compilation_cache=matrix.cache)
    for command in (cell["commands"][cell["bad"][0]], _command(cell, "eval")):
        ran = subprocess.run([str(script), *command["argv"]], capture_output=True, text=True,
                             cwd=cell["work"], env=env, timeout=300)
        assert (ran.returncode, ran.stdout, ran.stderr) == (command["code"], command["out"],
                                                           command["err"]), command["argv"]
    unknown = subprocess.run([str(script), "generate"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and "RUN" in unknown.stderr  # argparse's refusal, exit 2


def test_every_recipe_reference_names_a_shipped_recipe():
    """The matrix finds a dependent's base by its path: each init/teacher path names a recipe."""
    for name in RECIPES:
        recipe = read_recipe_file(recipe_path(name))
        for key, value in _leaves(recipe):
            if key.split(".")[-1] in ("run", "pretrained", "teacher_checkpoint", "teacher_pretrained") \
                    and isinstance(value, str):
                parts = Path(value).parts
                if parts[:1] == ("checkpoints",):  # written by a command the description gives
                    assert checkpoint_command(recipe, parts[1])[1] == "dew.families.examples", (name, value)
                else:
                    assert parts[:1] in (("runs",), ("exported",)) and parts[1] in RECIPES, (name, key, value)

