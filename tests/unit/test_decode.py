"""JPEG decode: the batched crop/resize and the decode pools."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.paths import ROOT


# ---- JPEG decode -------------------------------------------------------------------------------
def _jpegs(n=6, seed=0):
    rng = np.random.default_rng(seed)
    blobs = []
    for i in range(n):
        h, w = (48, 64) if i % 2 else (64, 40)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    return blobs


def test_crop_resize_batch_matches_per_image_interpolate():
    import torch.nn.functional as F
    from petra_mpi.data.augment import crop_resize_batch
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(40, 50), (40, 50), (33, 60), (40, 50), (24, 24)]]
    boxes = [(3, 2, 30, 20), (0, 0, 30, 20), (5, 1, 17, 31), (10, 10, 24, 24), (0, 0, 24, 24)]
    out = crop_resize_batch(images, boxes, 24)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.uint8
    for k, (im, (left, top, w, h)) in enumerate(zip(images, boxes)):
        patch = im[:, top:top + h, left:left + w]
        if (w, h) != (24, 24):
            patch = F.interpolate(patch[None].float(), size=(24, 24), mode="bilinear",
                                  align_corners=False, antialias=True)[0].round_().clamp_(0, 255)
        assert torch.equal(out[k], patch.to(torch.uint8)), k


@pytest.mark.extended  # starts process pools
@pytest.mark.parametrize("train", [True, False])
def test_decode_pools_agree(train):
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
    import multiprocessing
    from petra_mpi.data import augment as A
    blobs = _jpegs(7)
    uniforms = A.rrc_uniforms(np.random.default_rng(1), len(blobs))[1] if train else None
    serial = A.decode_crop_batch_pil(blobs, 32, 40, uniforms)
    with ThreadPoolExecutor(2) as tp:
        threads = A.decode_crop_batch_pil(blobs, 32, 40, uniforms, tp)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver")) as pp:
        procs = A.decode_crop_batch_pil(blobs, 32, 40, uniforms, pp)
    assert serial.shape == (7, 32, 32, 3)
    assert np.array_equal(serial, threads) and np.array_equal(serial, procs)


def test_decode_workers_config_key():
    from petra_mpi.config import ConfigError, load_config
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["data.decode_workers=3",
                                                         "data.decode_pool=process"])
    assert (cfg.data.decode_workers, cfg.data.decode_pool) == (3, "process")
    with pytest.raises(ConfigError, match="data.decode_pool"):
        load_config(ROOT / "configs/quickstart.yaml", ["data.decode_pool=fork"])
    with pytest.raises(ConfigError, match="data.decode_workers"):
        load_config(ROOT / "configs/quickstart.yaml", ["data.decode_workers=-1"])
