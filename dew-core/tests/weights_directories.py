"""The model directories the weights-boundary tests damage: a tiny Llama 3-style directory
written by the real transformers and peft, and the safetensors helpers that damage copies of it.
Shared by dew-core/tests/test_weights_boundary.py and tests/test_weights_commands.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def write_llama(root: Path) -> Path:
    """A tiny Llama 3-style directory transformers wrote: eos_token_id a list, a tokenizer, every
    weight redrawn; and PEFT's LoRA adapters for it (B redrawn, so they change the output)."""
    import peft
    import torch
    import transformers

    from dew.pretrained.tokenizers import byte_level

    directory = root / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False,
        bos_token_id=257, eos_token_id=[256, 258])
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0.0, 0.2)
    hf.save_pretrained(directory)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level(),
                                                     eos_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.1)
    lora.save_pretrained(root / "adapters")
    return directory


def copy_directory(good: Path, to: Path, *, adapters: bool = False) -> Path:
    source = good.parent / "adapters" if adapters else good
    shutil.copytree(source, to)
    return to


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(path)


def rewrite_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata={"format": "pt"})
