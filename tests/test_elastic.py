"""Elastic batch jobs: the layout that fits the ranks a job gets (petra_mpi.elastic), and the batch
scripts launching it with ELASTIC=1, so that a job given fewer ranks resumes on fewer stages."""
import pytest

from petra_mpi.config import load_config, validate
from petra_mpi.elastic import fit
from test_mpi import ROOT
from test_slurm import fake_commands, run_batch_script

QUICK = ROOT / "configs" / "quickstart.yaml"  # RevNet18: 10 blocks, model.stages 4


@pytest.mark.parametrize("sets,ranks,want", [
    (["model.stages=6"], 6, (6, [])),                        # fits as it is
    (["model.stages=6"], 4, (4, ["model.stages=4"])),        # a node fewer: fewer stages
    (["model.stages=0"], 12, (10, ["model.stages=10"])),     # one stage per block at most
    ([], 10, (8, ["model.stages=4"])),                       # 4 stages: 2 replicas on 8
    (["model.stages=2", "train.replicas=2"], 3, (2, ["model.stages=1"])),  # R kept
    (["model.stages=5", "model.partition=[2, 2, 2, 2, 2]"], 4,
     (4, ["model.stages=4", "model.partition=null"])),
])
def test_fit_keeps_replicas_and_cuts_stages(sets, ranks, want):
    cfg = load_config(QUICK, sets)
    used, overrides = fit(cfg, ranks)
    assert (used, overrides) == want
    validate(load_config(QUICK, [*sets, *overrides]), used)


def test_batch_script_launches_the_layout_that_fits_its_ranks(tmp_path):
    """A 6-stage run whose requeued job got 4 ranks runs 4 stages on them; 4 stages on 10 ranks
    are 2 replicas on 8 of them (srun --ntasks=8); a job whose ranks fit gets nothing added."""
    args = tmp_path / "args"
    path = fake_commands(tmp_path / "bin", srun=f'echo "$@" >{args}')
    six = {"EXTRA_ARGS": "--set model.stages=6 --set run.device=cpu", "ELASTIC": "1"}
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2", **six)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert given[-2:] == ["--set", "model.stages=4"] and "--ntasks=4" not in given, given
    assert "elastic: 4 ranks on 2 node(s): launching 4 with --set model.stages=4" in proc.stdout
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="10", EXTRA_ARGS="--set run.device=cpu",
                            ELASTIC="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert "--ntasks=8" in given and given[-2:] == ["--set", "model.stages=4"], given
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="6", **six)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert not [a for a in given if a.startswith("--ntasks")] and given[-1] == "run.device=cpu"
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="4", **{**six, "ELASTIC": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert args.read_text().split()[-1] == "run.device=cpu"  # not elastic: launched as asked
