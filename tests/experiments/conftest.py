"""Helpers of the experiments' tests."""

import matplotlib.image as mpimg


def assert_png(path):
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
    assert image.std() > 0   # not a blank canvas


