"""bench scaling: the plain net 1F1B is predicted with."""
import pytest

from petra_mpi.perf.bench.scaling import parse_args, plain_twin


@pytest.mark.parametrize("arch, twin", [("revnet18", "resnet18"), ("revnet50", "resnet50"),
                                        ("irevnet34", "resnet34"), ("irevnet50", "resnet50"),
                                        ("resnet18", "resnet18")])
def test_the_1f1b_twin_is_the_resnet_of_the_same_depth(arch, twin):
    assert plain_twin(arch) == twin
    assert parse_args(["--arch", arch]).plain_arch == twin


@pytest.mark.parametrize("arch", ["revvit", "vit"])
def test_an_arch_without_a_resnet_twin_is_refused(arch):
    with pytest.raises(SystemExit, match="no plain ResNet twin"):
        plain_twin(arch)
