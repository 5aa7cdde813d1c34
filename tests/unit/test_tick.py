"""The engines run the lowered actions of their schedule themselves (engines/segment.py,
engines/tick.py): an action they do not know, or one whose input no earlier action made, fails
the run at once instead of computing something else."""
from enum import Enum

import pytest
import torch

from tests.support.nets import make_batches, stages_of
from petra_mpi.core.schedule import Action, Kind, PetraSchedule
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine


class Other(str, Enum):
    MYSTERY = "mystery"


class WithUnknownKind(PetraSchedule):
    """PETRA, with an action of a kind no engine knows on the last stage's first tick."""

    def lowered(self, stage, tick, n):
        actions = super().lowered(stage, tick, n)
        if stage == self.J - 1 and actions and actions[0].microbatch == 0:
            return [Action(Other.MYSTERY, stage, 0)] + actions
        return actions


class WithoutReceive(PetraSchedule):
    """PETRA, where stage 1 forwards without receiving its input first."""

    def lowered(self, stage, tick, n):
        return [a for a in super().lowered(stage, tick, n)
                if not (stage == 1 and a.kind is Kind.RECV_F)]


def engine_on(schedule):
    """A local engine of 3 tiny stages that runs `schedule`."""
    stages = stages_of("revnet18", 4, 10, 3, seed=0, dtype=torch.float64)
    engine = LocalEngine(build_workers(stages), "petra")
    engine.schedule = schedule
    return engine


def test_an_unknown_action_kind_fails_loudly():
    engine = engine_on(WithUnknownKind(3))
    with pytest.raises(ValueError, match="stage 2: unknown action kind"):
        engine.train_segment(iter(make_batches(4)), 4)


def test_an_action_before_its_input_fails_loudly():
    engine = engine_on(WithoutReceive(3))
    with pytest.raises(RuntimeError, match="stage 1: no input of micro-batch 0"):
        engine.train_segment(iter(make_batches(4)), 4)


def test_the_same_engine_trains_on_the_schedule_as_it_is():
    """The control: PETRA's own schedule runs through."""
    engine = engine_on(PetraSchedule(3))
    assert engine.train_segment(iter(make_batches(4)), 4) == 4
