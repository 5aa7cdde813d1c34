"""The built-in synthetic dataset: 10 classes of 32x32 RGB images, deterministic from a seed.

Each image holds one windowed sinusoidal grating whose orientation (5 values from 0 to 90 degrees,
each drawn as itself or its mirror image, so that horizontal flips keep the class) and spatial
frequency (2 values) give the class; its phase, position, window size, colours, contrast and the
background are random, and pixel noise is added. The random phase and position make every class
average to a flat grey image, so a linear classifier on pixels stays near chance, while a small
convolutional net (oriented filters, rectification, pooling) learns it well.
"""
import numpy as np

NUM_CLASSES = 10
_ORIENTATIONS = 5
_FREQUENCIES = (0.14, 0.26)  # cycles per pixel
SIZE = 32  # image side of the set the trainer uses (data.path: synthetic)


def make_synthetic(n: int, seed: int, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 (n, size, size, 3), labels int64 (n,)), a pure function of (n, seed)."""
    if n < 0 or size < 8:
        raise ValueError(f"make_synthetic: need n >= 0 and size >= 8, got n={n}, size={size}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=n, dtype=np.int64)
    mirror = rng.choice([-1.0, 1.0], size=n)
    theta = mirror * (np.pi / 2 * (labels % _ORIENTATIONS) / (_ORIENTATIONS - 1)
                      + rng.uniform(-0.08, 0.08, n))
    freq = np.asarray(_FREQUENCIES)[labels // _ORIENTATIONS] * rng.uniform(0.9, 1.1, n)
    phase = rng.uniform(0, 2 * np.pi, n)
    centre = rng.uniform(0.3 * size, 0.7 * size, (n, 2))
    sigma = rng.uniform(0.15 * size, 0.3 * size, n)
    contrast = rng.uniform(0.25, 0.5, n)
    fg = rng.uniform(-1, 1, (n, 3))
    fg /= np.linalg.norm(fg, axis=1, keepdims=True)
    background = rng.uniform(0.3, 0.7, (n, 1, 1, 3))

    images = np.empty((n, size, size, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for lo in range(0, n, 1024):  # chunks keep the float temporaries small
        sl = slice(lo, min(n, lo + 1024))
        m = sl.stop - sl.start
        cos, sin = np.cos(theta[sl])[:, None, None], np.sin(theta[sl])[:, None, None]
        u = xx * cos + yy * sin
        wave = np.sin(2 * np.pi * freq[sl][:, None, None] * u + phase[sl][:, None, None])
        d2 = (xx - centre[sl, 0, None, None]) ** 2 + (yy - centre[sl, 1, None, None]) ** 2
        window = np.exp(-d2 / (2 * sigma[sl][:, None, None] ** 2))
        pattern = (contrast[sl][:, None, None] * wave * window)[..., None] * fg[sl][:, None, None, :]
        noise = rng.normal(0, 0.06, (m, size, size, 3))
        pixels = background[sl] + pattern + noise
        images[sl] = np.clip(np.rint(pixels * 255), 0, 255).astype(np.uint8)
    return images, labels
