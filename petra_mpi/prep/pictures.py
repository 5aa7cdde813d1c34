"""What the packers of pictures (imagenet, folder, parquet) share, and petra_mpi.predict with
them: decoding any picture Pillow reads into the pixels a packed file holds (encode), the
bad-input policy (BadInput) and the loop that encodes pictures through common.ordered_map's
processes and writes them (write_pictures)."""
import collections
import functools
import io
import math
import os
import stat
import sys
import zlib

import numpy as np
from PIL import Image, ImageFile, ImageOps

from .common import (SPLITS, ArrayWriter, ChannelStats, JpegWriter, PrepError, Progress,
                     atomic_h5, check_interrupt, ordered_map, print_summary, shown,
                     write_root_attrs)

QUALITY = 90  # JPEG quality of the encoded-JPEG variant
# The most pixels a picture may decode to (after a JPEG's reduced-scale decoding): about 260 MB
# of memory in a decoding process at most, more than an 8K picture. A small file can declare
# any size (a PNG of 87 KB, 90 megapixels), and each process decodes its picture whole.
MAX_PIXELS = 40_000_000
# The most classes a packed file may have: a label or a class count beyond it is taken for a
# wrong value (each class costs a name, an output of the model, a row of verify's counts).
MAX_CLASSES = 100_000
# Pillow's own limit counts the pixels before a JPEG's reduced-scale decoding and only warns
# below twice its value; the limit above replaces it.
Image.MAX_IMAGE_PIXELS = None


class TooManyPixels(Exception):
    """A picture larger than the pixel limit (encode's reason names its size)."""


@functools.lru_cache(maxsize=1)
def image_extensions():
    """The extensions (lower case, with the dot) of every format Pillow can open, leaving out
    its stubs (BUFR, GRIB, HDF5, WMF: recognised, but decoded only by plugins of their own)."""
    Image.init()

    def real(opener):
        return not (isinstance(opener, type) and issubclass(opener, ImageFile.StubImageFile))
    return frozenset(ext for ext, fmt in Image.registered_extensions().items()
                     if fmt in Image.OPEN and real(Image.OPEN[fmt][0]))


def to_rgb(im):
    """An image of any mode as 8-bit RGB: transparency is laid on white (the colour under a
    transparent pixel is arbitrary), 16- and 32-bit grayscale keeps its top 8 bits (Pillow's
    own conversion clips them at 255)."""
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        im = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", im.size, "white"), im).convert("RGB")
    if im.mode.startswith("I;16") or (im.mode == "I" and im.getextrema()[1] > 255):
        im = Image.fromarray((np.asarray(im, dtype=np.uint32) >> 8).astype(np.uint8))
    return im if im.mode == "RGB" else im.convert("RGB")


def resized(im, size):
    """`im` resized so that its shorter side is `size` (bilinear; Pillow antialiases when it
    shrinks)."""
    w, h = im.size
    new = (size, max(1, round(h * size / w))) if w <= h else (max(1, round(w * size / h)), size)
    return im.resize(new, Image.BILINEAR)


def encode(source, size, raw=False, max_pixels=MAX_PIXELS):
    """Worker: one picture (a path or its encoded bytes) as the packers store it, and the
    ChannelStats of the stored pixels: (payload, stats, None), or (None, None, why) when it
    cannot be decoded or would decode to more than `max_pixels`. The picture is decoded, turned
    upright by its EXIF orientation, made RGB (to_rgb) and resized to shorter side `size`; the
    payload is its JPEG (quality 90), or with `raw` the uint8 (size, size, 3) square at its
    centre. petra_mpi.predict prepares a picture with this same function, so it sees the pixels
    the packed file holds."""
    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source)) as im:
            # For JPEGs, let libjpeg decode at 1/2, 1/4 or 1/8 scale when that still leaves at
            # least `size` pixels on each side: much faster for large photos.
            im.draft("RGB", (size, size))
            if im.size[0] * im.size[1] > max_pixels:  # before anything is decoded
                raise TooManyPixels(f"{im.size[0]} x {im.size[1]} pixels, more than the limit "
                                    f"of {max_pixels:,}")
            im = to_rgb(ImageOps.exif_transpose(im))  # the copy is decoded: the file may close
        im = resized(im, size)
    except Exception as e:  # any decoding failure is an input error, reported with the picture
        return None, None, f"{type(e).__name__}: {e}"
    if raw:
        left, top = (im.size[0] - size) // 2, (im.size[1] - size) // 2
        pixels = np.asarray(im.crop((left, top, left + size, top + size)))
        return pixels, ChannelStats().update(pixels), None
    stats = ChannelStats().update(np.asarray(im))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=QUALITY)
    return out.getvalue(), stats, None


def encode_item(item, size, raw=False, max_pixels=MAX_PIXELS):
    """Worker: encode() of one (split, name, source, label), returned with its split, name and
    label (so that a stream of items needs no second pass)."""
    split, name, source, label = item
    return (split, name, label) + encode(source, size, raw, max_pixels)


def unfit_name(name):
    """Why `name` cannot name a class (the file keeps it, predict prints it on one line), or
    None: bytes that are not UTF-8, or a control character such as a newline."""
    return None if name.isprintable() else "not printable UTF-8 text"


# Only regular files are read: a FIFO would block its reader forever, a device never ends.
NOT_REGULAR = "not a regular file (a FIFO, socket, device or broken link)"


def regular_file(path):
    """None if `path` (or what its links lead to) is a regular file, else why it is not read."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except ValueError:  # a NUL in the name
        return "cannot be read (a NUL in its name)"
    return None if stat.S_ISREG(mode) else NOT_REGULAR


class BadInput:
    """How a packer of pictures treats bad input (an unreadable picture, a stray file, an empty
    class...): with skip, each is reported on one line of stderr and left out; without, the
    first stops the packer with one line naming it (exit status 2). hint: the option that
    would skip it, named in that line."""

    def __init__(self, skip=False, hint=None):
        self.skip, self.hint, self.skipped = skip, hint, []

    def __call__(self, where, why):
        self.report([(where, why)])

    def report(self, problems):
        """Several problems found at once (a scan): without skip each gets its line, then the
        first stops the packer."""
        problems = list(problems)
        if not problems:
            return
        if not self.skip:
            for where, why in problems[1:]:
                print(f"bad input: {shown(where)}: {why}", file=sys.stderr, flush=True)
            where, why = problems[0]
            more = f"; {len(problems) - 1} more listed above" if len(problems) > 1 else ""
            hint = f"; {self.hint} packs the rest" if self.hint else ""
            raise PrepError(f"{shown(where)}: {why}{more}{hint}")
        for where, why in problems:
            print(f"skipped {shown(where)}: {why}", file=sys.stderr, flush=True)
        self.skipped.extend(where for where, _ in problems)

    def close(self):
        if self.skipped:
            print(f"skipped {len(self.skipped)} input(s), each listed above", flush=True)


def write_pictures(f, pmap, items, total, *, size, raw=False, bad=None,
                   max_pixels=MAX_PIXELS, classes=None):
    """Encode `items` [(split, name, source, label)] through `pmap` (ordered_map's) and append
    each to its split of `f`: the JPEG variant, or with `raw` arrays of (size, size, 3). A
    picture that does not decode goes to `bad` (BadInput), and a class left without a picture
    in a split that was to hold some is named (by `classes`, else its label). Returns the
    ChannelStats of the training pictures and the pictures written per split; an empty split is
    an error."""
    bad = bad or BadInput()
    writers = {s: ArrayWriter(f, s, size, size) if raw else JpegWriter(f, s) for s in SPLITS}
    stats, counts = ChannelStats(), dict.fromkeys(SPLITS, 0)
    planned, written = collections.Counter(), collections.Counter()  # per (split, label)
    bar = Progress(total, "images")
    for split, name, label, data, st, err in pmap(
            functools.partial(encode_item, size=size, raw=raw, max_pixels=max_pixels), items):
        check_interrupt()
        bar.advance()
        planned[split, label] += 1
        if err is not None:
            bad(name, f"cannot decode image ({err})")
            continue
        writers[split].append_one(data, label)
        counts[split] += 1
        written[split, label] += 1
        if split == "train":
            stats.add(st)
    bar.close()
    for split, label in sorted(planned.keys() - written.keys()):
        print(f"note: the {split} split holds no picture of class "
              f"{shown(classes[label] if classes else label)} (none of its "
              f"{planned[split, label]} decoded)", file=sys.stderr, flush=True)
    for split, writer in writers.items():
        writer.close()
        if not counts[split]:
            raise PrepError(f"no image left for the {split} split")
    return stats, counts


def pictures_per_task(size):
    """Pictures handed to a worker at a time: about 1 MiB of pixels at the stored size, 8 to
    128. Small pictures take well under a millisecond each; one message per picture or per 8
    would cost the pool more than the work (measured: 28x28 Fashion-MNIST packed slower with 2
    workers than with 1 at 8 a task)."""
    return int(min(128, max(8, (1 << 20) // (3 * size * size))))


def pack_pictures(args, items, total, *, start, source, classes, num_classes=None, bad=None,
                  finish=None):
    """Write args.out from `items` [(split, name, source, label)]: encoded by args.workers
    processes at args.size (the JPEG variant) or args.raw (arrays), with the root attributes;
    finish(f, stats, counts), if given, adds to the file before it gets its name."""
    raw = getattr(args, "raw", None)
    size = raw or args.size
    with ordered_map(args.workers, chunk=pictures_per_task(size)) as pmap, \
            atomic_h5(args.out) as f:
        stats, counts = write_pictures(
            f, pmap, items, total, size=size, raw=bool(raw), bad=bad,
            max_pixels=getattr(args, "max_pixels", MAX_PIXELS), classes=classes)
        extra = {} if raw else {"image_size": np.int64(size)}
        write_root_attrs(f, num_classes=num_classes or len(classes), stats=stats, source=source,
                         classes=classes, **extra)
        if finish:
            finish(f, stats, counts)
    print_summary(args.out, start)
    if bad:
        bad.close()


def draw_val(labels, names, fraction, seed):
    """The val split drawn from training pictures: a boolean mask over `labels` marking, in each
    class, round(fraction * n) of its n pictures, drawn by a generator seeded by `seed` and the
    class's name (names[label], or str(label) where `names` is None), so that adding a class
    changes no other class's draw."""
    labels = np.asarray(labels, dtype=np.int64)
    mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels).tolist():
        rows = np.flatnonzero(labels == label)
        name = str(label) if names is None else str(names[label])
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        mask[rows[rng.permutation(len(rows))[:math.floor(len(rows) * fraction + 0.5)]]] = True
    if not mask.any():
        raise PrepError(f"--val-fraction {fraction} leaves no picture for the val split "
                        f"({len(labels)} pictures in {len(np.unique(labels))} classes): raise it")
    return mask


VAL_FRACTION = 0.1  # the val split drawn from train where the input has none


def add_picture_options(p, val_help):
    """The options every packer of pictures (folder, parquet) takes."""
    p.add_argument("--size", type=int, default=256,
                   help="JPEG variant: shorter side after resizing (default 256)")
    p.add_argument("--raw", type=int, metavar="S", help="store S x S pixels instead of JPEGs")
    p.add_argument("--val-fraction", type=float, help=f"{val_help} (default {VAL_FRACTION})")
    p.add_argument("--seed", type=int, default=0, help="seed of that draw (default 0)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out bad input (listed) instead of stopping at the first")
    p.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                   help=f"the most pixels a picture may decode to (default {MAX_PIXELS:,}); "
                        f"a larger one is bad input")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--workers", type=int, default=usable,
                   help="decoding processes (default: the usable cores)")


def check_picture_options(p, args):
    if args.size < 1 or (args.raw is not None and args.raw < 1):
        p.error("--size and --raw must be positive")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error("--val-fraction must lie between 0 and 1")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.max_pixels < 1:
        p.error("--max-pixels must be positive")
