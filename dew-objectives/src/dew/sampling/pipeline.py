"""TextGeneration: a trained causal language model as a prompt-in, text-out task.

It holds what inference needs and nothing a run needs (no optimizer state,
no counters): the model, its variables, the tokenizer, default sampling and
the token that ends a continuation. ``save`` writes it through
``Pretrained.save``, so what a run trained can be loaded by transformers, or
by ``TextGeneration.load`` later. It is the pipeline of every objective that
trains a causal language model (language modelling, fine-tuning,
distillation's student, the policy of the preference and RL objectives), and
``generate`` serves ``dew generate``.

>>> import jax, jax.numpy as jnp
>>> from dew.data import ByteTokenizer
>>> from dew.nn.backbones import CausalTransformer
>>> model = CausalTransformer(vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
...                           mlp_features=32, max_seq_len=32)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
>>> generate = TextGeneration(model, variables, ByteTokenizer())
>>> texts = generate(["dew", "jax"], max_new_tokens=5)
>>> len(texts)
2
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from dew.data.base import chat_template_of, ending_ids, eos_id_of, prompt_ids
from dew.data.tokenizers import drawable_vocab
from dew.objectives.inference import (
    Generated,
    GenerateRequest,
    Pipeline,
    UnsupportedRequestError,
    write_texts,
)
from dew.sampling.errors import PromptTooLongError
from dew.sampling.generate import Generation, generate
from dew.sampling.options import InvalidSamplingError, Sampling
from dew.sampling.text import continued
from dew.tree_summary import brief_repr

if TYPE_CHECKING:
    from flax.linen import Module

    from dew.data.chat_template import ChatTemplate
    from dew.pretrained.model import Pretrained as PretrainedModel
    from dew.typing import PyTree

__all__ = ["TextGeneration"]


def _cut(text: str, stop: Sequence[str]) -> str:
    """text up to the end of the first stop string in it (all of it without one)."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


@dataclass(frozen=True)
class TextGeneration(Pipeline):
    """Continue prompts with a causal model; each call returns one text per prompt.

    The continuation stops at stop_token (default: the tokenizer's
    end-of-document id, which is not shown), after one of the stop strings
    (which it then ends with), or after max_new_tokens, and holds only the
    new text, not the prompt. The prompts of one call are generated together
    by the generation engine (dew.sampling.Engine).
    """

    model: Module
    variables: Mapping[str, PyTree]
    tokenizer: Any
    sampling: Sampling = Sampling(temperature=0.0)
    stop_token: int | None = None

    __repr__ = brief_repr  # the variables as one line, not every array

    accepts: ClassVar[str] = "one or more text prompts to continue"
    options: ClassVar[frozenset[str]] = frozenset(
        {"count", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "stop", "chat"})

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            raise ValueError(
                "TextGeneration needs a tokenizer to turn prompts into ids, and this model has none: "
                "an exported folder holds its tokenizer.json (and tokenizer_config.json) beside "
                "config.json, so copy them there; in code, build the objective with tokenizer= (a "
                "recipe's data reader supplies one)."
            )
        from dew.pretrained import check_vocabulary

        check_vocabulary(self.tokenizer, self.model)

    @property
    def stops(self) -> tuple[int, ...]:
        """The ids that end a continuation: stop_token, else the tokenizer's end-of-document id and
        any other id its checkpoint lists (dew.data.base.stop_ids_of: Llama 3's <|eot_id|>)."""
        return ending_ids(self.stop_token, self.tokenizer)

    def tokens(self, prompts: Sequence[str], *, max_new_tokens: int = 64,
               sampling: Sampling | None = None, key: jax.Array | None = None,
               stop: Sequence[str] = (), chat: bool = False) -> Generation:
        """The token ids of prompts and their continuations, as generate returns them. A prompt is
        encoded as transformers' tokenizer(prompt) encodes it (dew.data.base.prompt_ids: Gemma's
        and Llama's beginning-of-text id first); an empty one with nothing to start it starts
        from the end-of-document id, as after a document, the way the evaluation tasks do. With
        chat, each prompt is a user turn rendered by the tokenizer's chat template with its
        generation prompt, encoded as transformers' apply_chat_template encodes it."""
        template = self._chat_template() if chat else None
        ids = [self._ids(prompt, template) for prompt in prompts]
        key = jax.random.key(0) if key is None else key
        # A stop naming a special token (Qwen's "<|im_end|>") is never in the decoded text, which
        # leaves special tokens out: it stops at the token's id instead.
        special = {text: self._special_id(text) for text in stop}
        return generate(self.model, self.variables, ids, max_new_tokens, key, sampling or self.sampling,
                        eos_id=(*self.stops, *(i for i in special.values() if i is not None)),
                        stop_strings=tuple(text for text, i in special.items() if i is None),
                        detokenize=lambda ids: self.tokenizer.decode(list(ids)),
                        vocab=drawable_vocab(self.tokenizer))

    def _special_id(self, text: str) -> int | None:
        """The id of the special token text spells (one id that decodes to nothing), else None."""
        ids = [int(i) for i in self.tokenizer.encode(text)] if text else []
        return ids[0] if len(ids) == 1 and self.tokenizer.decode(ids) == "" else None

    def _chat_template(self) -> ChatTemplate:
        template = chat_template_of(self.tokenizer)
        if template is None:
            raise UnsupportedRequestError(
                f"--chat renders each prompt with the tokenizer's chat template, but this "
                f"{type(self.tokenizer).__name__} carries none. Give the tokenizer as the folder a "
                "checkpoint ships with its template (a recipe's data.tokenizer: the folder, not its "
                "tokenizer.json), or write the prompt in the template yourself without --chat.")
        return template

    def _ids(self, prompt: str, template: ChatTemplate | None = None) -> list[int]:
        if template is not None:  # the template writes any beginning-of-text token itself
            turn = template.text([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return [int(i) for i in self.tokenizer.encode(turn)]
        ids = prompt_ids(self.tokenizer, prompt)  # a beginning-of-text id first where the tokenizer has one
        stop = eos_id_of(self.tokenizer)
        return ids or ([] if stop is None else [int(stop)])

    def __call__(self, prompts: str | Sequence[str], *, max_new_tokens: int = 64,
                 sampling: Sampling | None = None, key: jax.Array | None = None,
                 stop: Sequence[str] = (), chat: bool = False) -> str | list[str]:
        """The continuation of each prompt as text (one str for one str prompt), without the stop
        token; with chat, the reply to each prompt sent as a user turn (see ``tokens``)."""
        single = isinstance(prompts, str)
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        out = self.tokens(batch, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                          stop=stop, chat=chat)
        ended = self.stops
        decode = self.tokenizer.decode
        texts = [_cut(continued(decode, prompt, row[:-1] if row and row[-1] in ended else row), stop)
                 for prompt, row in zip(out.prompt_tokens, out.new_tokens, strict=True)]
        return texts[0] if single else texts

    def generate(self, request: GenerateRequest) -> Generated:
        """Each prompt of request continued (count times), shown as the prompt and its continuation.

        Sampling is greedy unless request sets a temperature (then the
        count continuations of a prompt differ; a count above 1 without one
        is refused, as it would repeat one text); without max_new_tokens a
        continuation is up to 64 tokens, as many as the model's max_seq_len
        leaves room for. With request.chat each prompt is a user turn in the
        tokenizer's chat template and the reply is shown alone. With
        request.out the texts are also written there, as samples.txt.
        """
        self.check(request)
        if not request.inputs:
            raise UnsupportedRequestError(f"No prompt was given: {self.describe()}.")
        count = request.count or 1
        prompts = [prompt for prompt in request.inputs for _ in range(count)]
        given = {name: getattr(request, name) for name in ("temperature", "top_k", "top_p", "min_p")
                 if getattr(request, name) is not None}  # greedy unless a temperature is given
        filters = sorted(name for name in given if name != "temperature")
        if filters and not given.get("temperature"):
            raise UnsupportedRequestError(
                f"{' and '.join(filters)} only narrow{'s' if len(filters) == 1 else ''} what sampling "
                "draws from, and without a temperature (or at 0) generation is greedy; give a "
                "temperature above 0 as well (1.0 samples from the model as it is).")
        if count > 1 and not given.get("temperature"):
            raise UnsupportedRequestError(
                f"count={count} without a temperature (or at 0) repeats one continuation {count} times: "
                "generation is greedy; give a temperature above 0 to draw different ones (1.0 samples "
                "from the model as it is), or leave count out.")
        try:
            sampling = Sampling(**{"temperature": 0.0, **given})
        except InvalidSamplingError as error:  # named as typed (--top-p), not as Sampling's field
            raise UnsupportedRequestError(f"{error.field} (--{error.field.replace('_', '-')}) must be "
                                          f"{error.wanted}, got {error.value}.") from None
        chat = bool(request.chat)
        template = self._chat_template() if chat else None
        longest = max(len(self._ids(prompt, template)) for prompt in request.inputs)
        cache = getattr(self.model, "max_seq_len", longest + 64)  # any flax Module
        room = cache - longest
        if room <= 0:
            raise PromptTooLongError(
                f"A prompt of {longest} tokens leaves no room to generate in the model's "
                f"max_seq_len={cache} tokens; shorten the prompt.")
        texts = self(prompts, max_new_tokens=request.max_new_tokens or min(64, room),
                     sampling=sampling, key=jax.random.key(request.seed), stop=request.stop, chat=chat)
        shown = tuple(texts) if chat else tuple(p + t for p, t in zip(prompts, texts, strict=True))
        return Generated(texts=shown, files=write_texts(shown, request.out), samples=len(shown))

    def usage(self, run: object) -> str:
        return f"dew generate {run} PROMPT"

    def pretrained(self) -> PretrainedModel:
        """The model, its variables and tokenizer, as Pretrained.save writes them; a stop_token (an
        RL policy's newline) goes with the tokenizer, so the export stops where this pipeline does."""
        from dew.data.base import with_stops
        from dew.pretrained import Pretrained

        stops = () if self.stop_token is None else (int(self.stop_token),)
        return Pretrained(self.model, self.variables, with_stops(self.tokenizer, stops))

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, sampling: Sampling | None = None,
             max_seq_len: int | None = None) -> TextGeneration:
        """A TextGeneration over what Pretrained.save (or transformers) wrote in directory."""
        from dew.pretrained import Pretrained

        loaded = Pretrained.load(directory, max_seq_len=max_seq_len)
        return cls(loaded.model, loaded.variables, loaded.tokenizer,
                   sampling or Sampling(temperature=0.0))
