"""`dew plan`: the step of a shipped recipe compiled for a mesh on fake CPU devices, before any run.

Each plan is one `dew plan` call (which compiles in a child interpreter with the devices); its
figures are checked against what the test computes itself: the bytes of every leaf from its
shape, dtype and split, the model's size from its own initializer, the device kinds' datasheet
figures, and the leaves the layout's tolerance counts.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dew.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tools.md"
# tiny-lm with a min_shard its embedding and attention reach, so fsdp shards nearly everything.
SHARDED = ["trainer.mesh.fsdp=8", "trainer.layout.min_shard=1024"]
# The model of the key concepts page (emb 64, 2 layers, 4 heads, mlp 256, learned positions), batch 8.
KEY_CONCEPTS = ["model.emb_features=64", "model.mlp_features=256", "model.num_heads=4",
                "model.position_embedding=learned", "model.mlp_activation=gelu", "data.batch=8",
                "data.files={stdlib}/[a-b]*.py"]


def _plan(argv: list[str], capsys) -> tuple[int, dict | str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    if code == 0 and "--json" in argv:
        return code, json.loads(captured.out), captured.err
    return code, captured.out, captured.err


@cache
def _tiny_lm_parameters() -> tuple[int, dict[str, int]]:
    """tiny-lm's parameter bytes, whole, and each leaf's element count, from the model's own init."""
    import jax
    from flax import linen as nn

    from dew import models
    from dew.recipes.config import RunConfig

    config = RunConfig.load("tiny-lm")
    model = models.build(config.model.name, **config.model.fields)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(model.init(k, np.zeros((1, 8), np.int32))),
                            jax.random.key(0))
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    sizes = {jax.tree_util.keystr(path): math.prod(leaf.shape) for path, leaf in flat}
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for _, leaf in flat), sizes


def _by_hand(leaf: dict, mesh: dict[str, int]) -> int:
    """One device's bytes of a leaf: each dimension divided by the mesh axes its spec names."""
    shape = list(leaf["shape"])
    for dim, axes in enumerate(leaf["spec"]):
        for axis in axes or ():
            assert shape[dim] % mesh[axis] == 0
            shape[dim] //= mesh[axis]
    return math.prod(shape) * np.dtype(leaf["dtype"]).itemsize


@pytest.mark.slow
def test_the_plan_s_bytes_are_xla_s_and_the_shardings_and_fsdp_divides_the_parameters(capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    code, plan, err = _plan(["tiny-lm", *SHARDED, "--devices", "8", "--device-kind", "h100",
                             "--device-kind", "tpu-v5p", "--json"], capsys)
    assert code == 0, err
    assert plan["devices"] == 8 and plan["mesh"]["fsdp"] == 8
    # tiny-lm computes in float32, which the bf16 peaks of the device kinds' step times overstate
    assert any(note.startswith("the model computes in float32") for note in plan["notes"])
    # Every leaf's bytes are its shape cut by its spec, and they sum to XLA's own argument size.
    for leaf in plan["leaves"]:
        assert leaf["bytes"] == _by_hand(leaf, plan["mesh"]), leaf["path"]
    assert sum(leaf["bytes"] for leaf in plan["leaves"]) == plan["memory"]["argument"]
    totals = plan["totals"]
    assert sum(totals.values()) == plan["memory"]["argument"]
    assert plan["peak"] == (plan["memory"]["argument"] + plan["memory"]["output"] - plan["memory"]["alias"]
                            + plan["memory"]["temporaries"])
    # fsdp 8: the parameters are an eighth of the model (only the norms' scales stay whole).
    whole, sizes = _tiny_lm_parameters()
    assert whole / 8 <= totals["parameters"] <= whole / 8 * 1.02
    replicated = [leaf for leaf in plan["leaves"] if leaf["category"] == "parameters"
                  and not any(leaf["spec"])]
    assert replicated and all(sizes[leaf["path"].removeprefix(".params")] < 1024 for leaf in replicated)
    # Adam keeps two moments per parameter, split the same way, and a count.
    assert 2 * totals["parameters"] <= totals["optimizer"] <= 2 * totals["parameters"] + 64
    # The compiled step gathers every sharded weight a matmul reads at least once, whole (the
    # embedding table is read by a lookup, which needs no gather of it).
    gathered = sum(math.prod(leaf["shape"]) * 4 for leaf in plan["leaves"]
                   if leaf["category"] == "parameters" and any(leaf["spec"]) and "embed" not in leaf["path"])
    assert plan["collectives"]["all-gather"]["bytes"] >= gathered
    # Their gradients are reduce-scattered back to each device's share: the CPU compiler writes that as an
    # all-reduce each device slices, which was listed as all-reduces of the whole gradient (and no
    # reduce-scatter at all); the all-reduces left are of the norms' whole scales and the loss.
    collectives = plan["collectives"]
    assert collectives["reduce-scatter"]["bytes"] >= gathered
    assert collectives["all-reduce"]["bytes"] < 0.01 * gathered
    # The matmuls XLA runs on all 8 devices are the objective's own count of the model's FLOPs.
    assert plan["flops_per_device"] * 8 == pytest.approx(plan["model_flops"], rel=0.05)
    # The device kinds: their datasheet peak, and their memory as the driver reports it (nvidia-smi's
    # 81559 MiB for an 80 GB H100), of which JAX's GPU allocator takes 75% unless told otherwise.
    h100 = plan["device_kinds"]["NVIDIA H100 SXM (80 GB)"]
    assert h100["compute_bound_seconds"] == pytest.approx(plan["flops_per_device"] / 989e12)
    assert h100["headroom"] == int(81559 * 2**20 * 0.75) - plan["peak"]
    assert plan["device_kinds"]["TPU v5p (95 GiB)"]["headroom"] == 95 * 2**30 - plan["peak"]
    assert plan["rematerializations"] == []


def test_a_layout_that_replicates_past_its_tolerance_is_refused_with_its_leaves(capsys):
    code, _, err = _plan(["tiny-lm", "trainer.mesh.fsdp=3", "--devices", "3"], capsys)
    assert code == 2
    assert err.startswith("dew plan: LayoutError: This layout keeps")
    # Three divides none of tiny-lm's widths: every leaf the tolerance counts is whole on each device.
    _, sizes = _tiny_lm_parameters()
    counted = sorted(path for path, size in sizes.items() if size >= 2**16)
    listed = sorted(line.split()[0].removeprefix(".params") for line in err.splitlines()[1:])
    assert counted and listed == counted
    # docs/tools.md shows this refusal as it is printed.
    shown = re.search(r"```sh\ndew plan tiny-lm trainer.mesh.fsdp=3 --devices 3\n```\n\n```text\n(.*?)\n```",
                      DOCS.read_text(), flags=re.S)
    assert shown and shown.group(1) == err.rstrip("\n")
    # The refusal's way on, followed as printed, is accepted: a tolerance of 200% (whole on each of
    # three devices is three times the perfect share), above the 1.0 a "fraction" would cap it at.
    override = re.search(r"\(in a recipe, (trainer\.layout\.tolerance=[0-9.]+)\)", err.splitlines()[0])
    assert override and override.group(1) == "trainer.layout.tolerance=2", err.splitlines()[0]
    code, _, err = _plan(["tiny-lm", "trainer.mesh.fsdp=3", override.group(1), "--devices", "3"], capsys)
    # The recipe's 32 rows do not split over three devices either: said as such, with its way on.
    assert code == 2 and err.startswith("dew plan: BatchSplitError: The batch's 'text' has 32 rows, which "
                                        "do not divide over the 3 devices"), err
    assert "data.batch" in err and err.count("\n") == 1
    code, _, err = _plan(["tiny-lm", "trainer.mesh.fsdp=3", override.group(1), "data.batch=24", "--devices", "3"],
                         capsys)
    assert code == 0, err


@pytest.mark.slow
def test_each_involuntary_full_rematerialization_is_named_with_what_it_concerns(capsys):
    # fsdp 2 x tensor 2 on the key-concepts model, its embedding and attention sharded too: the
    # embedding lookup is resharded whole.
    code, plan, err = _plan(["tiny-lm", *KEY_CONCEPTS, "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2",
                             "trainer.layout.min_shard=1024", "trainer.layout.tolerance=1", "--devices", "8",
                             "--json"], capsys)
    assert code == 0, err
    named = [set(r["parameters"]) for r in plan["rematerializations"]]
    assert any(".params['params']['embed']['embedding']" in parameters for parameters in named), named
    # Stage 2 x 4 microbatches: the pipeline's microbatch activations, inside the model.
    code, text, err = _plan(["tiny-lm", *KEY_CONCEPTS, "model.scan_layers=true", "trainer.mesh.stage=2",
                             "trainer.mesh.microbatches=4", "--devices", "8"], capsys)
    assert code == 0, err
    found = [line for line in text.splitlines() if "XLA replicates it whole" in line]
    assert found and any("an activation (" in line and "in CausalTransformer" in line for line in found)
    assert "involuntary full rematerializations XLA reported: " + str(len(found)) in text


def test_a_mesh_that_does_not_divide_the_devices_is_one_line(capsys):
    code, _, err = _plan(["tiny-lm", "trainer.mesh.fsdp=3", "--devices", "8"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "= 3 devices does not divide --devices 8" in err


def test_a_device_kind_not_in_the_table_names_the_known_ones(capsys):
    code, _, err = _plan(["tiny-lm", "--devices", "8", "--device-kind", "h900"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "No device kind 'h900'" in err
    for known in ("h100", "h200", "tpu-v5p"):
        assert known in err


def test_the_recipes_xla_flags_reach_the_compile_the_plan_makes(capsys):
    """A run's process appends trainer.xla_flags to XLA_FLAGS before JAX starts; the plan's compile
    ignored them, so it planned another program than the run compiles. A flag XLA does not know shows
    they arrive: XLA refuses it as the planner's child starts, which the plan says in one line (it
    exited 1 with XLA's fatal log line alone)."""
    code, _, err = _plan(["tiny-lm", "trainer.xla_flags=[--xla_no_such_flag_dew]", "--devices", "1"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("dew plan: UnknownXlaFlagError: XLA does not know the flag(s) --xla_no_such_flag_dew")


@pytest.mark.slow
def test_a_gpu_only_attention_is_planned_with_xlas_and_says_so(capsys):
    """model.attention=cudnn cannot compile on the plan's CPU devices: the plan printed 48 lines of
    traceback ending "cuDNN is not detected". It plans XLA's attention, whose weights are the same."""
    # (cuDNN's kernel computes in bfloat16 or float16: a float32 model naming it is refused by the check)
    code, plan, err = _plan(["tiny-lm", "model.attention=cudnn", "model.dtype=bfloat16", "--devices", "1",
                             "--json"], capsys)
    assert code == 0, err
    _, plain, _ = _plan(["tiny-lm", "model.attention=xla", "model.dtype=bfloat16", "--devices", "1", "--json"],
                        capsys)
    assert any(note.startswith("cuDNN attention needs a GPU") for note in plan["notes"])
    assert plan["totals"] == plain["totals"] and plan["peak"] == plain["peak"]
    # What the GPU would refuse is refused here too: the plan approved a sequence split cuDNN cannot take.
    code, _, err = _plan(["tiny-lm", "model.attention=cudnn", "model.dtype=bfloat16", "trainer.mesh.sequence=2",
                          "--devices", "2"], capsys)
    assert code == 2 and "attention='cudnn' cannot run with the sequence split" in err, err


@pytest.mark.slow
def test_a_lora_plan_says_its_model_flops_are_a_full_fine_tunes(capsys):
    """The objective's count (6 per weight per token) is a full fine-tune's; a LoRA step computes no
    gradient of the frozen base, which XLA's own count of the compiled step shows."""
    code, plan, err = _plan(["tiny-lm-lora", "--devices", "1", "--json"], capsys)
    assert code == 0, err
    assert plan["flops_per_device"] < 0.8 * plan["model_flops"]
    assert any(note.startswith("with lora, the objective's own count of the model's FLOPs is a full fine-tune's")
               for note in plan["notes"])
