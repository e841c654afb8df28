"""The addition task's forms: labelled answers for KTO, and validation splits of what training never sees."""

from __future__ import annotations

import pytest

from dew.data.addition import Addition


def _answers(columns, key: str) -> list[tuple[int, int, int]]:
    """(a, b, the answer written) for each row of a column of sequences."""
    out = []
    for row in columns[key]:
        text = bytes(int(x) for x in row if x).decode().strip()
        problem, answer = text.split("=")
        a, b = problem.split("+")
        out.append((int(a), int(b), int(answer)))
    return out


def test_labelled_answers_are_right_exactly_when_labelled_desirable():
    columns = Addition(form="labelled", problems=200, max_operand=9).records().columns
    rows = _answers(columns, "completion")
    assert [int(a + b == c) for a, b, c in rows] == columns["label"].tolist()
    assert 0.35 < columns["label"].mean() < 0.65
    for i, (mask, length) in enumerate(zip(columns["completion_mask"], columns["prompt_length"], strict=True)):
        assert mask[:length].sum() == 0 and mask[length] == 1  # the mask starts where the answer does
        assert bytes(int(x) for x in columns["completion"][i][mask > 0]).decode().endswith("\n")


def _problems(columns) -> set[tuple[str, ...]]:
    return {tuple(bytes(p[:n]).decode()[:-1].split("+"))
            for p, n in zip(columns["prompt"], columns["prompt_length"], strict=True)}


def test_held_out_problems_never_reach_training():
    reader = Addition(form="prompts", problems=500, max_operand=9, held_out=0.2, val_problems=400)
    train, val = _problems(reader.records().columns), _problems(reader.val_records().columns)
    assert len(val) == 20 and len(train) == 80 and not train & val
    # The same problems are held out whatever the seed of the draws.
    other = Addition(form="prompts", problems=500, max_operand=9, held_out=0.2, val_problems=400, problem_seed=3)
    assert _problems(other.val_records().columns) == val


@pytest.mark.parametrize("misses", ["near", "any"])
def test_held_out_near_misses_appear_only_in_validation(misses):
    reader = Addition(form="pairs", max_operand=9, misses=misses, held_out_misses=(-2, 2))
    train = [c - (a + b) for a, b, c in _answers(reader.records().columns, "rejected")]
    val = [c - (a + b) for a, b, c in _answers(reader.val_records().columns, "rejected")]
    assert set(val) <= {-2, 2} and not {-2, 2} & set(train) and 0 not in train
    assert all(a + b == c for a, b, c in _answers(reader.records().columns, "chosen"))
    assert (max(map(abs, train)) > 3) == (misses == "any")
    with pytest.raises(ValueError, match="held_out_misses"):
        Addition(form="prompts", held_out_misses=(2,))


def test_nothing_held_out_means_near_misses_and_no_validation_split():
    reader = Addition(form="pairs", max_operand=9)
    assert reader.val_records() is None and reader.load(batch=4).val is None
    rows = _answers(reader.records().columns, "rejected")
    assert all(0 < abs(c - a - b) <= 3 for a, b, c in rows)


def test_calculator_writes_a_share_of_the_problems_as_tool_episodes_in_windows_that_start_at_a_problem():
    plain = Addition(form="text", max_operand=9, length=24).records().columns["text"]
    mixed = Addition(form="text", max_operand=9, length=24, calculator=0.5).records().columns["text"]
    texts = [bytes(row.tolist()).decode() for row in mixed]
    calls = 0
    for text in texts:  # the question, then the tool's episode or the answer at once
        question, rest = text.split("=", 1)
        total = sum(map(int, question.split("+")))
        if rest.startswith("calc("):
            calls += 1
            assert rest.startswith(f"calc({question}={total}\n{question}={total}\n")
        else:
            assert rest.startswith(f"{total}\n")
    assert 0.4 < calls / len(texts) < 0.6
    # the same problems in the same order as the plain lines, which calculator=0 leaves as they were
    assert [t.split("=")[0] for t in texts] == [bytes(r.tolist()).decode().split("=")[0] for r in plain]
    for wrong in ({"form": "prompts", "calculator": 0.5}, {"calculator": 1.5}):
        with pytest.raises(ValueError, match="calculator"):
            Addition(**wrong)
