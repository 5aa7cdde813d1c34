"""Parameter and stage counts of the six models (paper Table 2), and shapes through the blocks."""
import pytest
import torch

from petra_mpi.models import NetSpec, build_blocks, count_parameters, num_blocks
from petra_mpi.core.partition import balanced_partition, block_costs
from petra_mpi.core.planner import plan_layout

TABLE2 = {"resnet18": 11.7e6, "revnet18": 12.2e6, "resnet34": 21.8e6, "revnet34": 22.3e6,
          "resnet50": 25.6e6, "revnet50": 30.4e6}
STAGES = {"resnet18": 10, "revnet18": 10, "resnet34": 18, "revnet34": 18, "resnet50": 18,
          "revnet50": 18}


@pytest.mark.parametrize("arch", sorted(TABLE2))
def test_parameter_count_within_1_percent_of_table2(arch):
    n = count_parameters(build_blocks(arch, 64, 1000, imagenet_stem=True))
    assert abs(n - TABLE2[arch]) / TABLE2[arch] < 0.01, n


@pytest.mark.parametrize("arch", sorted(TABLE2))
def test_paper_split_stage_count(arch):
    blocks = build_blocks(arch, 4, 10)
    assert len(blocks) == num_blocks(arch) == STAGES[arch]
    assert plan_layout(NetSpec(arch, 4, 10), STAGES[arch]).split == [1] * STAGES[arch]


@pytest.mark.parametrize("arch", ["revnet18", "resnet50"])
@pytest.mark.parametrize("imagenet", [False, True])
def test_shapes_and_reversibility(arch, imagenet):
    blocks = build_blocks(arch, 4, 7, imagenet_stem=imagenet)
    x = torch.randn(2, 3, 64, 64)
    for b in blocks:
        x = b.eval()(x)
    assert x.shape == (2, 7)
    kinds = [b.reversible for b in blocks]
    assert kinds[0] is False and kinds[-1] is False
    assert any(kinds) == arch.startswith("revnet")


def test_revnet18_buffered_stages_are_the_papers():
    """Paper App. B: non-reversible stages {3, 5, 7} (1-indexed), besides stem and head."""
    kinds = [b.reversible for b in build_blocks("revnet18", 4, 10)]
    assert [i + 1 for i, r in enumerate(kinds) if not r] == [1, 4, 6, 8, 10]


def test_balanced_partition_minimises_the_largest_stage():
    assert balanced_partition([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_partition([1, 2, 3, 4, 5], 5) == [1] * 5
    costs = block_costs(build_blocks("revnet18", 8, 10), 32)
    sizes = balanced_partition(costs, 4)
    assert sum(sizes) == 10 and len(sizes) == 4
    with pytest.raises(ValueError, match="1 to 10"):
        balanced_partition(costs, 11)
    with pytest.raises(ValueError, match="model.partition"):
        plan_layout(NetSpec("revnet18", 4, 10), 3, partition=[3, 3, 3])
