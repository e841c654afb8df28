"""Small checkpoints of each family, written by ``transformers`` itself (nothing is downloaded).

``python -m dew.families.examples qwen3 checkpoints/qwen3-tiny`` builds the
family's ``tiny`` preset as transformers' own model class, with
transformers' own random initialization, and saves it with
``save_pretrained`` beside a small byte-level tokenizer carrying the
family's special tokens and chat template. It is the directory a real
checkpoint would be (``Qwen/Qwen3-0.6B`` from the hub, say): the recipes
``qwen3-sft`` and ``gemma-grpo`` start from it, and a user starts them from a
real checkpoint by pointing ``init.pretrained`` at its directory and setting
the model's ``preset`` to its size.

transformers and torch are needed here only (``pip install transformers
torch``); dew itself never imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flax.linen import Module

__all__ = ["SPECIALS", "TEMPLATES", "redraw", "tokenizer", "write_checkpoint"]

# Each family's special tokens: (bos, eos, pad, the chat turn markers).
SPECIALS: Mapping[str, dict[str, Any]] = {
    "llama": {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>",
              "turn": ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"]},
    "mistral": {"bos": "<s>", "eos": "</s>", "pad": "<unk>", "turn": ["[INST]", "[/INST]"]},
    "qwen": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "turn": ["<|im_start|>"]},
    "gemma": {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>",
              "turn": ["<start_of_turn>", "<end_of_turn>"]},
    "phi": {"bos": "<s>", "eos": "<|end|>", "pad": "<|endoftext|>",
            "turn": ["<|user|>", "<|assistant|>", "<|system|>"]},
    "olmo": {"bos": None, "eos": "<|endoftext|>", "pad": "<|pad|>",
             "turn": ["<|user|>", "<|assistant|>"]},
    "deepseek": {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "pad": "<｜▁pad▁｜>",
                 "turn": ["<｜User｜>", "<｜Assistant｜>"]},
}

# Chat templates in each family's published style (jinja, as tokenizer_config.json holds them).
TEMPLATES: Mapping[str, str] = {
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
              "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
                "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
                "{% endfor %}"),
    "qwen": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
              "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}"),
    "phi": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "olmo": ("{{ bos_token or '' }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
             "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "deepseek": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>"
                 "{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
}

_STYLE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen", "qwen3": "qwen", "gemma": "gemma",
          "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi", "olmo2": "olmo", "mixtral": "mistral",
          "qwen2_moe": "qwen", "qwen3_moe": "qwen", "deepseek_v3": "deepseek"}

# A few merges over GPT-2's byte characters, so the tokenizer is a real BPE, not bytes alone.
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"),
           ("o", "n"), ("r", "e"), ("Ġ", "s"), ("Ġ", "w"), ("a", "t"), ("i", "s"), ("Ġ", "p"),
           ("Ġp", "l"), ("Ġpl", "us"), ("u", "s"), ("Ġi", "s")]


def tokenizer(family: str) -> Any:
    """A transformers fast tokenizer in family's style: byte-level BPE, its specials, its template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from dew.pretrained.tokenizers import _byte_characters

    style = _STYLE[family]
    specials = SPECIALS[style]
    vocab = {character: byte for byte, character in _byte_characters().items()}
    merges = []
    for left, right in _MERGES:
        if left not in vocab:
            vocab[left] = len(vocab)
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
        if right not in vocab:
            vocab[right] = len(vocab)
        merges.append((left, right))
    inner = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    tokens = [t for t in (specials["bos"], specials["eos"], specials["pad"], *specials["turn"]) if t]
    inner.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(tokens)])
    if specials["bos"]:  # Llama, Mistral, Gemma and Phi put a bos in front of every text
        bos = specials["bos"]
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, inner.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=specials["bos"],
                                   eos_token=specials["eos"], pad_token=specials["pad"],
                                   chat_template=TEMPLATES[style], clean_up_tokenization_spaces=False)


def _classes(family_name: str) -> tuple[Any, Any]:
    import transformers

    from dew.families import family

    model_class = getattr(transformers, family(family_name).architecture)
    return model_class.config_class, model_class


def redraw(model: Module, seed: int = 0) -> None:
    """Draw every weight of a torch model again, norm scales and biases far from their defaults.

    Norm weights land in [0.5, 1.5) (so a norm that should scale by ``1 + w``
    differs from one scaling by w), biases around 0 with spread 0.3, every
    other weight normal with spread 0.1: a missing offset, bias or norm moves
    the logits far past any rounding.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    # DeepSeek-V3's score-correction bias is a stored buffer, not a parameter: drawn as a bias.
    stored = [(name, buffer) for name, buffer in model.named_buffers() if name.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for name, parameter in [*model.named_parameters(), *stored]:
            shape = parameter.shape
            if "norm" in name:
                values = 0.5 + torch.rand(shape, generator=generator)
            elif name.endswith((".bias", "_bias")):
                values = 0.3 * torch.randn(shape, generator=generator)
            else:
                values = 0.1 * torch.randn(shape, generator=generator)
            parameter.copy_(values.to(parameter.dtype))


def write_checkpoint(family_name: str, directory: str | os.PathLike[str], *, preset: str = "tiny",
                     overrides: Mapping[str, Any] | None = None, seed: int = 0,
                     redrawn: bool = False, dtype: str = "float32",
                     max_shard_size: str | None = None) -> Path:
    """Save family_name's preset as transformers builds it (its own random init, or every weight
    redrawn), with its family's tokenizer, into directory; return the directory."""
    import torch

    from dew.families import family

    config_class, model_class = _classes(family_name)
    fields = {**family(family_name).preset(preset), **dict(overrides or {})}
    tok = tokenizer(family_name)
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(v) for k, v in
           (("bos", tok.bos_token), ("eos", tok.eos_token), ("pad", tok.pad_token)) if v}
    config = config_class(**{**ids, **fields})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if redrawn:
        redraw(model, seed)
    model = model.to(getattr(torch, dtype))
    target = Path(directory)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(target, **extra)
    tok.save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> int:
    from dew.families import FAMILIES

    parser = argparse.ArgumentParser(
        prog="python -m dew.families.examples",
        description="Write a small checkpoint of a family with transformers' own random "
                    "initialization, as the directory a published checkpoint would be.")
    parser.add_argument("family", choices=list(FAMILIES))
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--preset", default="tiny", help="the family preset to build (default tiny)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        written = write_checkpoint(args.family, args.out, preset=args.preset, seed=args.seed)
    except ImportError as error:
        print(f"dew.families.examples needs transformers and torch ({error.name} is missing): "
              "pip install transformers torch", file=sys.stderr)
        return 2
    config = json.loads((written / "config.json").read_text())
    print(f"Wrote a {config['architectures'][0]} ({args.preset}) to {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
