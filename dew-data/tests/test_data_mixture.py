"""A mixture draws its sources by weight (Grain's interleave), follows a schedule, resumes
bitwise at any process count, and reports what it drew from each source."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from dew.data.base import GLOBAL_POSITION, DataPartition
from dew.data.sources import ArrayRecords
from dew.testing import DatasetReaderKit


class Tagged:
    """A reader of n records whose "source" column is tag and "row" the record's number."""

    def __init__(self, tag: int, n: int, width: int = 3) -> None:
        self.tag, self.n, self.width = tag, n, width

    def records(self) -> ArrayRecords:
        rows = np.arange(self.n)
        return ArrayRecords({"source": np.full(self.n, self.tag, np.int32), "row": rows,
                             "x": np.repeat(rows[:, None], self.width, axis=1).astype(np.float32)})


def _take(stream, count):
    return [next(stream) for _ in range(count)]


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 2, 3), (0.001, 0.5, 0.499), (5, 1)])
def test_the_interleave_is_grains_own(weights):
    """Which source fills each position, and which of its records, is grain.MapDataset.mix's choice."""
    import grain

    from dew.data.mixture import interleave, interleave_counts, proportions

    parents = [grain.MapDataset.range(10**9).map(lambda j, i=i: (i, j)) for i in range(len(weights))]
    mixed = grain.MapDataset.mix(parents, list(weights))
    n = 2000
    expected = np.asarray([mixed[k] for k in range(n)])
    which, index = interleave(np.arange(n), proportions(weights))
    assert np.array_equal(which, expected[:, 0]) and np.array_equal(index, expected[:, 1])
    assert interleave_counts(n, proportions(weights)) == np.bincount(which, minlength=len(weights)).tolist()
    far = np.arange(10**14, 10**14 + 64)  # a resumed run far along the stream costs the same
    assert np.array_equal(interleave(far, proportions(weights))[0],
                          np.asarray([mixed[int(k)][0] for k in far]))


def test_draws_match_the_weights_and_each_source_keeps_its_own_order():
    from dew.data.mixture import Mixture, _seed_of
    from dew.data.order import RecordOrder

    sources = {"a": Tagged(0, 50), "b": Tagged(1, 37), "c": Tagged(2, 11)}
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    stream = Mixture(sources=sources, weights=weights).load(batch=16, seed=4).train(DataPartition())
    batches = _take(stream, 100)
    tags = np.concatenate([b["source"] for b in batches])
    total = len(tags)
    for tag, name in enumerate(weights):
        drawn = int((tags == tag).sum())
        p = weights[name]
        assert abs(drawn - total * p) <= 3 * np.sqrt(total * p * (1 - p)), (name, drawn)
        assert stream.scalars()[f"data/{name}/records"] == drawn
        # source name's records, in the order drawn, are its own shuffled stream
        rows = np.concatenate([b["row"][b["source"] == tag] for b in batches])
        order = RecordOrder(sources[name].n, _seed_of(4, name))
        assert np.array_equal(rows, order(np.arange(drawn)))


def test_sources_holding_fewer_records_together_than_one_batch_still_fill_it():
    """A mixture of 3 and 2 records was refused at a batch of 8 ("fewer than one global batch"),
    though each source starts over when its share outlasts its records, as a small source at a
    large weight does within any batch: the batch is filled, each source's records in its own
    shuffled order, epoch after epoch."""
    from dew.data.mixture import Mixture, _seed_of
    from dew.data.order import RecordOrder

    sources = {"a": Tagged(0, 3), "b": Tagged(1, 2)}
    stream = Mixture(sources=sources, weights={"a": 3, "b": 1}).load(batch=8, seed=2).train(DataPartition())
    batches = _take(stream, 3)
    assert all(len(b["row"]) == 8 for b in batches)
    for tag, name in enumerate(sources):
        rows = np.concatenate([b["row"][b["source"] == tag] for b in batches])
        assert len(rows) == (18 if name == "a" else 6) == stream.scalars()[f"data/{name}/records"]
        assert np.array_equal(rows, RecordOrder(sources[name].n, _seed_of(2, name))(np.arange(len(rows))))


def test_a_schedule_changes_the_weights_at_its_steps():
    from dew.data.mixture import Mixture

    schedule = [{"step": 0, "weights": {"a": 1.0}}, {"step": 3, "weights": {"a": 1.0, "b": 1.0}},
                {"step": 5, "weights": {"b": 1.0}}]
    stream = Mixture(sources={"a": Tagged(0, 20), "b": Tagged(1, 20)}, schedule=schedule).load(
        batch=4).train(DataPartition())
    batches = _take(stream, 7)
    assert [b["source"].tolist() for b in batches] == [[0] * 4] * 3 + [[0, 1] * 2] * 2 + [[1] * 4] * 2
    # b's records continue where they stopped: 4 drawn in steps 3-4, then records 4.. of its stream
    rows_b = np.concatenate([b["row"][b["source"] == 1] for b in batches])
    assert len(set(rows_b.tolist())) == len(rows_b) == 12
    assert stream.scalars() == {"data/a/records": 16.0, "data/b/records": 12.0}


def test_a_position_resumes_only_a_mixture_that_drew_its_records_the_same_way():
    """Other weights, another source order or a missing source would read some records again and
    skip others, so the position refuses them by name; a schedule entry after the position changes
    the weights from there on, and every record before it is read as the original run read it."""
    import json

    from dew.data.mixture import Mixture
    from dew.data.stream import GLOBAL_POSITION, PositionMismatchError

    sources = {"a": Tagged(0, 40), "b": Tagged(1, 40)}

    def opened(**options):
        return Mixture(**options).load(batch=4, seed=2).train(DataPartition())

    original = opened(sources=sources, weights={"a": 0.5, "b": 0.5})
    _take(original, 2)
    position = original.get_state()
    uninterrupted = _take(original, 4)
    changed = [{"sources": sources, "weights": {"a": 0.9, "b": 0.1}},
               {"sources": {"b": sources["b"], "a": sources["a"]}, "weights": {"b": 0.5, "a": 0.5}},
               {"sources": {"a": sources["a"], "b": Tagged(1, 40), "c": Tagged(2, 5)},
                "weights": {"a": 0.5, "b": 0.5, "c": 0.0}}]
    for options in changed:
        with pytest.raises(PositionMismatchError, match="read some records again and skip others"):
            opened(**options).set_state(position)
    later = [{"step": 0, "weights": {"a": 0.5, "b": 0.5}}, {"step": 4, "weights": {"b": 1.0}}]
    resumed = opened(sources=sources, schedule=later)
    resumed.set_state(position)
    batches = _take(resumed, 4)
    assert [b["row"].tolist() for b in batches[:2]] == [b["row"].tolist() for b in uninterrupted[:2]]
    assert [b["source"].tolist() for b in batches[:2]] == [b["source"].tolist() for b in uninterrupted[:2]]
    assert all(b["source"].tolist() == [1] * 4 for b in batches[2:])
    # b's records continue from where the original run had left them
    rows_b = np.concatenate([b["row"][b["source"] == 1] for b in batches])
    assert len(set(rows_b.tolist())) == len(rows_b)
    # a position saved before positions kept their layout still resumes
    fields = json.loads(position[len(GLOBAL_POSITION):])
    del fields["layout"]
    older = opened(sources=sources, weights={"a": 0.5, "b": 0.5})
    older.set_state(GLOBAL_POSITION + json.dumps(fields).encode())
    assert next(older)["row"].tolist() == uninterrupted[0]["row"].tolist()


def test_a_resume_with_another_batch_is_refused_where_the_schedule_changes_later():
    """A schedule's steps are placed at records counted in batches of the current size: resumed with
    another data.batch, a change at step 4 landed where 4 batches of the new size end. It is refused
    while a change lies ahead (one behind the position is placed otherwise, which its layout refuses);
    without a schedule, another batch resumes as before."""
    from dew.data.mixture import Mixture
    from dew.data.stream import PositionMismatchError

    sources = {"a": Tagged(0, 40), "b": Tagged(1, 40)}
    schedule = [{"step": 0, "weights": {"a": 0.5, "b": 0.5}}, {"step": 4, "weights": {"b": 1.0}}]
    original = Mixture(sources=sources, schedule=schedule).load(batch=4, seed=2).train(DataPartition())
    _take(original, 2)
    ahead = original.get_state()
    wider = Mixture(sources=sources, schedule=schedule).load(batch=8, seed=2).train(DataPartition())
    with pytest.raises(PositionMismatchError, match=r"saved by steps of 4 records, and this stream reads 8 a step"):
        wider.set_state(ahead)
    Mixture(sources=sources, schedule=schedule).load(batch=4, seed=2).train(DataPartition()).set_state(ahead)
    plain = Mixture(sources=sources, weights={"a": 0.5, "b": 0.5}).load(batch=4, seed=2).train(DataPartition())
    _take(plain, 2)
    Mixture(sources=sources, weights={"a": 0.5, "b": 0.5}).load(batch=8, seed=2).train(
        DataPartition()).set_state(plain.get_state())  # no schedule: another batch resumes as before


def test_weights_of_numpy_types_and_of_any_magnitude_are_drawn_by_their_ratios():
    """np.int64(3) was refused as not a number (its message saying a weight is a number), and weights
    near 1e-310 passed every check, then 100 over the least overflowed with a traceback."""
    from dew.data.mixture import Mixture, proportions

    sources = {"a": Tagged(0, 400), "b": Tagged(1, 400)}
    for weights in ({"a": np.int64(3), "b": np.int64(1)}, {"a": np.float32(0.75), "b": np.float32(0.25)},
                    {"a": 3e-310, "b": 1e-310}, {"a": 3.0, "b": 1.0}):
        stream = Mixture(sources=sources, weights=weights).load(batch=8, seed=0).train(DataPartition())
        drawn = np.concatenate([b["source"] for b in _take(stream, 50)])
        assert np.mean(drawn == 0) == 0.75, weights
    assert proportions([3e-310, 1e-310]) == proportions([3.0, 1.0]) == (300, 100)
    assert proportions([0.35, 0.65]) == (100, 185)  # as grain scales them: 0.65 * (100 / 0.35) = 185.71


class TestMixtureReader(DatasetReaderKit):
    """A registered token_windows source beside in-memory ones, with a schedule: resumes bitwise
    on one process and on 2 and 4, fills the keys one source lacks."""

    shares = (2, 4)
    before, after = 5, 6

    @pytest.fixture(autouse=True)
    def _text(self, tmp_path):
        (tmp_path / "a.txt").write_text(" ".join(f"line {i} of the mixed text." for i in range(80)))
        self.files = str(tmp_path / "*.txt")

    def dataset(self):
        from dew.data.mixture import Mixture

        windows = {"name": "token_windows", "files": self.files, "length": 15}
        packed = Packed(16)
        return Mixture(sources={"windows": windows, "packed": packed},
                       schedule=[{"step": 0, "weights": {"windows": 3, "packed": 1}},
                                 {"step": 6, "weights": {"windows": 1, "packed": 2}}]).load(batch=8, seed=5)


class Packed:
    """Rows of 16 ids with a loss mask and segments, as packed readers give them."""

    def __init__(self, width: int) -> None:
        self.width = width

    def records(self) -> ArrayRecords:
        ids = np.arange(40 * self.width, dtype=np.int32).reshape(40, self.width) % 200
        return ArrayRecords({"text": ids, "loss_mask": (ids % 2).astype(np.int32),
                             "segment_ids": np.full(ids.shape, 2, np.int32)})


def test_a_missing_key_is_filled_for_the_sources_without_it():
    from dew.data.mixture import Mixture

    class Windows:
        def records(self):
            return ArrayRecords({"text": np.full((30, 16), 7, np.int32)})

    stream = Mixture(sources={"w": Windows(), "p": Packed(16)}, weights={"w": 1, "p": 1}).load(
        batch=4).train(DataPartition())
    batch = next(stream)
    plain = batch["text"][:, 0] == 7
    assert plain.any() and (~plain).any()
    assert (batch["loss_mask"][plain] == 1).all() and (batch["segment_ids"][plain] == 1).all()
    assert (batch["segment_ids"][~plain] == 2).all()


def test_bad_weights_and_sources_are_named(tmp_path):
    from dew.data.errors import EmptyDatasetError
    from dew.data.mixture import Mixture, MixtureError

    sources = {"code": Tagged(0, 5), "prose": Tagged(1, 5)}
    with pytest.raises(MixtureError, match="source 'prose' has weight -0.5"):
        Mixture(sources=sources, weights={"code": 1.0, "prose": -0.5})
    with pytest.raises(MixtureError, match="name source 'poetry'"):
        Mixture(sources=sources, weights={"code": 1.0, "poetry": 1.0})
    # A source no weights name was read, tokenized and never drawn, without a word.
    with pytest.raises(MixtureError, match="source 'prose' has no weight, so it would never be drawn"):
        Mixture(sources=sources, weights={"code": 1.0})
    with pytest.raises(MixtureError, match="source 'prose' has no weight"):
        Mixture(sources=sources, schedule=[{"step": 0, "weights": {"code": 1}}, {"step": 9, "weights": {"code": 2}}])
    assert Mixture(sources=sources, weights={"code": 1.0, "prose": 0}).weights == {"code": 1.0, "prose": 0}
    assert Mixture(sources=sources, schedule=[{"step": 0, "weights": {"code": 1}},
                                              {"step": 9, "weights": {"prose": 1}}]).schedule is not None
    with pytest.raises(MixtureError, match="weights at step 10 is 0"):
        Mixture(sources=sources, schedule=[{"step": 0, "weights": {"code": 1}}, {"step": 10, "weights": {"code": 0}}])
    with pytest.raises(EmptyDatasetError, match="Mixture source 'prose' holds no records"):
        Mixture(sources={"code": Tagged(0, 5), "prose": Tagged(1, 0)}, weights={"code": 1, "prose": 1}).load(batch=2)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(EmptyDatasetError, match="Mixture source 'prose': The files"):
        Mixture(sources={"code": Tagged(0, 5), "prose": {"name": "token_windows", "files": str(tmp_path / "*.txt")}},
                weights={"code": 1, "prose": 1}).load(batch=2)
    with pytest.raises(MixtureError, match="Mixture source 'prose': dataset 'token_windows' has no field 'lenght'"):
        Mixture(sources={"code": Tagged(0, 5), "prose": {"name": "token_windows", "files": "x", "lenght": 8}},
                weights={"code": 1})
    with pytest.raises(MixtureError, match="Mixture source 'prose': No dataset named 'token_window'"):
        Mixture(sources={"code": Tagged(0, 5), "prose": {"name": "token_window"}}, weights={"code": 1})
    with pytest.raises(MixtureError, match="'code' and 'wide' give 'x' different shapes"):
        Mixture(sources={"code": Tagged(0, 5), "wide": Tagged(1, 5, width=4)},
                weights={"code": 1, "wide": 1}).load(batch=2)


def test_sources_with_different_tokenizers_are_refused_by_load_as_by_a_recipe(tmp_path):
    """Mixture.load mixed a byte-level source with a BPE one, two id spaces in one batch; only a
    recipe, which asks for the mixture's tokenizer, refused them."""
    from bpe_helpers import build_tokenizer
    from dew.data.mixture import Mixture, MixtureError

    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n" * 40)
    tokenizer = str(build_tokenizer(tmp_path / "tok") / "tokenizer.json")
    sources = {"bytes": {"name": "token_windows", "files": str(tmp_path / "a.txt"), "length": 8},
               "bpe": {"name": "token_windows", "files": str(tmp_path / "a.txt"), "length": 8,
                       "tokenizer": tokenizer}}
    with pytest.raises(MixtureError, match="Mixture sources 'bytes' and 'bpe' encode text with different tokenizers"):
        Mixture(sources=sources, weights={"bytes": 1, "bpe": 1}).load(batch=2)
    same = {**sources, "bytes": {**sources["bytes"], "tokenizer": tokenizer}}
    assert Mixture(sources=same, weights={"bytes": 1, "bpe": 1}).load(batch=2).batch == 2


def test_under_a_batch_ramp_the_schedule_switches_at_its_step_and_the_stream_reports_its_sources():
    """A ramp of 2-row batches for two steps, then 8: a schedule switching to source 1 at step 4
    switches at step 4 (counted as 2+2+8+8 = 20 records, not 4 x 8 = 32, which switched at step 5
    and mixed step 6), the ramped stream logs data/<source>/records as the plain one does (it
    dropped them), and a stream resumed mid-ramp continues with the same rows."""
    from dew.data import DataPartition, ramped
    from dew.data.mixture import Mixture

    schedule = [{"step": 0, "weights": {"code": 1}}, {"step": 4, "weights": {"prose": 1}}]
    mixture = Mixture(sources={"code": Tagged(0, 50), "prose": Tagged(1, 50)}, schedule=schedule)
    ramp = [(0, 2), (2, 8)]
    stream = ramped(mixture.load(batch=8), ramp).train(DataPartition())
    rows, reported = [], []
    for _ in range(7):
        rows.append(next(stream)["source"])
        reported.append(dict(stream.scalars()))
    assert [len(r) for r in rows] == [2, 2, 8, 8, 8, 8, 8]
    assert [int(r.sum()) for r in rows] == [0, 0, 0, 0, 8, 8, 8]  # every row from prose from step 4
    drawn = np.cumsum([[int((r == 0).sum()), int((r == 1).sum())] for r in rows], axis=0)
    assert reported == [{"data/code/records": float(a), "data/prose/records": float(b)} for a, b in drawn]
    again = ramped(mixture.load(batch=8), ramp).train(DataPartition())
    for _ in range(3):  # into the ramp's second size, one step before the switch
        next(again)
    position = again.get_state()
    resumed = ramped(mixture.load(batch=8), ramp).train(DataPartition())
    resumed.set_state(position)
    later = [next(again)["row"].tolist() for _ in range(3)]
    assert [next(resumed)["row"].tolist() for _ in range(3)] == later


def test_a_recipe_mixture_is_refused_at_load_naming_the_field_before_anything_is_built():
    """What only the mixture knows (its weights naming its own sources, a schedule's steps) is
    checked with the recipe, so `dew train --check` refuses it; it passed before, and the run
    failed once started (a schedule step 'abc' with a ValueError traceback, 2.5 truncated to 2)."""
    from dew.recipes.config import RecipeError, RunConfig

    base = ["data={name: mixture, batch: 4, sources: {code: {name: token_windows, files: x.py, length: 8}, "
            "more: {name: token_windows, files: y.py, length: 8}}}"]
    cases = {
        "data.weights={code: 1, more: -1}": r"data\.weights\.more: Mixture source 'more' has weight -1",
        "data.weights={code: 1, zzz: 1}": r"data\.weights\.zzz: The mixture's weights name source 'zzz'",
        "data.weights={code: 0, more: 0}": r"data\.weights: Every weight in the mixture's weights is 0",
        "data.weights={code: 1.0e-320, more: 1}": r"data\.weights: The mixture's weights differ by more than",
        "data.schedule=[{step: 0, weights: {code: 1}}, {step: abc, weights: {more: 1}}]":
            r"data\.schedule\.1\.step: Schedule entry 1 starts at step 'abc'; a step is a whole number",
        "data.schedule=[{step: 0, weights: {code: 1}}, {step: 2.5, weights: {more: 1}}]":
            r"data\.schedule\.1\.step: Schedule entry 1 starts at step 2\.5",
        "data.schedule=[{step: 0, weights: {code: 1}}, {step: 3, weights: 5}]":
            r"data\.schedule\.1\.weights: The mixture's weights at step 3 are 5; give a mapping",
        "data.schedule=[{step: 1, weights: {code: 1}}]": r"data\.schedule\.0\.step: .* starts at step 0",
    }
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=message):
            RunConfig.load("tiny-lm", [*base, override])
    with pytest.raises(RecipeError, match=r"data\.sources\.more: Mixture source 'more': dataset 'token_windows' "
                                          r"has no field 'lenght'"):
        RunConfig.load("tiny-lm", [*base, "data.weights={code: 1, more: 1}", "data.sources.more.lenght=8"])
    assert RunConfig.load("tiny-lm", [*base, "data.weights={code: 3, more: 1}"]).data.name == "mixture"


def test_the_trainer_logs_each_sources_records(recorder):
    """data/<source>/records reach the tracker with each logged step: the records drawn so far."""
    from dew.data.mixture import Mixture
    from dew.testing.doubles import Regression
    from dew.training import Trainer

    class Rows:
        def __init__(self, tag):
            self.tag = tag

        def records(self):
            rng = np.random.default_rng(self.tag)
            x = rng.normal(size=(32, 4)).astype(np.float32)
            return ArrayRecords({"x": x, "y": x.sum(1, keepdims=True), "tag": np.full(32, self.tag)})

    data = Mixture(sources={"a": Rows(0), "b": Rows(1)}, weights={"a": 3, "b": 1}).load(batch=8)
    Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=recorder).fit(data, steps=6, log_every=2)
    tags = np.concatenate([b["tag"] for b in _take(data.train(DataPartition()), 6)])
    for name, tag in (("a", 0), ("b", 1)):
        assert recorder.series(f"data/{name}/records") == [
            (step, float((tags[: step * 8] == tag).sum())) for step in (2, 4, 6)]


def test_dew_eval_offers_a_validation_split_only_where_the_dataset_can_hold_one_out():
    """A mixture's load takes no val_fraction: dew eval on a mixture run asked for one, and the
    recipe then refused it."""
    from dew import registry
    from dew.cli.evaluate import _val_hint

    assert "val_fraction" not in registry.declared_fields(registry.datasets.load("mixture").load)
    assert _val_hint("mixture") == "dataset 'mixture' holds none out, so "
    assert "val_fraction" in registry.declared_fields(registry.datasets.load("token_windows").load)
    assert _val_hint("token_windows") == "set data.load.val_fraction in its recipe, or "


def test_a_source_edited_in_place_since_the_position_is_refused_as_it_is_alone():
    """A mixture's position kept its sources' sizes and weights but not their contents: a source
    edited in place (as many records) was resumed over without a word, where the source alone
    is refused. The refusal names the source edited (it named none, in a mixture of three)."""
    from dew.data.mixture import Mixture
    from dew.data.stream import PositionMismatchError

    def opened(b):
        return Mixture(sources={"a": Tagged(0, 40), "b": b}, weights={"a": 0.5, "b": 0.5}).load(
            batch=4, seed=2).train(DataPartition())

    original = opened(Tagged(1, 40))
    _take(original, 2)
    position = original.get_state()
    opened(Tagged(1, 40)).set_state(position)  # the same contents: it resumes
    with pytest.raises(PositionMismatchError, match="over the mixture's source 'b' whose contents differ .*as "
                                                    "many records, other contents.* Restore the mixture's source 'b'"):
        opened(Tagged(7, 40)).set_state(position)  # b tagged otherwise: its arrays differ
    # a position saved before positions kept each source's digest: the whole's, named no further
    old = json.loads(position[len(GLOBAL_POSITION):])
    del old["parts"]
    with pytest.raises(PositionMismatchError, match="saved over data whose contents differ"):
        opened(Tagged(7, 40)).set_state(GLOBAL_POSITION + json.dumps(old).encode())
