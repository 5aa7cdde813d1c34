"""A rank's message streams to its pipeline neighbours, opened once per engine from the channel
table (channels.py): the shapes and layouts each link carries are agreed first, then each stream
this rank uses gets its Inbox or Outbox on the transport's link, with its channel's tag, codec
and depth."""
import torch

from .channels import CHANNELS
from .transport import CONTIGUOUS, Inbox, Outbox, message_bytes


class Streams(dict):
    """This rank's boxes by stream name ("activation in", "gradient out", ...: the tracer's rows;
    a stream this rank does not use is absent), on one `transport`; `line`: what the run log
    says of the transport."""

    def __init__(self, boxes, transport, line):
        super().__init__(boxes)
        self.transport, self.line = transport, line

    def pending(self, peer_name) -> list:
        """(blocked, direction, stream, peer, count) of each stream with messages in flight, for
        the watchdog's report (blocked: the rank waits on that stream now); peer_name(stage)
        names a stage of the pipeline. Calls no library."""
        blocked, rows = self.transport.blocked, []
        for box in self.values():
            receiving = box.direction == "receive"
            count = len(box.pending) + (1 if receiving and box is blocked else 0)
            if count:
                rows.append((box is blocked, box.direction, box.name, peer_name(box.peer), count))
        return rows

    def sent_bytes(self) -> int:
        """Bytes sent so far (compressed size where compression is on)."""
        return sum(box.sent_bytes for box in self.values() if box.direction == "send")

    def waited(self) -> float:
        """Seconds blocked on the transport so far."""
        return sum(box.waited for box in self.values())


def open_streams(pipe, replica, *, device, compression, dtype, input_spec, output_spec,
                 uses_rebuilt, labels_shape, poll_sleep=None) -> Streams:
    """The streams of this rank, stage pipe.rank of the replica's pipeline `pipe` (a transport's
    group). input_spec: (shape, layout) of stage 0's input; output_spec(shape, layout): this
    stage's output (shape, layout) for such an input; uses_rebuilt: this stage takes the rebuilt
    input x̃ of its backward; labels_shape: one micro-batch's labels. Collective over `pipe`:
    every rank calls it at start-up."""
    r, J = pipe.rank, pipe.size
    transport, line = pipe.transport(device, poll_sleep)
    # Shapes and layouts are agreed once: each rank learns its input's from the previous one,
    # and every message of a link (activation forward, rebuilt input and gradient back)
    # travels in the layout its producer makes (channels-last on CUDA), so nobody converts.
    in_shape, in_fmt = input_spec if r == 0 else pipe.recv_object(r - 1)
    out_shape, out_fmt = output_spec(in_shape, in_fmt)
    if r < J - 1:
        pipe.send_object((out_shape, out_fmt), r + 1)
    # A stage whose last block is buffered ignores x̃, so its successor need not send it.
    uses = pipe.allgather(uses_rebuilt)

    def carried(c, at):
        """(shape, layout, dtype) of what channel c carries into stage `at`: r or a neighbour."""
        if c.key == "labels":
            return labels_shape, CONTIGUOUS, torch.int64
        # forward: the input of the receiver; backward: the output of the receiver
        own = (at == r) == (c.key != "activation")
        return (out_shape, out_fmt, dtype) if own else (in_shape, in_fmt, dtype)

    def codec(c, sender):  # of what `sender` sends; a receiver only decodes with it
        return c.codec and compression.codec(c.codec, sender, replica)

    boxes = {}
    for c in CHANNELS:
        if c.receives(r, J) and (not c.optional or uses[r]):
            sender = c.sender(r, J)
            shape, fmt, kind = carried(c, r)
            link = pipe.link(sender, c, message_bytes(shape, kind, fmt, codec(c, sender)))
            boxes[c.inbox] = Inbox(link, transport, shape, kind, c.ahead, fmt, codec(c, sender),
                                   c.name)
        if c.sends(r, J) and (not c.optional or uses[c.receiver(r, J)]):
            receiver = c.receiver(r, J)
            shape, fmt, kind = carried(c, receiver)
            link = pipe.link(receiver, c, message_bytes(shape, kind, fmt, codec(c, r)))
            boxes[c.outbox] = Outbox(link, transport, c.in_flight(J), fmt, codec(c, r), c.name)
    return Streams(boxes, transport, line)
