"""The DP marker primitives, now in ``fedax.federated`` (kept here for older imports)."""

from fedax.federated._dp import CLIP_PRIMITIVE, NOISE_PRIMITIVE, dp_clip, dp_noise

__all__ = ["CLIP_PRIMITIVE", "NOISE_PRIMITIVE", "dp_clip", "dp_noise"]
