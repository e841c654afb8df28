"""Nothing runs from a data folder: a planted loading script is refused, never executed.

The script would write a marker file beside itself if anything imported it;
the marker never appears, and the error names the folder.
"""

from __future__ import annotations

import importlib.metadata
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dew.data.errors import LoadingScriptError

datasets = pytest.importorskip("datasets")

_SCRIPT = textwrap.dedent("""
    import pathlib
    pathlib.Path(__file__).with_name("MARKER").write_text("the loading script ran")
    import datasets

    class Planted(datasets.GeneratorBasedBuilder):
        def _info(self):
            return datasets.DatasetInfo(features=datasets.Features({"text": datasets.Value("string")}))

        def _split_generators(self, dl_manager):
            return [datasets.SplitGenerator(name="train")]

        def _generate_examples(self):
            yield 0, {"text": "planted"}
""")


@pytest.fixture
def planted(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "corpus.py").write_text(_SCRIPT)  # the name datasets looks for: <folder>.py
    (folder / "data.jsonl").write_text('{"text": "hello world, hello data"}\n' * 50)
    return folder


def test_the_hf_extra_allows_no_datasets_version_with_loading_scripts():
    requirements = [Requirement(r) for r in importlib.metadata.requires("dew-data") or []]
    (pinned,) = [r for r in requirements if r.name == "datasets"]
    assert pinned.marker is not None and pinned.marker.evaluate({"extra": "hf"})
    for with_scripts in ("2.19.0", "2.21.0", "3.0.0", "3.6.0"):
        assert not pinned.specifier.contains(with_scripts), with_scripts
    assert Version(datasets.__version__) >= Version("4")  # what pip resolved here


def test_token_windows_refuse_a_folder_with_a_loading_script(planted):
    from dew.data import TokenWindows

    with pytest.raises(LoadingScriptError) as caught:
        TokenWindows(dataset=str(planted), length=8).windows()
    message = str(caught.value)
    assert str(planted) in message and "corpus.py" in message
    assert not (planted / "MARKER").exists()


def test_a_script_file_named_directly_is_refused(planted):
    from dew.data.sources import load_hf_dataset

    with pytest.raises(LoadingScriptError, match="corpus.py"):
        load_hf_dataset(str(planted / "corpus.py"), split="train")
    assert not (planted / "MARKER").exists()


def test_datasets_own_refusal_is_reported_naming_the_dataset(planted):
    # The second guard: what reaches datasets itself (a hub name, say) is refused by
    # datasets >= 4, and dew reports that refusal as its own error naming the dataset.
    from dew.data import sources

    with pytest.raises(LoadingScriptError) as caught:
        sources._load_dataset(datasets, str(planted), None, "train")
    assert str(planted) in str(caught.value)
    assert not (planted / "MARKER").exists()


def test_a_folder_of_data_files_still_loads(tmp_path):
    from dew.data.sources import load_hf_dataset

    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    assert load_hf_dataset(str(folder), split="train")["text"] == ["a", "b"]
