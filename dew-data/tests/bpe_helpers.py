"""A byte-level BPE tokenizer trained here on a few sentences, with a Qwen-style chat template.

Tests build it into a folder (tokenizer.json and tokenizer_config.json) that dew's
readers and transformers' AutoTokenizer both read, so nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

# <|im_start|>role\n ... <|im_end|>\n, the assistant's content and its <|im_end|> marked as generated.
MARKED = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- message.content + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

# The same turns without markers and without the newline after each turn, so every
# assistant turn is exactly what follows the generation prompt.
UNMARKED = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
UNMARKED_AS_MARKED = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- message.content + '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message.content + '<|im_end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

SENTENCES = [
    "The user asks a question and the assistant answers it politely.",
    "What is two plus two? It is four. Thank you, you are welcome!",
    "def add(x, y): return x + y  # dew trains jax models on packed windows",
    "Documents are tokenized on the fly, packed and shuffled by block.",
]


def build_tokenizer(folder: Path, *, template: str | None = MARKED, eos: str = "<|im_end|>",
                    vocab: int = 400) -> Path:
    """Train a byte-level BPE on SENTENCES and write it, with template, into folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
