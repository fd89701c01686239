"""The declarations of the paper's benchmarks (their ``data.*`` options, descriptions and run settings), without
torch: a config reads them before torch loads (the benchmarks' code: :mod:`fedhpro.data.benchmarks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedhpro.data.spec import DatasetDeclaration
from fedhpro.errors import ConfigError
from fedhpro.options import option


@dataclass
class ImageOptions:
    """``data.*`` of the label-skew image benchmarks."""

    download: bool = option(False, help="fetch a missing data set with torchvision (mnist, usps, svhn, cifar10, "
                                        "cifar100, sun397; the others have no automatic download)")
    image_size: int | None = option(None, min=8, help="side of the square images (default: the paper's size; "
                                                      "smaller is faster on a CPU, e.g. 64 for ham10000)")
    augment: bool | None = option(None, help="AutoAugment each training batch (default: on for TinyImageNet, "
                                             "as the paper; off otherwise)")
    test_fraction: float | None = option(None, gt=0.0, max=0.9,
                                         help="held-out share where there is no official test set (ham10000 "
                                              "default 0.11, sun397 0.2); ignored otherwise")
    split_seed: int = option(0, min=0, help="seed of that train/test split (fixed, not the run seed)")
    verify: bool = option(True, help="check CIFAR-10/100 and SVHN files against torchvision's published md5 "
                                     "before reading them (false: a copy you made yourself; its pickles are "
                                     "still read without running code)")
    mean: list[float] | None = option(None, help="per-channel mean of the input normalisation, 3 values "
                                                 "(default: the data set's own, e.g. CIFAR-10's "
                                                 "[0.4914,0.4822,0.4465])")
    std: list[float] | None = option(None, help="per-channel std of the input normalisation, 3 values > 0 "
                                                "(default: the data set's own, e.g. CIFAR-10's "
                                                "[0.2470,0.2435,0.2616]; the authors' code: [0.2023,0.1994,0.2010])")

    def __post_init__(self) -> None:
        for name, values, low in (("mean", self.mean, None), ("std", self.std, 0.0)):
            if values is None:
                continue
            if len(values) != 3:
                raise ConfigError(f"data.{name}={values} must hold 3 numbers, one a channel "
                                  f"(e.g. data.{name}=[0.2023,0.1994,0.2010])")
            if low is not None and min(values) <= low:
                raise ConfigError(f"data.{name}={values} must hold numbers > 0 (each channel is divided by it)")


def _layout_option(layout: dict[str, int], paper: str) -> Any:
    """``data.clients_per_domain`` of a domain-skew benchmark, defaulting to the paper's ``layout``."""
    return option(default_factory=lambda: dict(layout),
                  help=f"clients of each domain (the paper: {paper}); `clients=K` spreads K evenly instead")


def _fraction_option(default: float) -> Any:
    return option(default, gt=0.0, max=1.0, help="share of its domain's training set each client samples")


_IMAGE_SIZE_HELP = "side of the square images (default 32)"


@dataclass
class DigitsOptions:
    """``data.*`` of ``digits``."""

    clients_per_domain: dict[str, int] = _layout_option({"mnist": 3, "usps": 7, "svhn": 6, "syn": 4},
                                                        "M:3 U:7 SV:6 SY:4")
    fraction: float = _fraction_option(0.01)
    download: bool = option(False, help="fetch MNIST, USPS and SVHN with torchvision (SYN has no download)")
    verify: bool = option(True, help="check CIFAR-10/100 and SVHN files against torchvision's published md5 "
                                     "before reading them (false: a copy you made yourself; its pickles are "
                                     "still read without running code)")
    image_size: int | None = option(None, min=8, help=_IMAGE_SIZE_HELP)


@dataclass
class OfficeCaltechOptions:
    """``data.*`` of ``office-caltech``."""

    clients_per_domain: dict[str, int] = _layout_option({"caltech": 3, "webcam": 1, "amazon": 2, "dslr": 4},
                                                        "C:3 W:1 A:2 D:4")
    fraction: float = _fraction_option(0.2)
    test_fraction: float = option(0.3, gt=0.0, max=0.9,
                                  help="share of each domain held out for testing (there is no official split)")
    split_seed: int = option(0, min=0, help="seed of that train/test split (fixed, not the run seed)")
    image_size: int | None = option(None, min=8, help=_IMAGE_SIZE_HELP)


@dataclass
class TextOptions:
    """``data.*`` of ``ag-news``."""

    max_length: int = option(256, min=1, help="tokens per text (cut or padded); the model input is (max_length,)")
    vocab_size: int = option(30000, min=3, max=30000,
                             help="vocabulary from the training split, incl. padding (0) and unknown (1); at most "
                                  "textcnn's 30000 embedding rows")


def _declared(name: str, options: type, description: str, run_defaults: dict[str, Any] | None = None
              ) -> DatasetDeclaration:
    return DatasetDeclaration(name, options, description, dict(run_defaults or {}))


#: name -> its declaration; ``fedhpro.data`` declares every one as ``dataset=<name>``, its code the constant
#: :func:`code_attribute` names in :mod:`fedhpro.data.benchmarks` (a new benchmark is one line here and its
#: spec's line there, plus its source's line in :data:`fedhpro.data.loaders.LOADERS` when the source is new)
BENCHMARK_DECLARATIONS: dict[str, DatasetDeclaration] = {declaration.name: declaration for declaration in (
    _declared("digits", DigitsOptions,
              "Digits domain skew: MNIST 3, USPS 7, SVHN 6, SYN 4 clients, 1% each (Table A3)"),
    _declared("office-caltech", OfficeCaltechOptions,
              "Office-Caltech domain skew: Caltech 3, Webcam 1, Amazon 2, DSLR 4, 20% each (Table 2)"),
    _declared("cifar10", ImageOptions, "CIFAR-10, label skew: dirichlet (NID1_alpha, K=10) or nid2 (K=7) (Table 1)"),
    _declared("cifar100", ImageOptions, "CIFAR-100, label skew: dirichlet or nid2 (Table A1)"),
    _declared("ham10000", ImageOptions,
              "HAM10000 skin lesions (7 classes, 224 px), label skew: dirichlet or nid2 (Table 1)"),
    _declared("tinyimagenet", ImageOptions,
              "TinyImageNet (64 px, AutoAugment), label skew: dirichlet or nid2 (Table 1)"),
    _declared("cifar10-lt", ImageOptions,
              "CIFAR10-LT quantity skew: longtail rho (10, 50, 100) then dirichlet 0.5 (Table A2)"),
    _declared("cifar100-lt", ImageOptions, "CIFAR100-LT quantity skew: longtail rho then dirichlet 0.5 (Table A2)"),
    _declared("tinyimagenet-lt", ImageOptions,
              "TinyImageNet-LT quantity skew: longtail rho then dirichlet 0.5 (Table A2)"),
    _declared("ag-news", TextOptions,
              "AG News text: ag-nid, K=10 (AG-NID_K10) or clients=50 (AG-NID_K50) (Table A10)", {"model": "textcnn"}),
    _declared("sun397", ImageOptions, "SUN397 (397 classes): dirichlet, K=100, 20% participation (Table A10)",
              {"participation": 0.2}),
)}


def code_attribute(name: str) -> str:
    """The constant of :mod:`fedhpro.data.benchmarks` that holds benchmark ``name``'s spec (``cifar10-lt`` ->
    ``CIFAR10_LT``)."""
    return name.upper().replace("-", "_")


__all__ = ["BENCHMARK_DECLARATIONS", "DigitsOptions", "ImageOptions", "OfficeCaltechOptions", "TextOptions",
           "code_attribute"]
