"""The messages between stages, described once: one row per channel, read by the schedule's
lowering (core/schedule.py: which action sends and receives it, and to which stage), the ports
(engines/: which streams an action uses), the transports (comm/streams.py: tags, codecs, how far
ahead receives are posted), the one-process engine's codecs and the tracer's rows (core/trace.py).

A channel carries one tensor per micro-batch from every stage to the stage `towards` names:
- activation: a forward's output, to the next stage;
- rebuilt: the rebuilt input x̃ of a backward, to the previous stage, only where that stage uses it
  (its last block rebuilds: `optional`);
- gradient: the input gradient δ of a backward, beside x̃;
- labels: stage 0's labels, straight to the last stage.
Channels of one action travel in table order (x̃ before δ). The receiver posts first: its
receives wait `ahead` messages in advance, so a transfer overlaps the compute before it (and a
stop must leave every posted receive a message: engines/stopping.STOP_MARGIN).
"""
from dataclasses import dataclass

RECEIVE_DEPTH = 2  # receives a stream posts ahead of the messages it has taken


@dataclass(frozen=True)
class Channel:
    key: str          # the streams' names: "<key> in" on the receiver, "<key> out" on the sender
    name: str         # what the watchdog's report calls it
    send: str         # the action that sends it (core.schedule.Kind's value)
    receive: str      # the action that receives it
    towards: str      # the receiver: "next" stage, "previous" stage or the "last" stage
    tag: int          # the message tag (MPI, gloo)
    codec: str | None  # its compression direction (comm.compress.DIRECTIONS), None: sent as is
    optional: bool = False  # sent only where the receiver uses it
    ahead: int = RECEIVE_DEPTH  # receives the receiver posts ahead (it posts first)
    sends_in_flight: int | None = 2  # sends not yet completed; None: J + 2 (the labels reach
    # the last stage J ticks after stage 0 sends them)

    @property
    def inbox(self) -> str:
        return f"{self.key} in"

    @property
    def outbox(self) -> str:
        return f"{self.key} out"

    def receiver(self, stage: int, stages: int) -> int:
        """The stage a message that `stage` sends goes to."""
        return {"next": stage + 1, "previous": stage - 1, "last": stages - 1}[self.towards]

    def sender(self, stage: int, stages: int) -> int:
        """The stage a message that `stage` receives comes from."""
        return {"next": stage - 1, "previous": stage + 1, "last": 0}[self.towards]

    def sends(self, stage: int, stages: int) -> bool:
        """Whether `stage` sends on this channel (to a stage that takes it from `stage`)."""
        to = self.receiver(stage, stages)
        return 0 <= to < stages and to != stage and self.sender(to, stages) == stage

    def receives(self, stage: int, stages: int) -> bool:
        """Whether `stage` receives on this channel."""
        source = self.sender(stage, stages)
        return 0 <= source < stages and source != stage and self.receiver(source, stages) == stage

    def in_flight(self, stages: int) -> int:
        return stages + 2 if self.sends_in_flight is None else self.sends_in_flight


CHANNELS = (
    Channel("activation", "activation", "send_forward", "receive_forward", "next", 11,
            "forward"),
    Channel("rebuilt", "rebuilt input", "send_backward", "receive_backward", "previous", 12,
            "rebuilt", optional=True),
    Channel("gradient", "gradient", "send_backward", "receive_backward", "previous", 13,
            "gradient"),
    Channel("labels", "labels", "send_labels", "receive_labels", "last", 14, None,
            sends_in_flight=None),
)
BY_KEY = {c.key: c for c in CHANNELS}


def of_action(kind: str) -> tuple:
    """The channels a send or receive action (a Kind value) carries, in the order they travel."""
    return tuple(c for c in CHANNELS if kind in (c.send, c.receive))


def streams() -> tuple:
    """Every stream's name, receives first: the tracer's rows."""
    return tuple(c.inbox for c in CHANNELS) + tuple(c.outbox for c in CHANNELS)
