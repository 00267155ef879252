"""nn/module.py: what a module reports of itself."""

import pytest

from mpifsdp.nn.module import Module


def test_settings_are_plain_values_and_report_what_changes_the_mathematics():
    """Module.settings(): train/eval and each module's SETTINGS, compared across ranks and saved with
    checkpoints; a setting that is no plain value would compare by its address (different on every
    rank): refused by name."""
    import numpy as np

    from mpifsdp.nn.layers import Dropout, LayerNorm

    class Scaled(Module):
        SETTINGS = ("factor",)

        def __init__(self, factor):
            self.factor = factor
            self.norm, self.drop = LayerNorm(4, eps=np.float32(1e-3)), Dropout(0.25)

    model = Scaled(np.int64(3)).eval()
    assert model.settings() == {
        "": {"factor": 3, "training": False},
        "norm": {"eps": float(np.float32(1e-3)), "training": False},
        "drop": {"p": 0.25, "training": False},
    }
    assert model.settings(of_the_weights=True) == {
        "": {"factor": 3},
        "norm": {"eps": float(np.float32(1e-3))},
    }
    with pytest.raises(TypeError, match=r"Scaled.SETTINGS names factor=\[3\]: settings are plain values"):
        Scaled([3]).settings()
