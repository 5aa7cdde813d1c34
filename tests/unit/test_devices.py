"""Device binding from the launcher's environment, and each rank's CPU share (issue 10)."""
import pytest
import torch

from petra_mpi.comm.devices import gpu_index, launcher_local_rank


# ---- device binding ---------------------------------------------------------------------------
@pytest.mark.parametrize("env,visible,fallback,want", [
    ({}, 0, None, None),                                         # no GPU
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 4, None, 3),           # Open MPI, shared GPUs
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 4, None, 1),           # more ranks than GPUs
    ({"MPI_LOCALRANKID": "2"}, 8, None, 2),                      # MPICH Hydra
    ({"SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}, 4, None, 1),  # srun, GPUs shared
    ({"PMI_LOCAL_RANK": "2"}, 4, None, 2),
    ({"PALS_LOCAL_RANKID": "1"}, 4, None, 1),
    ({"PMIX_LOCAL_RANK": "3"}, 4, None, 3),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "1"}, 2, None, 1),
    # one visible GPU (srun --gpus-per-task=1, or a per-task CUDA_VISIBLE_DEVICES): index 0
    ({"SLURM_LOCALID": "3", "SLURM_STEP_ID": "0", "SLURM_GPUS_PER_TASK": "1"}, 1, None, 0),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, None, 0),
    # srun --gpus-per-task=2: the task's own two GPUs
    ({"SLURM_LOCALID": "3", "SLURM_STEP_ID": "0", "SLURM_GPUS_PER_TASK": "2"}, 2, None, 0),
    # ...but not in the batch step (id near 2**32), where the tasks' GPUs are not bound
    ({"SLURM_LOCALID": "1", "SLURM_STEP_ID": "4294967294", "SLURM_GPUS_PER_TASK": "2"}, 2,
     None, 1),
    # mpirun inside sbatch: the MPI launcher's local rank wins over the batch step's SLURM_LOCALID
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 4, None, 2),
    ({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "3"}, 4, None, 3),
    # torchrun inside sbatch: its LOCAL_RANK, not the batch step's SLURM_LOCALID
    ({"SLURM_LOCALID": "0", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "7"}, 4, None, 1),
    # no launcher variable: MPI's node-local rank once known, else undecided with several GPUs
    ({}, 4, 2, 2),
    ({}, 4, None, None),
    ({}, 1, None, 0),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "junk"}, 4, 1, 1),
])
def test_gpu_index_from_launcher_environment(env, visible, fallback, want):
    assert gpu_index(env, visible, fallback) == want


def test_launcher_local_rank_names_its_source():
    assert launcher_local_rank({}) is None
    assert launcher_local_rank({"MPI_LOCALRANKID": "4"}) == (4, "MPI_LOCALRANKID")
    assert launcher_local_rank({"SLURM_LOCALID": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}) == \
        (0, "OMPI_COMM_WORLD_LOCAL_RANK")


def test_pick_device_cpu_and_bind_early_cpu():
    from petra_mpi.config import Config
    from petra_mpi.comm.devices import bind_early
    from petra_mpi.run.placement import pick_device
    cfg = Config()
    cfg.run.device = "cpu"
    assert pick_device(cfg, 3) == torch.device("cpu")
    assert bind_early("cpu", {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) is None


@pytest.mark.parametrize("mine,node,want", [
    ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 4, 1),                 # unbound mpirun: shared, divided
    ({0, 1, 2, 3, 4, 5, 6, 7}, [set(range(8))] * 2, 4),
    ({0, 1}, [{0, 1}, {2, 3}, {4, 5}], 2),                 # srun --cpus-per-task=2: own set
    ({5}, [{4}, {5}, {6}], 1),                             # bound to a core each
    ({0, 1, 2, 3}, [{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}], 2),  # two share one set
])
def test_cpu_share(mine, node, want):
    from petra_mpi.comm.world import cpu_share
    assert cpu_share(mine, node) == want


def test_each_rank_pins_the_network_card_next_to_its_gpu():
    """PETRA_NET_DEVICES lists a node's cards in GPU order: the rank on GPU (or node-local
    rank) i gets card i as UCX_NET_DEVICES, set before MPI starts; without the list, nothing."""
    from petra_mpi.comm.devices import bind_early, pin_net_device
    cards = "mlx5_0:1, mlx5_1:1,mlx5_2:1,mlx5_3:1"
    env = {"SLURM_LOCALID": "2", "PETRA_NET_DEVICES": cards}
    bind_early("cpu", env)
    assert env["UCX_NET_DEVICES"] == "mlx5_2:1"
    env = {"PETRA_NET_DEVICES": cards}
    assert pin_net_device(env, 1) == "mlx5_1:1" and env["UCX_NET_DEVICES"] == "mlx5_1:1"
    env = {"PETRA_NET_DEVICES": "mlx5_0:1,mlx5_0:1,mlx5_1:1,mlx5_1:1"}  # two GPUs a card
    assert [pin_net_device(env, i) for i in range(4)] == ["mlx5_0:1"] * 2 + ["mlx5_1:1"] * 2
    env = {"SLURM_LOCALID": "2", "UCX_NET_DEVICES": "mlx5_0:1"}
    bind_early("cpu", env)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"  # the site's own setting stays
