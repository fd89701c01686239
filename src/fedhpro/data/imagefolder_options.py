"""The declaration of ``dataset=imagefolder`` (its ``data.*`` options), without torch: a config reads it before
torch loads (the data set's code: :mod:`fedhpro.data.imagefolder`)."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.data.decode_options import bit_depth_option, cache_option
from fedhpro.data.spec import DatasetDeclaration
from fedhpro.data.standardize_options import FORMER_FEDERATED, NONE, STANDARDIZE_CHOICES
from fedhpro.options import option


@dataclass
class ImageFolderOptions:
    """``data.*`` of ``dataset=imagefolder``."""

    #: what ``data.standardize=auto`` is here: the fixed [-1, 1] scaling (the paper's and the built-ins')
    STANDARDIZE_AUTO = NONE

    image_size: int = option(32, min=1, help="side of the square images every image is resized to")
    test_fraction: float = option(0.2, gt=0.0, max=0.9, help="share of each class held out for testing where a "
                                                             "folder has no test/ split")
    split_seed: int = option(0, min=0, help="seed of that held-out split (fixed, not the run seed)")
    clients_per_domain: dict[str, int] = option(default_factory=dict,
                                                help="several domains: clients of the domains named (0 leaves one "
                                                     "out); the others share clients=K (else 10) less these, round "
                                                     "robin in sorted order")
    cache: bool = cache_option()
    bit_depth: int = bit_depth_option()
    standardize: str = option("auto", choices=(*STANDARDIZE_CHOICES, FORMER_FEDERATED),
                              help="the tabular data's option, per channel: federated (train is its former name) "
                                   "standardises the inputs by the mean and standard deviation of every client's "
                                   "training images pooled (after bit-depth scaling), as torchvision's Normalize "
                                   "with the data set's statistics; helps low-contrast images. none, and auto: the "
                                   "fixed [-1, 1] scaling. client is refused: clients share their domain's test set")


DECLARATION = DatasetDeclaration(
    name="imagefolder",
    options=ImageFolderOptions,
    description="your images in ImageFolder layout (data_dir=PATH: <class>/, train/ + test/, or <domain>/...), "
                "split by partition=dirichlet|nid2|iid|longtail",
)

__all__ = ["DECLARATION", "ImageFolderOptions"]
