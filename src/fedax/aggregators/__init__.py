"""Aggregators: how the server combines the clients' messages (see ``aggregators.base``).

    agg = chain(clip_norm(1.0), mean())
    alg = fedavg(loss_fn, optax.sgd(0.1), aggregator=agg)

Every algorithm takes ``aggregator=`` (default ``mean()``, FedAvg's weighted mean) and keeps
the aggregator's state in its own state; the aggregator's metrics are round metrics.
"""

from fedax.aggregators.base import (
    Aggregator,
    aggregate,
    chain,
    no_state,
)
from fedax.aggregators.clipping import clip_norm
from fedax.aggregators.mean import mean, total

# (the engines' plumbing, ``client_stage``, ``reduce_stage`` and ``round_keys``, stays in
# ``fedax.aggregators.base``: an engine runs an aggregator through ``fedax.algorithms``'
# ``apply_reports``)
__all__ = ["Aggregator", "aggregate", "chain", "clip_norm", "mean", "no_state", "total"]

# User-level differential privacy (DP-FedAvg): fixed clip, adaptive quantile clip, AdaCliP.
from fedax.aggregators.adaclip import AdaClipState, adaclip, adaclip_scale  # noqa: E402
from fedax.aggregators.adaptive_clipping import (  # noqa: E402
    QuantileClipState,
    dp_adaptive_gaussian,
    split_noise_multiplier,
)
from fedax.aggregators.dp import dp_gaussian, per_layer_clips  # noqa: E402

__all__ += ["AdaClipState", "QuantileClipState", "adaclip", "adaclip_scale",
            "dp_adaptive_gaussian", "dp_gaussian", "per_layer_clips", "split_noise_multiplier"]

# Robust reductions (Yin et al., Blanchard et al., Pillutla et al., Sun et al.).
from fedax.aggregators.robust import (  # noqa: E402
    ROBUST_RULES,
    check_private_reduction,
    geometric_median,
    krum,
    krum_scores,
    median,
    multi_krum,
    norm_bounding,
    private_robust,
    robust,
    trimmed_mean,
)

__all__ += ["ROBUST_RULES", "check_private_reduction", "geometric_median", "krum",
            "krum_scores", "median", "multi_krum", "norm_bounding", "private_robust", "robust",
            "trimmed_mean"]

# Compressed uplink: encode on the client, decode on the server (QSGD, Suresh et al.'s
# rotation, top-k, 16/8-bit casts); error feedback is fedax.algorithms.error_feedback.
from fedax.aggregators.compression import (  # noqa: E402
    SCHEMES,
    Compressor,
    cast,
    compressed,
    dp_compressed,
    make_compressor,
    message_bytes,
    qsgd,
    rotation,
    roundtrip,
    top_k,
)

__all__ += ["SCHEMES", "Compressor", "cast", "compressed", "dp_compressed", "make_compressor",
            "message_bytes", "qsgd", "rotation", "roundtrip", "top_k"]

# Secure aggregation: the server learns only the sum (SecAgg+); with distributed DP the
# clients noise their own integers, so no party sees an unnoised sum.
from fedax.aggregators.secure import secure_mean, secure_total  # noqa: E402

__all__ += ["secure_mean", "secure_total"]
from fedax.aggregators.distributed_dp import distributed_dp, distributed_dp_params  # noqa: E402

__all__ += ["distributed_dp", "distributed_dp_params"]
