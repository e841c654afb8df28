"""``dew export --verify``: transformers loads the export and must compute dew's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)


@pytest.mark.slow
def test_dew_export_verify_certifies_the_export_and_fails_above_the_tolerance(tmp_path, capsys):
    import jax
    import jax.numpy as jnp

    from dew.cli import main
    from dew.pretrained import Pretrained

    source = write_checkpoint("gemma2", tmp_path / "source", seed=3, redrawn=True)
    assert main(["export", str(source), str(tmp_path / "out"), "--verify"]) == 0
    assert "Verified: transformers' Gemma2ForCausalLM matches" in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert record["passed"] and record["architecture"] == "Gemma2ForCausalLM"
    assert record["versions"]["transformers"] == transformers.__version__
    assert record["versions"]["torch"] == torch.__version__
    assert len(record["prompts_sha256"]) == 64 and len(record["prompt_lengths"]) == 5  # 2 id rows, 3 texts

    # The recorded difference is the one an independent comparison finds on the first prompt.
    loaded = Pretrained.load(source)
    row = np.random.default_rng(0).integers(0, loaded.model.vocab_size, (1, 32))
    mine = np.asarray(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(row, jnp.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(row)).logits.numpy()
    assert record["max_abs_difference"] <= 1e-4
    assert abs(np.abs(mine - theirs).max() - record["max_abs_difference"]) <= 1e-5
    # The tokenizer's chat template travels with the export.
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()

    # Past the tolerance: exit 1, the record says why, and the export stays whole.
    assert main(["export", str(source), str(tmp_path / "strict"), "--verify", "--tolerance", "1e-12"]) == 1
    assert "computes logits up to" in capsys.readouterr().err
    failed = json.loads((tmp_path / "strict" / "verification.json").read_text())
    assert not failed["passed"] and failed["max_abs_difference"] > 1e-12
    assert failed["prompts_sha256"] == record["prompts_sha256"]
    assert (tmp_path / "strict" / "model.safetensors").is_file()


@pytest.mark.slow
def test_an_export_transformers_cannot_load_or_run_is_named_not_a_traceback(tmp_path, capsys, monkeypatch):
    """An export transformers refused (Gemma 2's old sliding_window: null loaded, then failed at
    the first forward pass) reached `dew export --verify` as transformers' own traceback, with no
    word of which step failed; it is an UnrunnableExportError naming the step and the export."""
    from dew.cli import main
    from dew.pretrained import Pretrained
    from dew.pretrained.verify import UnrunnableExportError, verify

    source = write_checkpoint("gemma2", tmp_path / "source", seed=3, redrawn=True)
    loaded = Pretrained.load(source)
    loaded.save(tmp_path / "out")
    config_path = tmp_path / "out" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "sliding_window": None}))  # what dew once wrote
    with pytest.raises(UnrunnableExportError, match=r"could not run the export in .*out \(\w+Error: "):
        verify(tmp_path / "out", loaded.model, loaded.variables)
    config_path.write_text(json.dumps({**config, "model_type": "no_such_model"}))
    with pytest.raises(UnrunnableExportError, match=r"could not load the export in .*out \("):
        verify(tmp_path / "out", loaded.model, loaded.variables)

    # The command says it in one line, and keeps the export it wrote (the refusal is faked here: an
    # export dew writes itself is one transformers runs).
    def refuse(*args, **kwargs):
        raise OSError("no file named model.safetensors")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    assert main(["export", str(source), str(tmp_path / "cli"), "--verify"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # above it, the progress bars of the writing
    assert "Traceback" not in err and last.startswith("dew export --verify: transformers could not load the export")
    assert "(OSError: no file named model.safetensors)" in last
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_a_published_checkpoint_keeps_its_tokenizer_settings_through_dews_own_layout(tmp_path):
    """Qwen 3 through `dew export --format dew` and back to Hugging Face's layout: the chat template,
    the special ids and the published context are those of the source, read back by transformers."""
    from dew.cli import main

    source = write_checkpoint("qwen3", tmp_path / "source", seed=1)
    assert main(["export", str(source), str(tmp_path / "native"), "--format", "dew"]) == 0
    assert main(["export", str(tmp_path / "native"), str(tmp_path / "again")]) == 0
    before = json.loads((source / "config.json").read_text())
    after = json.loads((tmp_path / "again" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert after.get(key) == before.get(key), (key, before.get(key), after.get(key))
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    chat = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token == theirs.eos_token == "<|im_end|>"
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "again").to_dict() == \
        transformers.GenerationConfig.from_pretrained(source).to_dict()


FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from dew.cli import main
sys.exit(main(["export", sys.argv[1], sys.argv[2]]))
"""


def test_an_export_the_disk_refuses_is_one_line_and_keeps_the_earlier_one(tmp_path, capsys):
    """A write refused part way (here a file-size limit; a full disk fails the same way) is named
    with the system's reason; the export already in OUT is left whole."""
    import os
    import subprocess
    import sys

    from dew.cli import main

    source = write_checkpoint("qwen3", tmp_path / "source", seed=1)
    out = tmp_path / "out"
    assert main(["export", str(source), str(out)]) == 0
    assert "replaced" not in capsys.readouterr().out
    assert main(["export", str(source), str(out)]) == 0  # an earlier export is replaced, and said to be
    assert capsys.readouterr().out.splitlines()[-1] == f"(it replaced the export {out} held before)"
    mine = tmp_path / "mine"  # a folder of others' files, written into with --force, held no export
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert main(["export", str(source), str(mine), "--force"]) == 0
    assert "replaced" not in capsys.readouterr().out and (mine / "notes.txt").read_text() == "kept"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(source), str(out)], capture_output=True,
                           text=True, env=env, timeout=300)
    assert child.returncode == 2, child.stderr[-3000:]
    assert child.stderr.startswith(f"dew export: Writing the export to {out} failed (") and "File too large" in \
        child.stderr and f"{out} is as it was" in child.stderr and "Traceback" not in child.stderr, child.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if "dew-writing" in p.name] == []


TOKENIZER_REFUSED = """
import resource, signal, sys
from dew.pretrained.tokenizers import byte_level
from dew.pretrained.writing import _write_failure
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
try:
    byte_level(256).save(sys.argv[1])
except BaseException as error:  # whatever the library raises
    print(type(error).__name__, "|", _write_failure(error))
"""


def test_a_tokenizer_write_the_disk_refuses_is_a_write_failure(tmp_path):
    """The tokenizers library reports a refused write as a plain Exception ("... (os error 27)"):
    dew export printed its traceback instead of the one line that names OUT."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TOKENIZER_REFUSED, str(tmp_path / "tokenizer.json")],
                          capture_output=True, text=True, timeout=120)
    kind, reason = done.stdout.strip().split(" | ")
    assert kind == "Exception" and "os error" in reason and reason != "None", done.stdout + done.stderr


VERIFICATION_REFUSED = """
import pathlib, resource, signal, sys
from dew.pretrained import PretrainedError
from dew.pretrained.verify import Verification
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
record = Verification(0.0, 1e-4, True, "0" * 64, (3, 4), "Qwen3ForCausalLM")
try:
    record.write(pathlib.Path(sys.argv[1]))
except PretrainedError as error:
    print(error)
"""


def test_a_verification_record_the_disk_refuses_is_named_and_not_left_empty(tmp_path):
    """dew export --verify printed a traceback after the export was swapped in, and left an empty
    verification.json in OUT."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", VERIFICATION_REFUSED, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.startswith(f"{tmp_path / 'verification.json'} could not be written ("), done.stderr[-2000:]
    assert "the export in" in done.stdout and "run dew export --verify again" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_model_trained_on_a_tokenizer_folder_exports_its_special_tokens_and_chat_template(tmp_path):
    """A model whose weights came from elsewhere (here: fresh) and whose tokenizer is a folder (a recipe's
    data.tokenizer) wrote a tokenizer_config.json naming only the eos token: the export lost the folder's
    chat template (dew generate --chat refused it) and its bos and pad tokens (transformers' bos_token_id
    was None)."""
    import shutil

    import jax
    import jax.numpy as jnp

    from dew import models
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.pretrained import Pretrained

    source = write_checkpoint("llama", tmp_path / "source", seed=1)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)
    tokenizer = HFTokenizer.from_directory(folder)
    model = models.build("causal_transformer", vocab_size=len(tokenizer.tokenizer.get_vocab()), emb_features=16,
                         num_layers=1, num_heads=2, mlp_features=32, max_seq_len=32)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    Pretrained(model, variables, tokenizer=tokenizer).save(tmp_path / "out")

    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    assert ours.bos_token_id is not None and ours("hi there")["input_ids"] == theirs("hi there")["input_ids"]
    chat = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    back = Pretrained.load(tmp_path / "out").tokenizer
    assert back.chat_template is not None and back.chat_template.render(chat).text == \
        tokenizer.chat_template.render(chat).text


def test_weights_trained_without_a_source_config_export_their_tokenizers_bos_and_pad_ids(tmp_path):
    """A run from scratch with a family's tokenizer (a distillation's student) had no config.json to
    take its special ids from: the export named only the eos, and transformers filled in Gemma's class
    defaults (bos 2, pad 0), ordinary tokens of this vocabulary."""
    from dew.pretrained import Pretrained

    source = Pretrained.load(write_checkpoint("gemma3", tmp_path / "source", seed=1))
    assert source.tokenizer_files is not None and source.tokenizer_files.ids  # the published ids
    Pretrained(source.model, source.variables, source.tokenizer).save(tmp_path / "scratch")  # as a run's export
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "scratch")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "scratch")
    assert theirs.bos_token is not None and theirs.pad_token is not None
    assert (config.bos_token_id, config.pad_token_id) == (theirs.bos_token_id, theirs.pad_token_id)
    published = json.loads((tmp_path / "source" / "config.json").read_text())
    assert (config.bos_token_id, config.pad_token_id) == (published["bos_token_id"], published["pad_token_id"])
