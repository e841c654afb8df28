"""TextGeneration: a trained causal language model as a prompt-in, text-out task.

It holds what inference needs and nothing a run needs (no optimizer state,
no counters): the model, its variables, the tokenizer and default sampling.
``save`` writes it through ``Pretrained.save``, so what a run trained can be
loaded by transformers, or by ``TextGeneration.load`` later.

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
from pathlib import Path
from typing import Any

import jax

from dew.sampling.generate import Generation, generate
from dew.sampling.options import Sampling

__all__ = ["TextGeneration"]


@dataclass(frozen=True)
class TextGeneration:
    """Continue prompts with a causal model; each call returns one text per prompt.

    The continuation stops at the tokenizer's end-of-document id (or after
    max_new_tokens), and holds only the new text, not the prompt.
    """

    model: Any
    variables: Mapping[str, Any]
    tokenizer: Any
    sampling: Sampling = Sampling(temperature=0.0)

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            raise ValueError(
                "TextGeneration needs a tokenizer to turn prompts into ids; build the objective "
                "with tokenizer= (a recipe's data reader supplies one)."
            )
        from dew.pretrained import check_vocabulary

        check_vocabulary(self.tokenizer, self.model)

    def tokens(self, prompts: Sequence[str], *, max_new_tokens: int = 64,
               sampling: Sampling | None = None, key: jax.Array | None = None) -> Generation:
        """The token ids of prompts and their continuations, as generate returns them."""
        ids = [list(self.tokenizer.encode(prompt)) for prompt in prompts]
        key = jax.random.key(0) if key is None else key
        return generate(self.model, self.variables, ids, max_new_tokens, key,
                        sampling or self.sampling,
                        eos_id=getattr(self.tokenizer, "eos_id", None))  # any tokenizer: it may have none

    def __call__(self, prompts: str | Sequence[str], *, max_new_tokens: int = 64,
                 sampling: Sampling | None = None, key: jax.Array | None = None
                 ) -> str | list[str]:
        """The continuation of each prompt as text (one str for one str prompt)."""
        single = isinstance(prompts, str)
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        out = self.tokens(batch, max_new_tokens=max_new_tokens, sampling=sampling, key=key)
        texts = [self.tokenizer.decode(row) for row in out.new_tokens]
        return texts[0] if single else texts

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the model, its variables and tokenizer in their source's format (Pretrained)."""
        from dew.pretrained import Pretrained

        return Pretrained(self.model, self.variables, self.tokenizer).save(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, sampling: Sampling | None = None,
             max_seq_len: int | None = None) -> TextGeneration:
        """A TextGeneration over what Pretrained.save (or transformers) wrote in directory."""
        from dew.pretrained import Pretrained

        loaded = Pretrained.load(directory, max_seq_len=max_seq_len)
        return cls(loaded.model, loaded.variables, loaded.tokenizer,
                   sampling or Sampling(temperature=0.0))
