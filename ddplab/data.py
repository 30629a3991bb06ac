"""The data of the training notebook: scikit-learn's handwritten digits.

1797 greyscale images of 8 x 8 pixels, ten classes (the digits 0-9), shipped
inside scikit-learn, so nothing is downloaded and every machine, and every
rank, reads exactly the same numbers::

    >>> train_set, test_set = digits()
    >>> len(train_set), len(test_set)
    (1437, 360)
    >>> x, y = train_set[0]
    >>> tuple(x.shape), y.dtype
    ((1, 8, 8), torch.int64)

The split is fixed by a seed and stratified (each digit in the same
proportion in both parts), so every rank that calls ``digits()`` builds the
identical split without talking to the others. Which rank trains on which
samples is the sampler's job (``torch.utils.data.DistributedSampler``), not
the dataset's.
"""

from __future__ import annotations

from functools import lru_cache

from .errors import ConfigError

#: Pixel values in the raw data run from 0 to 16.
_MAX_PIXEL = 16.0


@lru_cache(maxsize=4)
def _split(test_fraction: float, seed: int):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / _MAX_PIXEL).astype(np.float32).reshape(-1, 1, 8, 8)
    return train_test_split(images, labels, test_size=test_fraction, random_state=seed,
                            stratify=labels)


def digits(test_fraction: float = 0.2, seed: int = 0, dtype=None):
    """The digits as ``(train_set, test_set)``, two ``TensorDataset`` of ``(image, label)``.

    Images are ``float32`` tensors of shape ``(1, 8, 8)`` scaled to ``[0, 1]``
    (or ``dtype``, e.g. ``torch.float64`` for exact comparisons); labels are
    ``int64`` class numbers. ``test_fraction`` of the samples, stratified by
    class with ``seed``, go to the test set.
    """
    import torch
    from torch.utils.data import TensorDataset

    if not 0 < test_fraction < 1:
        raise ConfigError(f"ddplab: test_fraction must be between 0 and 1, but got {test_fraction!r}. "
                         f"Use for example test_fraction=0.2.")
    x_train, x_test, y_train, y_test = _split(float(test_fraction), int(seed))
    dtype = dtype or torch.float32

    def tensors(x, y):
        return TensorDataset(torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=torch.int64))

    return tensors(x_train, y_train), tensors(x_test, y_test)
