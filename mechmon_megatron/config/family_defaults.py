"""The shipped detector settings of each family (``detectors.attn``, ``router``, ``optim``,
``fp8``, ``global``): which signals each judges, how, and why."""

from __future__ import annotations

from mechmon_megatron.config.family_rules import (
    BaselineConfig,
    BoundsConfig,
    CusumConfig,
    FamilyDetectorConfig,
)

__all__ = ["attn_family", "router_family", "optim_family", "fp8_family", "global_family"]

_ATTN_ENTROPIES = [
    "attn/delta2/entropy/layer_*/min",
    "attn/layer_delta2/entropy/layer_*",
    "attn/dwq/entropy/layer_*/min",
    "attn/dwk/entropy/layer_*/min",
]


def attn_family() -> FamilyDetectorConfig:
    # Spectral entropies against the other layers at the same step (a biased kernel drives a few
    # layers; warm-up and LR decay move all of them); the cosine of successive updates is
    # scale-free, so it is read as is and rises when one direction is written step after step.
    # A layer's max logit (where the core attention keeps it) grows with the size of the drift
    # its spectrum sees the direction of, and grows slowly in healthy runs as the weights do:
    # it is judged for jumps against its own trailing window, upward.
    return FamilyDetectorConfig(
        signals=[*_ATTN_ENTROPIES, "attn/coherence/cos/layer_*/max", "attn/max_logit/max/layer_*"],
        direction="down",
        directions={"attn/coherence/**": "up", "attn/max_logit/**": "up"},
        jump_signals=["attn/max_logit/max/layer_*"],
        # The max logit is the step's own (a function of its batch and weights) where the
        # core attention resets it every step; a fault that diverges within an interval
        # writes it step after step: escalation looks at it (monitors/max_logit.py).
        look_signals=["attn/max_logit/max/layer_*"],
        peer_signals=list(_ATTN_ENTROPIES),
        # A biased kernel moves every entropy of its layer and the update cosine a little, and
        # spreads to the other layers: one statistic per layer, against its peers and itself.
        pooled_signals=[*_ATTN_ENTROPIES, "attn/coherence/cos/layer_*/max"],
        # Peer log-ratios are scale-free and the cosine lives in [-1, 1]: a scale floor of
        # 0.02 (2% of the peers' level, 0.02 in cosine) keeps the small wobbles of
        # a short warm-up from reading as large z; slow drift of the peer offsets is tracked.
        baseline=BaselineConfig(mode="tracked", track_rate=0.02, min_abs_scale=0.02),
    )


def router_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=[
            "router/entropy_mean/layer_*",
            "router/weight_cosine/layer_*",
            "router/maxvio/layer_*",
        ],
        direction="up",
        directions={"router/entropy_mean/*": "down"},
        # A collapsing router drives its mean entropy toward 0: judged as log entropy, so the
        # collapse reads as the many-fold drop it is (1.03 -> 0.03 nats is -3.6 in log; on the
        # linear scale, 3.9 warm-up scales at most, under CUSUM's drift once the kind's
        # autocorrelation is credited).
        log_signals=["router/entropy_mean/*"],
        # Routing entropy and load are the step's batch's: escalation looks at them (the
        # router's weight geometry moves slowly: a look at it would repeat the regular sample).
        look_signals=["router/entropy_mean/layer_*", "router/maxvio/layer_*"],
        # Experts specialise and routing sharpens slowly in healthy training: the baseline
        # follows unsuspicious samples; its scale is floored at 2% of the level.
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.02),
    )


def optim_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=["optim/sharpness/eos_ratio", "optim/sharpness/eos_ratio_lr_rise",
                 # over one step or the monitor's interval (live), two checkpoints (scan)
                 "optim/update_ratio_step/*", "optim/update_ratio_interval/*",
                 "optim/update_ratio_ckpt/*"],
        direction="up",
        # Twice Adam's edge of stability on two of three estimates. The edge itself (ratio 1,
        # eta lambda = 38 at beta1 = 0.9) is where healthy Adam settles (Cohen et al. 2022),
        # and one micro-batch's estimate overshoots the full-batch value: healthy runs show
        # single estimates of 1-2.8. At ratio 2 the top mode's iterate grows x5.5 per step
        # (x1 at the edge), so two such estimates are an instability, not hovering.
        signal_bounds={"optim/sharpness/eos_ratio": BoundsConfig(max=2.0, k=2, n=3),
                       # On an LR rise: the step's estimate and the last one carried to the
                       # new LR (another step, another micro-batch) are the two estimates.
                       "optim/sharpness/eos_ratio_lr_rise": BoundsConfig(max=2.0, k=1, n=1)},
        # Sampled only on LR rises: no baseline to speak of.
        bound_only=["optim/sharpness/eos_ratio_lr_rise"],
        # Below the edge (ratio 1) the top mode contracts: a rise there, however far from the
        # run's baseline, is progressive sharpening, not an instability (Cohen et al. 2021).
        alarm_above={"optim/sharpness/eos_ratio": 1.0},
        # Update ratios fall with LR decay and drift with weight growth: a tracked baseline, a
        # scale floor of 5% of the level (their sample-to-sample noise).
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.05),
    )


def fp8_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=[
            "fp8/amax_log2/*/layer_*",
            "fp8/headroom_log2/*/layer_*",
        ],
        direction="up",
        directions={"fp8/headroom_log2/**": "down"},
    )


def global_family() -> FamilyDetectorConfig:
    # Loss and grad norm drift by design (the loss falls and plateaus, the grad norm rises as
    # the LR decays, and with weight decay faster late in the schedule): a CUSUM accumulates the
    # schedule's slow drift (a healthy 1-layer run with cosine decay raised one as the grad norm
    # rose from 1.3 to 2.0 over 600 steps), and so did robust z against a baseline formed
    # early (a healthy MoE run with weight decay 0.1: grad norm 2.1 against 1.44 +- 0.11 at
    # step 4,900 of 5,000). Both are judged as jumps against their own trailing window;
    # sudden jumps (robust z with persistence) and a non-finite loss are this family's alarms.
    return FamilyDetectorConfig(
        signals=["global/loss", "global/grad_norm"],
        direction="up",
        cusum=CusumConfig(enabled=False),
        jump_signals=["global/loss", "global/grad_norm"],
        # Jump log-ratios sit near 0: an absolute scale floor of 1 % (a 1 % jump).
        baseline=BaselineConfig(mode="tracked", track_rate=0.02, min_rel_scale=0.0,
                                min_abs_scale=0.01),
    )

