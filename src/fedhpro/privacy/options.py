"""The ``privacy.*`` options (:class:`PrivacyOptions`) and the questions every module asks of them (:func:`is_private`,
:func:`client_level`, :func:`sample_level`), beside the privacy code and torch-free, as every option declaration:
``fedhpro config`` and a refused ``privacy.*`` value answer before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.options import option

#: ``privacy=MODE`` is short for ``privacy.mode=MODE``; ``privacy.clip=1.0`` etc. are its knobs
PRIVACY_SECTION = "privacy"
#: the values of ``privacy=`` (``privacy.mode``): off, client-level DP, sample-level DP-SGD. Every other module asks
#: :func:`is_private`, :func:`client_level` and :func:`sample_level` rather than comparing the strings
OFF, CLIENT_LEVEL, SAMPLE_LEVEL = "none", "client", "sample"
PRIVACY_MODES = (OFF, CLIENT_LEVEL, SAMPLE_LEVEL)


@dataclass
class PrivacyOptions:
    mode: str = option("none", choices=PRIVACY_MODES,
                       help="differential privacy: none; client (client-level DP: every participating client's "
                            "whole upload clipped to privacy.clip, Gaussian noise added centrally or locally); "
                            "sample (sample-level DP-SGD with Opacus, and everything else a client computes from "
                            "its data privatized too; needs pip install fedhpro[privacy])")
    clip: float = option(1.0, gt=0.0, help="the L2 bound C: of each client's upload (privacy=client), of each "
                                           "sample's gradient and feature (privacy=sample)")
    clipping: str = option("auto", choices=("auto", "joint", "per-group"),
                           help="privacy=client: clip the whole upload (weight update and every class tensor) "
                                "to clip jointly, or each tensor group to clip/sqrt(groups) (the same joint bound); "
                                "auto: the method's measured choice (MethodSpec.dp_clipping: per-group for the "
                                "methods whose raw class rows would take the clip from the update, else joint)")
    noise: str = option("central", choices=("central", "local"),
                        help="privacy=client: the server noises the sum of the clipped uploads (central), or each "
                             "client noises its own upload so the server never sees a clean one (local)")
    noise_multiplier: float = option(1.0, min=0.0, help="sigma: the Gaussian noise's std is sigma x clip (unused "
                                                        "when target_epsilon is set)")
    target_epsilon: float = option(0.0, min=0.0, help="calibrate noise_multiplier so that the planned rounds end at "
                                                      "this epsilon (0: use noise_multiplier as given)")
    delta: float = option(0.0, min=0.0, max=1.0, help="the DP delta (0: 1 / n^1.1, n the number of clients "
                                                      "(client) or of a client's samples (sample))")
    max_epsilon: float = option(0.0, min=0.0, help="stop the run with a clear line before a round would take "
                                                   "epsilon above this (0: no limit)")
    secure_noise: bool | None = option(None, help="draw the privacy noise from the operating system's randomness "
                                                  "instead of the run's seed (anyone who knows the seed can redraw "
                                                  "seeded noise; a run is then not reproducible); unset: true on "
                                                  "Flower, false in the simulator (reproducible)")
    publish_participants: bool = option(False, help="privacy=client: write each round's participant ids (and the "
                                                    "ids of dropped clients) into metrics.jsonl; off, the run folder "
                                                    "holds only their number, since amplification by sampling "
                                                    "assumes nobody who sees the model knows who took part")
    clip_quantile: float = option(0.0, min=0.0, max=0.99,
                                  help="privacy=client: adaptive clipping (Andrew et al. 2021): after every round "
                                       "the clip moves geometrically towards this quantile of the clients' update "
                                       "norms, estimated from their noised count of norms below the clip (a "
                                       "release the accountant counts), starting at privacy.clip; 0: the clip "
                                       "stays privacy.clip")
    clip_lr: float = option(0.2, gt=0.0, help="adaptive clipping's step: clip *= exp(-clip_lr x (fraction of "
                                              "clients below the clip - clip_quantile)) after every round")
    quantile_noise: float = option(0.0, min=0.0, help="adaptive clipping: the std of the Gaussian noise on the "
                                                      "count of clients below the clip (0: the expected clients a "
                                                      "round / 20, Andrew et al.'s choice)")
    noise_cohort: int = option(0, min=0, help="privacy=client, central noise: calibrate the noise and the "
                                              "accountant as if this many clients took part each round while "
                                              "participation x clients train (a simulation of a larger cohort on a "
                                              "small machine: its epsilon is that cohort's, not this run's); "
                                              "0: the run's own cohort")
    accountant: str = option("rdp", choices=("rdp", "pld"),
                             help="the privacy accountant: rdp (Renyi DP) or pld (privacy loss distributions, "
                                  "tighter: a smaller epsilon for the same noise)")


def privacy_mode(options: PrivacyOptions | None) -> str:
    """``options.mode`` of the ``privacy.*`` options; None: off."""
    return str(options.mode) if options is not None else OFF


def is_private(options: PrivacyOptions | None) -> bool:
    """Whether the ``privacy.*`` options switch differential privacy on (either level)."""
    return privacy_mode(options) != OFF


def client_level(options: PrivacyOptions | None) -> bool:
    """Whether they ask for client-level DP (``privacy=client``)."""
    return privacy_mode(options) == CLIENT_LEVEL


def sample_level(options: PrivacyOptions | None) -> bool:
    """Whether they ask for sample-level DP-SGD (``privacy=sample``)."""
    return privacy_mode(options) == SAMPLE_LEVEL


__all__ = ["CLIENT_LEVEL", "OFF", "PRIVACY_MODES", "PRIVACY_SECTION", "PrivacyOptions", "SAMPLE_LEVEL",
           "client_level", "is_private", "privacy_mode", "sample_level"]
