"""A rank's message streams to its neighbours, opened once per engine: the shapes and layouts each
link carries are agreed first, then each stream this rank uses gets its Inbox or Outbox."""
import torch

from .transport import (CONTIGUOUS, TAG_ACTIVATION, TAG_GRADIENT, TAG_LABELS, TAG_REBUILT, Inbox,
                        Outbox, in_layout, layout_of)

STREAM_NAMES = {TAG_ACTIVATION: "activation", TAG_REBUILT: "rebuilt input",
                TAG_GRADIENT: "gradient", TAG_LABELS: "labels"}


def open_streams(world, transport, worker, compression, dtype, input_shape, batch_size,
                 labels_per_sample) -> dict:
    """The streams of this rank, by the name the trace shows; a stream it does not use is absent.
    Collective over the replica's pipeline (world.pipe): every rank calls it at start-up."""
    comm, r, J = world.pipe, world.stage, world.stages
    device = next(worker.stage.parameters()).device
    # Shapes and layouts are agreed once: each rank learns its input's from the previous one,
    # and every message of a link (activation forward, rebuilt input and gradient back)
    # travels in the layout its producer makes (channels-last on CUDA), so nobody converts.
    in_shape, in_fmt = (((batch_size, *input_shape), CONTIGUOUS) if r == 0
                        else comm.recv(source=r - 1, tag=1))
    out_shape, out_fmt = output_spec(worker.stage, in_shape, in_fmt, device, dtype)
    if r < J - 1:
        comm.send((out_shape, out_fmt), dest=r + 1, tag=1)
    # A stage whose last block is buffered ignores ỹ, so its successor need not send it.
    wants_rebuilt = comm.sendrecv(worker.stage.needs_rebuilt_input, dest=(r + 1) % J,
                                  source=(r - 1) % J)
    send_rebuilt = r > 0 and wants_rebuilt

    def codec(direction, sender):  # of what `sender` sends; a receiver only decodes with it
        return compression.codec(direction, sender, world.replica)
    t, last = transport, r == J - 1
    rebuilt_in = not last and worker.stage.needs_rebuilt_input
    streams = {
        "activation in": r > 0 and Inbox(comm, t, r - 1, TAG_ACTIVATION, in_shape, dtype,
                                         layout=in_fmt, codec=codec("forward", r - 1)),
        "rebuilt in": rebuilt_in and Inbox(comm, t, r + 1, TAG_REBUILT, out_shape, dtype,
                                           layout=out_fmt, codec=codec("rebuilt", r + 1)),
        "gradient in": not last and Inbox(comm, t, r + 1, TAG_GRADIENT, out_shape, dtype,
                                          layout=out_fmt, codec=codec("gradient", r + 1)),
        # with one stage (J = 1, replicas only) the labels never leave the rank
        "labels in": last and J > 1 and Inbox(comm, t, 0, TAG_LABELS,
                                              (batch_size * labels_per_sample,), torch.int64),
        "activation out": not last and Outbox(comm, t, r + 1, TAG_ACTIVATION, layout=out_fmt,
                                              codec=codec("forward", r)),
        "rebuilt out": send_rebuilt and Outbox(comm, t, r - 1, TAG_REBUILT,
                                               layout=in_fmt, codec=codec("rebuilt", r)),
        "gradient out": r > 0 and Outbox(comm, t, r - 1, TAG_GRADIENT, layout=in_fmt,
                                         codec=codec("gradient", r)),
        "labels out": r == 0 and J > 1 and Outbox(comm, t, J - 1, TAG_LABELS, depth=J + 2),
    }
    return {name: box for name, box in streams.items() if box}


@torch.no_grad()
def output_spec(stage, in_shape, in_fmt, device, dtype):
    """(output shape, output layout) of `stage` for an input of in_shape in in_fmt."""
    was_training = stage.training
    stage.eval()  # running statistics: a shape probe must not touch anything
    try:
        probe = torch.zeros((1, *in_shape[1:]), device=device, dtype=stage.input_dtype or dtype)
        out = stage.evaluate(in_layout(probe, in_fmt))
        return (in_shape[0], *out.shape[1:]), layout_of(out)
    finally:
        stage.train(was_training)
