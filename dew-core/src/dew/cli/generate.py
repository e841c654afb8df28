"""``dew generate RUN [INPUT...]``: samples from a trained run or an exported model.

What INPUT means is the run's pipeline's to say: prompts to continue (a
language model, the policy of a preference or RL run), prompts to start from
(masked and block diffusion), class labels to draw (a class-conditional
image or video model; none for unconditional samples). Texts are printed;
images are written as a PNG grid (and one PNG each), videos as GIFs, under
--out, and the command says where. An input or option the pipeline cannot
take is refused in one line saying what it takes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument, positive

    add_run_argument(parser)
    parser.add_argument("inputs", nargs="*", metavar="INPUT",
                        help="prompts, or class labels: what the run's model takes (none: "
                             "unconditional samples)")
    parser.set_defaults(_trailing="inputs")  # inputs after an option are inputs too (dew.cli.main)
    parser.add_argument("--count", type=positive, default=None,
                        help="samples per input (or in all, without inputs)")
    parser.add_argument("--steps", type=positive, default=None, help="sampler steps (diffusion)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="classifier-free guidance scale (a conditional diffusion model)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the folder samples are written to (images default to ./samples)")
    parser.add_argument("--max-new-tokens", type=positive, default=None,
                        help="new tokens per prompt at most (default: 64, or as many as the "
                             "model's length leaves)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 (the default) picks the likeliest token")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens less likely than this share of the likeliest")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", type=_stop_text,
                        help="end a continuation after this text (repeatable)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user turn in the tokenizer's chat template and print the "
                             "reply alone (a model tuned on chats)")
    parser.add_argument("--step", type=int, default=None, help="a kept step of the run (default newest)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, refuse_run_folder, refused
    from dew.objectives.inference import GenerateRequest, SampleWriteError
    from dew.recipes.opening import open_run

    try:
        if args.out is not None:
            refuse_run_folder(Path(args.out), "--out", "the samples")
        request = GenerateRequest(tuple(args.inputs), count=args.count, steps=args.steps,
                          guidance=args.guidance, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, stop=tuple(args.stop), chat=args.chat or None, seed=args.seed,
                          out=args.out)
        made = open_run(args.run, step=args.step).pipeline().generate(request)
    except Exception as error:
        if not expected(error):
            raise
        if isinstance(error, SampleWriteError) and error.texts:  # generated, then not written: shown
            _show(error.texts)
        return refused("generate", error)
    if made.texts:
        _show(made.texts)
    if made.files:
        folder = made.files[0].parent
        print(f"Wrote {made.samples} sample(s) to {folder}: {made.files[0].name}"
              + (f" (all of them) and {len(made.files) - 1} file(s) more, one each"
                 if len(made.files) > 1 else ""))
    return 0


def _show(texts: tuple[str, ...]) -> None:
    several = len(texts) > 1 and any("\n" in text for text in texts)
    print("\n---\n".join(texts) if several else "\n".join(texts))


def _stop_text(text: str) -> str:
    """An argparse type: a stop text of at least one character (an empty one would end every continuation
    before its first token)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty text would end every continuation at once; give the text a "
                                         "continuation ends after")
    return text
