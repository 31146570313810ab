"""Kept for imports of ``aft_vision.layers.policy``: the device policy lives in ``dispatch.py``."""
from .dispatch import POLICIES, device_policy, get_device_policy, product_dtype  # noqa: F401
