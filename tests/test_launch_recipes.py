"""dew launch over a shipped recipe: the sbatch script and the refusal outside a pool (they need the objectives and data distributions)."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from dew.cli import main
from test_launch_manifest import _printed  # every test folder is on sys.path (conftest.py)


def test_the_sbatch_script_is_valid_bash_and_its_srun_line_joins_the_pool(tmp_path, capsys, monkeypatch):
    text = _printed(["--print", "slurm", "-n", "8", "--per-node", "4", "tiny-lm", "trainer.steps=9"], capsys)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=4\n" in text
    assert "#SBATCH --ntasks=8\n" in text  # sbatch refuses --gpus-per-task without a task count
    assert "#SBATCH --signal=TERM@" in text and "#SBATCH --requeue\n" in text
    srun = shlex.split(next(line for line in text.splitlines() if line.startswith("srun ")))
    command = srun[srun.index("dew") + 1:]
    for name, value in {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[3-4]",
                        "SLURM_JOB_ID": "77"}.items():
        monkeypatch.setenv(name, value)
    assert main([*command, "--check"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("rank 6: ")
    assert f"JAX_COORDINATOR_ADDRESS=gpu3:{77 + 61440}" in line and "JAX_NUM_PROCESSES=8" in line
    assert line.endswith("train tiny-lm trainer.steps=9 trainer.multi_host=true")


def test_launch_outside_any_pool_says_how_to_start_one(capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "JAX_COORDINATOR", "JOB_COMPLETION")):
            monkeypatch.delenv(name)
    assert main(["launch", "tiny-lm", "--check"]) == 2
    err = capsys.readouterr().err
    assert "-n N" in err and "--print slurm" in err
    assert main(["launch", "tiny-lm", "no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, said", [
    ("--port", "99999", "99999 is not a port (1 to 65535)"),
    ("--grace", "-5", "-5 is not at least 0 seconds"),
    ("--connect-timeout", "0", "0 is not more than 0 seconds"),
])
def test_a_port_or_a_wait_that_cannot_be_is_refused_before_a_rank_starts(option, value, said, capsys):
    """A port past 65535 failed in rank 0's bind with a traceback; a negative grace killed the pool at
    the first SIGTERM, without its checkpoint."""
    from dew.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["launch", "-n", "2", option, value, "tiny-lm", "--check"])
    assert ended.value.code == 2
    assert f"argument {option}: {said}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["-n", "2", "--per-node", "2"], "--per-node shapes the job `--print slurm` writes, and this launch starts its ranks itself"),
    (["-n", "2", "--image", "r/dew:1"], "--image shapes the job `--print jobset` writes, and this launch starts its ranks"),
    (["--print", "jobset", "-n", "4", "--per-node", "2"], "--per-node shapes the job `--print slurm` writes, and this "
                                                          "launch prints 'jobset'"),
    (["-n", "2", "--gpus-per-process", "1"], "--gpus-per-process shapes the jobs `--print jobset` and "
                                             "`--print slurm` write, and this launch starts its ranks itself"),
])
def test_a_cluster_jobs_option_where_it_changes_nothing_is_refused(argv, said, capsys):
    """--per-node, --image and --gpus-per-process were taken and ignored by a local pool (and the first two
    by the other printed job)."""
    from dew.cli import main

    assert main(["launch", *argv, "tiny-lm", "--check"]) == 2
    assert said in capsys.readouterr().err


def test_a_printed_job_notes_a_checkpoint_folder_named_anew_at_every_start(capsys):
    """--requeue (slurm) and a JobSet's restarts resume from the run's checkpoints, but a shipped recipe's
    runs/NAME/{timestamp} is a new folder at every start: a requeued job trained from step 0, unsaid."""
    for kind in (["slurm"], ["jobset", "--image", "reg/dew:1"]):
        assert main(["launch", "--print", *kind, "-n", "2", "tiny-lm"]) == 0
        err = capsys.readouterr().err
        assert "trainer.checkpoint_dir=runs/tiny-lm/{timestamp} names a new folder at every start, so a restarted " \
               "job would train from step 0" in err, err
        assert main(["launch", "--print", *kind, "-n", "2", "tiny-lm", "trainer.checkpoint_dir=/shared/runs/lm"]) == 0
        assert capsys.readouterr().err == ""


def test_a_newline_in_an_override_keeps_both_printed_files_whole(tmp_path, capsys):
    """The written-by comment put a prompt's newline on a line of its own: bash read the rest as a
    command (so sbatch ignored every #SBATCH line after it), and the manifest was no longer YAML."""
    import yaml

    prompt = "objective.prompt=def f(x):\n    return"
    text = _printed(["--print", "slurm", "-n", "2", "tiny-lm", "trainer.checkpoint_dir=/shared/x", prompt], capsys)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith("#"))
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])  # every directive before it
    srun = shlex.split(text[text.index("\nsrun ") + 1:])  # the quoted newline spans two lines
    assert srun[-1] == prompt
    manifest = yaml.safe_load(_printed(["--print", "jobset", "-n", "2", "tiny-lm", "trainer.checkpoint_dir=/shared/x",
                                        prompt], capsys))
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][-1] == prompt


def test_a_grace_past_slurms_longest_signal_is_refused(capsys):
    assert main(["launch", "--print", "slurm", "-n", "2", "--grace", "65505", "tiny-lm",
                 "trainer.checkpoint_dir=/shared/x"]) == 0
    assert "#SBATCH --signal=TERM@65535\n" in capsys.readouterr().out
    assert main(["launch", "--print", "slurm", "-n", "2", "--grace", "70000", "tiny-lm",
                 "trainer.checkpoint_dir=/shared/x"]) == 2
    assert "give --grace at most that" in capsys.readouterr().err


def test_a_jobset_of_a_recipe_file_says_the_file_must_be_in_each_pod(tmp_path, capsys):
    from dew.recipes.config import shipped

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(shipped()["tiny-lm"].read_text())
    assert main(["launch", "--print", "jobset", "-n", "2", str(recipe), "trainer.checkpoint_dir=/shared/x"]) == 0
    assert f"each pod runs the recipe file {recipe} inside its container" in capsys.readouterr().err
    assert main(["launch", "--print", "jobset", "-n", "2", "tiny-lm", "trainer.checkpoint_dir=/shared/x"]) == 0
    assert "inside its container" not in capsys.readouterr().err


@pytest.mark.parametrize("asked", ["6", None])
def test_the_sbatch_scripts_cpus_per_task_reaches_its_ranks(tmp_path, capsys, asked):
    """The script asked no CPUs and passed none on: Slurm's default gives each rank one CPU, and
    since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task, so a line the user added
    bound every rank to one core anyway. The script hands it to srun (SRUN_CPUS_PER_TASK)."""
    text = _printed(["--print", "slurm", "-n", "2", "tiny-lm"], capsys)
    assert "--cpus-per-task=C" in text  # the comment says how to ask for more
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"  # what srun would be given: its environment's CPU request
    srun.write_text('#!/bin/bash\necho "srun cpus=${SRUN_CPUS_PER_TASK:-unset}"\n')
    srun.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SRUN_"))}
    environment["PATH"] = f"{bin_dir}{os.pathsep}{environment['PATH']}"
    if asked is not None:  # what sbatch sets in the batch shell for a --cpus-per-task line
        environment["SLURM_CPUS_PER_TASK"] = asked
    done = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"srun cpus={asked or 'unset'}"
