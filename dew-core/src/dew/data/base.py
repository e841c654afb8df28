"""A dataset is a pair of iterator factories, opened per process share.

``Dataset.train(partition)`` opens an endless stream of this process's rows
of each global batch; ``Dataset.val(partition)`` one pass, then stops. An
iterator that also has ``get_state() -> bytes`` and ``set_state(bytes)`` lets
a checkpoint resume the stream where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from dew.data.chat_template import ChatTemplate

__all__ = [
    "GLOBAL_POSITION", "PROMPT_GIVEN", "SINGLE", "Accounted", "Batch", "Closable", "Consumption", "DataPartition", "Dataset", "EosTokenizer",
    "NamesSpecialTokens", "NamesStops", "Reader", "Reporting", "Resumable", "SetsStops", "ShipsChatTemplate", "SpellsSpecialTokens", "StartsSequences",
    "TextReader",
    "Tokenizer", "WithEos", "WithVocabSize", "chat_template_of", "close_if_closable", "ending_ids", "eos_id_of",
    "is_global_position", "listed_ids", "prefix_of", "prompt_ids", "stop_ids_of", "verbatim_text", "vocab_size_of",
    "with_stops",
]

Batch = Mapping[str, Any]

PROMPT_GIVEN = "prompt_given"
"""The column a prompt travels under beside its ids as the records gave it (its JSON, as text: a
string, or chat messages), so a reward model of another tokenizer reads the prompt rather than the
policy's rendering of it (its chat template's markers, its beginning-of-text token)."""


@dataclass(frozen=True)
class DataPartition:
    """Which share of every global batch this process reads.

    The global batch's rows split into ``shares`` equal shares; this process
    reads share ``share``. Several processes can hold the same rows (for
    example when only the tensor axis crosses processes): they are the
    share's ``readers`` and this process is reader number ``reader``.
    """

    share: int = 0
    shares: int = 1
    reader: int = 0
    readers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.share < self.shares:
            raise ValueError(f"DataPartition.share must lie in [0, {self.shares}), got {self.share}.")
        if not 0 <= self.reader < self.readers:
            raise ValueError(f"DataPartition.reader must lie in [0, {self.readers}), got {self.reader}.")

    def rows(self, batch: int) -> int:
        """Rows of a global batch of size batch that this share holds."""
        if batch % self.shares:
            raise ValueError(
                f"A global batch of {batch} rows does not divide among {self.shares} data "
                f"shares; choose a batch that is a multiple of {self.shares}."
            )
        return batch // self.shares


SINGLE = DataPartition()

Reader = Callable[[DataPartition], Iterator[Batch]]


@runtime_checkable
class Resumable(Protocol):
    """An iterator that can report and restore its position as bytes."""

    def get_state(self) -> bytes: ...

    def set_state(self, state: bytes) -> None: ...


@dataclass(frozen=True)
class Consumption:
    """The records of one global batch: where they lie in the stream's global order, and which they are.

    first and end bound the batch's positions in the endless global order
    (records consumed before it, and after it); records holds the record
    ids at those positions (indices into the source), in order; order names
    what fixes that order (a seed and the source's size, say), so two runs
    that read the same positions of different orders can be told apart.
    """

    first: int
    end: int
    records: np.ndarray  # an int64 array of end - first record ids
    order: Mapping[str, object]


@runtime_checkable
class Accounted(Protocol):
    """A training stream that says which global records its last batch held (for the run's ledger).

    Every share of a global batch reports the whole global batch, so the
    process that journals it needs no other process's word.
    """

    def consumption(self) -> Consumption:
        """The records of the global batch the last ``next()`` returned this process's rows of."""
        ...


@runtime_checkable
class Reporting(Protocol):
    """A training stream with scalars to log beside each step's metrics.

    The trainer reads ``scalars()`` once a step's batch is made (after the
    rollout, which may have drawn further batches: ``Refilling``) and logs
    them with that step (a mixture's ``data/<source>/records``, say). They
    describe the stream up to and including those batches, so they must be a
    function of the stream's position alone, the same on every process.
    """

    def scalars(self) -> Mapping[str, float]: ...


@runtime_checkable
class Closable(Protocol):
    """An iterator that holds something to let go of (files, worker processes) until closed."""

    def close(self) -> None: ...


def close_if_closable(iterator: object) -> None:
    """Close iterator when it is Closable; any other iterator holds nothing to let go of."""
    if isinstance(iterator, Closable):
        iterator.close()


@runtime_checkable
class Tokenizer(Protocol):
    """What dew asks of a tokenizer: text to ids, and ids back to text."""

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class SpellsSpecialTokens(Protocol):
    """A tokenizer that can spell ids as text with its special tokens kept (a chat template's
    markers), where decode leaves them out: the prompt a policy saw, as a reward reads it."""

    def decode_verbatim(self, ids: Sequence[int]) -> str: ...


def verbatim_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text ids spell with special tokens kept (SpellsSpecialTokens), else the tokenizer's decode."""
    return tokenizer.decode_verbatim(ids) if isinstance(tokenizer, SpellsSpecialTokens) else tokenizer.decode(ids)


@runtime_checkable
class WithEos(Protocol):
    """A tokenizer that names its end-of-document id (dew's own do; a library's may not)."""

    @property
    def eos_id(self) -> int | None: ...


@runtime_checkable
class WithVocabSize(Protocol):
    """A tokenizer that says how many ids it has (dew's own do; a library's may not)."""

    @property
    def vocab_size(self) -> int: ...


class EosTokenizer(Tokenizer, Protocol):
    """A tokenizer with an end-of-document id: what dew's text readers encode with (ByteTokenizer, HFTokenizer)."""

    @property
    def eos_id(self) -> int: ...


def eos_id_of(tokenizer: object) -> int | None:
    """The tokenizer's end-of-document id, None when it declares none."""
    return tokenizer.eos_id if isinstance(tokenizer, WithEos) else None


@runtime_checkable
class ShipsChatTemplate(Protocol):
    """A tokenizer that carries the chat template its folder ships (a published instruct model's),
    which renders a conversation as the text the model was tuned on."""

    @property
    def chat_template(self) -> ChatTemplate | None: ...


@runtime_checkable
class NamesSpecialTokens(Protocol):
    """A tokenizer that knows the special tokens (bos, eos, pad, unk) its folder names."""

    @property
    def special_tokens(self) -> Mapping[str, str]: ...


def chat_template_of(tokenizer: object) -> ChatTemplate | None:
    """The tokenizer's chat template (ShipsChatTemplate), None when it carries none."""
    return tokenizer.chat_template if isinstance(tokenizer, ShipsChatTemplate) else None


@runtime_checkable
class NamesStops(Protocol):
    """A tokenizer that names ids besides its eos_id that end a continuation: the rest of a
    checkpoint's eos_token_id list (Llama 3's <|eot_id|> beside <|end_of_text|>, Qwen's
    <|im_end|> beside <|endoftext|>), as transformers' generate stops at any of them."""

    @property
    def stop_ids(self) -> tuple[int, ...]: ...


def stop_ids_of(tokenizer: object) -> tuple[int, ...]:
    """Every id that ends a continuation: the end-of-document id first, then the tokenizer's
    other stop ids (NamesStops), each once; () when it names none."""
    eos = eos_id_of(tokenizer)
    named = [*([] if eos is None else [eos]), *(tokenizer.stop_ids if isinstance(tokenizer, NamesStops) else ())]
    return tuple(dict.fromkeys(int(i) for i in named))


def listed_ids(*listed: object) -> list[int]:
    """The token ids listed (each an id, or a list of them, as eos_token_id is in a checkpoint's
    config), in order; what is not a non-negative integer id is left out.

    >>> listed_ids(2, [7, 8], None, True, -1)
    [2, 7, 8]
    """
    ids = [i for value in listed for i in (value if isinstance(value, list | tuple) else [value])]
    return [int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


@runtime_checkable
class SetsStops(Protocol):
    """A tokenizer that can name further ids that end a continuation (HFTokenizer, ByteTokenizer)."""

    def stopping_at(self, *listed: object) -> Any: ...


def with_stops(tokenizer: Any, stops: Sequence[int]) -> Any:
    """tokenizer, also ending continuations at stops (a pipeline's stop token, kept by an export);
    a tokenizer that cannot name stops is returned as it is."""
    return tokenizer.stopping_at(list(stops)) if stops and isinstance(tokenizer, SetsStops) else tokenizer


def ending_ids(stop_token: int | None, tokenizer: object) -> tuple[int, ...]:
    """The ids that end a generated continuation: stop_token when one is given (a recipe's), else
    every end id the tokenizer names (stop_ids_of; () for none or no tokenizer)."""
    return (int(stop_token),) if stop_token is not None else stop_ids_of(tokenizer)


@runtime_checkable
class StartsSequences(Protocol):
    """A tokenizer whose own convention starts every sequence with some ids (a beginning-of-text
    id: the post-processor of Llama's and Gemma's tokenizer.json), as transformers'
    ``tokenizer(text)`` adds them; ``encode`` itself adds nothing."""

    @property
    def prefix(self) -> tuple[int, ...]: ...


def prefix_of(tokenizer: object) -> list[int]:
    """The ids the tokenizer starts a sequence with (StartsSequences), [] when it declares none."""
    return [int(i) for i in tokenizer.prefix] if isinstance(tokenizer, StartsSequences) else []


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of text as the start of a sequence: the tokenizer's prefix (StartsSequences), then
    the text's own ids, as transformers encodes a prompt. A model published with a
    beginning-of-text id (Gemma, Llama) is only itself after it. A text that spells the prefix
    already (a prompt as a rollout hands it to a reward, special tokens written out) keeps its
    one: a second would be a sequence the model never saw.

    >>> from dew.data import ByteTokenizer
    >>> prompt_ids(ByteTokenizer(), "hi")
    [104, 105]
    """
    prefix, own = prefix_of(tokenizer), [int(i) for i in tokenizer.encode(text)]
    return own if prefix and own[:len(prefix)] == prefix else prefix + own


def vocab_size_of(tokenizer: object) -> int | None:
    """How many ids the tokenizer has, None when it does not say."""
    return tokenizer.vocab_size if isinstance(tokenizer, WithVocabSize) else None


@runtime_checkable
class TextReader(Protocol):
    """A dataset reader that encodes text: it says with which tokenizer.

    A recipe hands that tokenizer to an objective that takes one, so the
    model's vocabulary and the data's always agree.
    """

    def text_tokenizer(self) -> Tokenizer:
        """The tokenizer (``encode``, ``decode`` and usually ``vocab_size``) this reader uses."""
        ...


@dataclass(frozen=True)
class Dataset:
    """Where batches come from: train and val factories, record count, global batch.

    records is the number of training examples (None when unknown or
    endless) and batch the global batch size, in rows. ramp holds the
    ``(step, batch)`` pairs a batch ramp follows (``dew.data.ramped``), from
    step 0; empty when every batch has ``batch`` rows. The trainer accepts
    one batch shape per size the ramp names.
    """

    train: Reader
    val: Reader | None = None
    records: int | None = None
    batch: int = 1
    ramp: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not callable(self.train):
            raise TypeError("Dataset.train must be a function partition -> iterator of batches.")
        if self.val is not None and not callable(self.val):
            raise TypeError("Dataset.val must be None or a function partition -> iterator of batches.")
        if self.batch < 1:
            raise ValueError(f"Dataset.batch must be at least 1, got {self.batch}.")

    @property
    def steps_per_epoch(self) -> int | None:
        return None if self.records is None else max(1, self.records // self.batch)


# A position that begins with this prefix counts records of the whole global
# stream, so any share at any process count can read it (train_stream's
# positions do). Any other position belongs to the share that saved it.
GLOBAL_POSITION = b"dew-global-position:"


def is_global_position(position: bytes | None) -> bool:
    """Whether a saved data position is readable by every share."""
    return position is not None and position.startswith(GLOBAL_POSITION)
