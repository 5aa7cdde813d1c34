"""Batch augmentation on the training device, and JPEG decoding.

Array data of any side (32x32 CIFAR and ImageNet32, 28x28 MNIST-format sets; paper §4: random
crop with 4-pixel zero padding + horizontal flip, the flip only where the file's `hflip` allows
it): the uint8 batch goes to the device as it is (4x smaller than float), is zero-padded, and one
index_select gathers every sample's shifted (and possibly mirrored) window: no per-image loop.
Measured on one CPU core, batch 64: crop+flip ~0.3 ms, uint8 -> normalised float ~0.15 ms.

JPEG data (full-size ImageNet): decode + random-resized-crop (train) or centre crop (eval) per
image, with PIL on the CPU, or with torchvision.io.decode_jpeg on the GPU when torchvision is
importable and the device is CUDA (torchvision is optional: imported only there).

Every random draw comes from the numpy Generator the caller passes in, drawn in a fixed layout
independent of image sizes, so a batch's augmentation is a pure function of its seed.
"""
import io
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

PAD = 4                                # zero padding of the 32x32 random crop (paper, CIFAR recipe)
RRC_SCALE = (0.08, 1.0)                # random-resized-crop area fraction (Inception/torchvision)
RRC_RATIO = (3 / 4, 4 / 3)             # and aspect ratio range
RRC_TRIES = 10
CROP_SHARE = 7 / 8                     # default crop of the stored side (ImageNet: 224 of 256)


def crop_side(image_size, crop=0):
    """The side JPEG pictures are cropped to, training and evaluation alike: `crop`, or when 0
    about 7/8 of their stored shorter side (224 of 256, 56 of 64, 28 of 32), the share of
    ImageNet's usual centre crop."""
    return int(crop) if crop else max(1, int(image_size * CROP_SHARE))


def crop_flip(x, dy, dx, flip, pad=PAD):
    """Random crop with zero padding, and horizontal flip, of a uint8 NHWC batch.

    out[n, i, j] = P[n, dy[n] + i, dx[n] + (W-1-j if flip[n] else j)], P = x zero-padded by `pad`
    on each side; dy, dx in [0, 2*pad] (int64, on x's device), flip bool."""
    n, h, w, c = x.shape
    hp, wp = h + 2 * pad, w + 2 * pad
    padded = x.new_zeros((n, hp, wp, c))
    padded[:, pad:pad + h, pad:pad + w] = x
    ar_h = torch.arange(h, device=x.device)
    ar_w = torch.arange(w, device=x.device)
    rows = dy[:, None] + ar_h                                               # (N, H)
    cols = dx[:, None] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)      # (N, W), mirrored
    flat = (torch.arange(n, device=x.device)[:, None, None] * hp + rows[:, :, None]) * wp \
        + cols[:, None, :]
    # One gather of whole pixels (C bytes each) from the flattened padded batch.
    return padded.view(n * hp * wp, c).index_select(0, flat.view(-1)).view(n, h, w, c)


def flip_images(x, flip):
    """Mirror the samples of a uint8 NHWC batch where flip is True."""
    return torch.where(flip[:, None, None, None], x.flip(2), x)


def normalize(x, scale, shift):
    """uint8 NHWC -> float32 NCHW contiguous, (x/255 - mean)/std as x*scale + shift.

    scale = 1/(255 std), shift = -mean/std, each shaped (1, 3, 1, 1) on x's device."""
    n, h, w, c = x.shape
    out = torch.empty((n, c, h, w), dtype=torch.float32, device=x.device)
    out.copy_(x.permute(0, 3, 1, 2))  # conversion and layout change in one pass
    return out.mul_(scale).add_(shift)


def norm_constants(mean, std, device):
    mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (1.0 / (255.0 * std)).to(device), (-mean / std).to(device)


def crop_params(rng, n, pad=PAD):
    """Per-sample (dy, dx) offsets in [0, 2*pad] and flip bits, as numpy arrays."""
    flip = rng.random(n) < 0.5
    dy, dx = rng.integers(0, 2 * pad + 1, size=(2, n))
    return dy, dx, flip


def rrc_uniforms(rng, n):
    """Flip bits and the uniforms of random-resized-crop, drawn before any image size is known
    (so the boxes can be computed image by image, in any order or thread)."""
    flip = rng.random(n) < 0.5
    return flip, rng.random((n, 4, RRC_TRIES))


def rrc_box(width, height, u):
    """Random-resized-crop box (left, top, w, h) of a width x height image from uniforms u
    (4, RRC_TRIES): area fraction, log aspect ratio, top and left positions per try; the
    torchvision algorithm (10 tries, then a centre crop with the ratio clamped)."""
    area = width * height
    lo, hi = np.log(RRC_RATIO[0]), np.log(RRC_RATIO[1])
    for t in range(RRC_TRIES):
        target = area * (RRC_SCALE[0] + (RRC_SCALE[1] - RRC_SCALE[0]) * u[0, t])
        ratio = np.exp(lo + (hi - lo) * u[1, t])
        w = int(round(np.sqrt(target * ratio)))
        h = int(round(np.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = min(int(u[2, t] * (height - h + 1)), height - h)
            left = min(int(u[3, t] * (width - w + 1)), width - w)
            return left, top, w, h
    ratio = width / height
    if ratio < RRC_RATIO[0]:
        w, h = width, int(round(width / RRC_RATIO[0]))
    elif ratio > RRC_RATIO[1]:
        w, h = int(round(height * RRC_RATIO[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_box(width, height, crop, image_size):
    """Eval crop: the centred square that is `crop` pixels of an image whose shorter side is
    `image_size` (224 of 256), scaled if this image's shorter side differs."""
    side = min(width, height, max(1, int(round(crop * min(width, height) / image_size))))
    return (width - side) // 2, (height - side) // 2, side, side


def jpeg_box(width, height, k, crop, image_size, uniforms):
    """Box of image k: random-resized-crop when uniforms are given (train), else centre crop."""
    if uniforms is None:
        return center_box(width, height, crop, image_size)
    return rrc_box(width, height, uniforms[k])


def decode_crop_pil(blob, crop, box_fn):
    """Decode one JPEG with PIL and resize box_fn(width, height) to crop x crop: uint8 HWC.

    PIL's resize with a box crops and resamples in one C call (bilinear, antialiased when it
    shrinks) and releases the GIL, as does the decode, so a thread pool scales across cores."""
    with Image.open(io.BytesIO(blob)) as im:
        if im.mode != "RGB":
            im = im.convert("RGB")
        left, top, w, h = box_fn(*im.size)
        if (w, h) == (crop, crop):
            im = im.crop((left, top, left + w, top + h))
        else:
            im = im.resize((crop, crop), Image.BILINEAR, box=(left, top, left + w, top + h))
        return np.asarray(im)


def decode_crop_batch_pil(blobs, crop, image_size, uniforms=None, pool=None):
    """Decode and crop a list of JPEGs into one uint8 (N, crop, crop, 3) array. pool: None (this
    thread), a ThreadPoolExecutor (one task per image) or a ProcessPoolExecutor (one task per
    contiguous chunk of images, one chunk per worker: few, large messages)."""
    n = len(blobs)
    out = np.empty((n, crop, crop, 3), np.uint8)
    if pool is None or n == 0:
        out[:] = decode_crop_chunk(blobs, 0, crop, image_size, uniforms)
    elif isinstance(pool, ProcessPoolExecutor):
        parts = min(n, pool._max_workers)  # noqa: SLF001 - the pool's size, as configured
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [(lo, pool.submit(decode_crop_chunk, blobs[lo:hi], lo, crop, image_size,
                                    None if uniforms is None else uniforms[lo:hi], True))
                   for lo, hi in zip(bounds[:-1], bounds[1:])]
        for lo, f in futures:
            chunk = f.result()
            out[lo:lo + len(chunk)] = chunk
    else:
        def one(k):
            return decode_crop_pil(blobs[k], crop,
                                   lambda w, h: jpeg_box(w, h, k, crop, image_size, uniforms))
        for k, im in enumerate(pool.map(one, range(n))):
            out[k] = im
    return out


def decode_crop_chunk(blobs, first, crop, image_size, uniforms=None, local_uniforms=False):
    """Decode images first, first+1, ... of a batch (blobs[i] is image first+i) into one
    (len(blobs), crop, crop, 3) uint8 array: the work of one process-pool task (top-level, so it
    pickles). uniforms: the batch's, or with local_uniforms the chunk's own rows."""
    out = np.empty((len(blobs), crop, crop, 3), np.uint8)
    for i, blob in enumerate(blobs):
        row = i if local_uniforms else first + i
        out[i] = decode_crop_pil(blob, crop,
                                 lambda w, h: jpeg_box(w, h, row, crop, image_size, uniforms))
    return out


def crop_resize_batch(images, boxes, crop):
    """Crop images[k] (uint8 CHW, any device, sizes may differ) to boxes[k] = (left, top, w, h)
    and resize each to crop x crop (bilinear, antialiased like PIL): uint8 (N, 3, crop, crop).

    Patches are grouped by box size, and each group is resized by one batched F.interpolate call
    (eval centre crops of equal-size images: one call for the whole batch; random-resized-crop
    boxes rarely coincide, so there the groups are mostly single images)."""
    n = len(images)
    device = images[0].device if n else torch.device("cpu")
    out = torch.empty((n, 3, crop, crop), dtype=torch.uint8, device=device)
    groups = {}
    for k, (left, top, w, h) in enumerate(boxes):
        groups.setdefault((w, h), []).append(k)
    for (w, h), ks in groups.items():
        patches = torch.stack([images[k][:, boxes[k][1]:boxes[k][1] + h,
                                         boxes[k][0]:boxes[k][0] + w] for k in ks])
        if (w, h) != (crop, crop):
            patches = F.interpolate(patches.float(), size=(crop, crop), mode="bilinear",
                                    align_corners=False, antialias=True)
            patches = patches.round_().clamp_(0, 255)
        if len(ks) == n:
            out.copy_(patches)
        else:
            out[torch.tensor(ks, device=device)] = patches.to(torch.uint8)
    return out


def has_gpu_decode(device):
    """torchvision's nvJPEG decode is used when the device is CUDA and torchvision imports."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import torchvision.io  # noqa: F401  (optional dependency)
    except Exception:
        return False
    return True


# Set (tests/e2e/test_gpu.py) to synchronise the whole device before every GPU decode: the reference
# against which the stream-safe path must give bitwise the same training.
SYNC_BEFORE_DECODE = False
_decode_streams = {}  # device index -> the side stream that runs nvJPEG and the crops


def decode_crop_batch_cuda(blobs, crop, image_size, device, uniforms=None):
    """GPU path: nvJPEG decode of the whole batch, then crop and antialiased bilinear resize on
    the device. Returns uint8 NHWC on the device (a channels-last view), ready on the current
    (compute) stream.

    Stream safety (pytorch/vision#9606): decode_jpeg allocates its outputs on the current stream
    and lets nvJPEG write them on another stream without ordering, so on the compute stream it
    can be handed a block that queued compute kernels still read. Here everything runs on a side
    stream of its own: its allocations never come from blocks the compute stream freed; the side
    stream is host-synchronised before each decode, so no earlier crop kernel still reads a block
    the decoder may be given (nvJPEG's hardware engine ignores stream order); an event makes the
    compute stream wait for the finished batch, and record_stream keeps the batch's memory from
    being reused by the side stream before the compute stream is done with it."""
    import torchvision.io as tio  # optional: only on this path
    device = torch.device(device)
    if SYNC_BEFORE_DECODE:
        torch.cuda.synchronize(device)
    compute = torch.cuda.current_stream(device)
    side = _decode_streams.get(device.index)
    if side is None:
        side = _decode_streams[device.index] = torch.cuda.Stream(device)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    side.synchronize()
    with torch.cuda.stream(side):
        images = tio.decode_jpeg(data, mode=tio.ImageReadMode.RGB, device=device)
        boxes = [jpeg_box(im.shape[2], im.shape[1], k, crop, image_size, uniforms)
                 for k, im in enumerate(images)]
        out = crop_resize_batch(images, boxes, crop)
        done = torch.cuda.Event()
        done.record(side)
    compute.wait_event(done)
    out.record_stream(compute)
    del images  # freed on the side stream, whose next decode first synchronises it
    return out.permute(0, 2, 3, 1)
