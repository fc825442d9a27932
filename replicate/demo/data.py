"""Training data for the demo: real MNIST if the user has it, else a real fallback, else synthetic.

The sources, tried in order:

1. IDX files in a directory the user names (``train-images-idx3-ubyte`` and
   ``train-labels-idx1-ubyte``, optionally gzipped), as the original MNIST site ships them.
2. Keras' cached ``mnist.npz`` (``$KERAS_HOME/datasets`` or ``~/.keras/datasets``).
3. scikit-learn's 8x8 ``digits`` (1,797 real hand-written digits it ships), each image
   upscaled 3x to 24x24 and padded to 28x28 the way MNIST centres its 20x20 digits.
4. Deterministic synthetic digits: one fixed random prototype per class plus noise.

Nothing is downloaded. Every loader returns a :class:`Dataset` whose ``source`` says
which one was used, so the demo can print it.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import struct
from collections.abc import Iterator

import numpy as np

__all__ = ["Dataset", "load", "load_idx", "load_keras_cache", "load_digits", "synthetic",
           "batches", "IMAGE_SIZE", "CLASSES"]

log = logging.getLogger(__name__)

IMAGE_SIZE = 28
CLASSES = 10
_IDX_IMAGES = "train-images-idx3-ubyte"
_IDX_LABELS = "train-labels-idx1-ubyte"


@dataclasses.dataclass
class Dataset:
    """Flattened 28x28 images in [0, 1] and integer labels.

    Attributes:
        images: float32 array of shape [N, 784].
        labels: int64 array of shape [N], values 0..9.
        source: a short human description of where the data came from.
        kind: one of ``"mnist"``, ``"digits"``, ``"synthetic"``.
    """

    images: np.ndarray
    labels: np.ndarray
    source: str
    kind: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _find(directory: str, stem: str) -> str | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def _read_idx(path: str, magic: int) -> np.ndarray:
    with _open(path) as f:
        head = f.read(4)
        if len(head) != 4 or struct.unpack(">I", head)[0] != magic:
            raise ValueError(f"{path}: not an IDX file (magic {head!r})")
        dims = struct.unpack(">" + "I" * (magic & 0xFF), f.read(4 * (magic & 0xFF)))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: holds {data.size} bytes, its header says {dims}")
    return data.reshape(dims)


def load_idx(directory: str) -> Dataset | None:
    """MNIST's training set from IDX files in ``directory``, or None if they are not there.

    Raises:
        ValueError: the files are there but malformed.
    """
    images_path, labels_path = _find(directory, _IDX_IMAGES), _find(directory, _IDX_LABELS)
    if images_path is None or labels_path is None:
        return None
    images = _read_idx(images_path, 0x00000803)
    labels = _read_idx(labels_path, 0x00000801)
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"{directory}: {images.shape} images do not match {labels.shape} labels")
    return Dataset(_scale(images), labels.astype(np.int64), f"MNIST (IDX files in {directory})",
                   "mnist")


def _keras_cache() -> str:
    base = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(base, "datasets", "mnist.npz")


def load_keras_cache(path: str | None = None) -> Dataset | None:
    """MNIST's training set from Keras' cached ``mnist.npz``, or None if it is not there."""
    path = path or _keras_cache()
    if not os.path.isfile(path):
        return None
    with np.load(path) as npz:
        images, labels = npz["x_train"], npz["y_train"]
    return Dataset(_scale(images), labels.astype(np.int64), f"MNIST (Keras cache {path})", "mnist")


def _scale(images: np.ndarray) -> np.ndarray:
    return (images.reshape(images.shape[0], -1).astype(np.float32) / 255.0)


def load_digits() -> Dataset | None:
    """scikit-learn's 8x8 digits, upscaled to 28x28; None without scikit-learn."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        return None
    digits = sk_digits()
    small = digits.images.astype(np.float32) / 16.0                  # [N, 8, 8] in [0, 1]
    big = np.kron(small, np.ones((3, 3), np.float32))                # [N, 24, 24]
    pad = (IMAGE_SIZE - big.shape[1]) // 2
    big = np.pad(big, ((0, 0), (pad, pad), (pad, pad)))
    return Dataset(big.reshape(big.shape[0], -1), digits.target.astype(np.int64),
                   "scikit-learn digits (1,797 real 8x8 digits upscaled to 28x28; no MNIST found)",
                   "digits")


def synthetic(examples: int = 4096, seed: int = 0) -> Dataset:
    """Deterministic synthetic digits: a fixed random prototype per class plus noise."""
    rng = np.random.RandomState(seed)
    prototypes = (rng.rand(CLASSES, IMAGE_SIZE * IMAGE_SIZE) < 0.2).astype(np.float32)
    labels = rng.randint(0, CLASSES, size=examples).astype(np.int64)
    noise = rng.rand(examples, IMAGE_SIZE * IMAGE_SIZE).astype(np.float32) * 0.5
    images = np.clip(prototypes[labels] * 0.7 + noise, 0.0, 1.0).astype(np.float32)
    return Dataset(images, labels, f"synthetic digits ({examples} examples, seed {seed}; "
                   "no MNIST or scikit-learn found)", "synthetic")


def load(data_dir: str | None = None, source: str = "auto") -> Dataset:
    """The best data available.

    Args:
        data_dir: a directory with MNIST IDX files, tried first when given.
        source: ``"auto"`` (the order in the module docstring), or force one of
            ``"mnist"``, ``"digits"``, ``"synthetic"``.

    Raises:
        FileNotFoundError: ``source="mnist"`` and neither IDX files nor the Keras cache exist,
            or ``data_dir`` is given but is not a directory.
        ImportError: ``source="digits"`` without scikit-learn.
    """
    if data_dir is not None and not os.path.isdir(data_dir):
        raise FileNotFoundError(f"--data-dir {data_dir}: no such directory")
    if source in ("auto", "mnist"):
        found = (load_idx(data_dir) if data_dir else None) or load_keras_cache()
        if found is not None:
            return found
        if source == "mnist":
            where = f"{data_dir} or {_keras_cache()}" if data_dir else _keras_cache()
            raise FileNotFoundError(f"no MNIST found in {where}")
        if data_dir:
            log.warning("%s holds no MNIST IDX files; falling back", data_dir)
    if source in ("auto", "digits"):
        found = load_digits()
        if found is not None:
            return found
        if source == "digits":
            raise ImportError("the digits data set needs scikit-learn (pip install scikit-learn)")
    return synthetic()


def batches(data: Dataset, batch: int, steps: int, seed: int = 0
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of ``batch`` examples, reshuffling at every epoch (deterministic)."""
    rng = np.random.RandomState(seed)
    order = rng.permutation(len(data))
    pos = 0
    for _ in range(steps):
        take = []
        while sum(len(t) for t in take) < batch:
            if pos >= len(order):
                order, pos = rng.permutation(len(data)), 0
            need = batch - sum(len(t) for t in take)
            take.append(order[pos:pos + need])
            pos += len(take[-1])
        idx = np.concatenate(take)
        yield data.images[idx], data.labels[idx]
