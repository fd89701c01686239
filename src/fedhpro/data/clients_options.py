"""The declaration of ``dataset=clients`` (its ``data.*`` options), without torch: a config reads it before torch
loads (the data set's code: :mod:`fedhpro.data.clients`)."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.data.decode_options import bit_depth_option, cache_option
from fedhpro.data.spec import DatasetDeclaration
from fedhpro.data.standardize_options import STANDARDIZE_CHOICES, STATISTICS_LIMIT
from fedhpro.options import option

#: ``data.untrained_classes``: a class with test samples but no training sample at any client is refused, or kept
UNTRAINED_CHOICES = ("refuse", "keep")


@dataclass
class ClientsOptions:
    """``data.*`` of ``dataset=clients``."""

    image_size: int = option(32, min=1, help="image clients: side of the square images every image is resized to")
    classes: list[str] | None = option(None, help="class names in label order (default: the clients' classes.txt, "
                                                  "else the sorted union of their class folders)")
    num_classes: int | None = option(None, min=1, help="tensor clients: number of classes (default: the largest "
                                                       "label + 1)")
    max_classes: int = option(100_000, min=1, help="the most classes a federation may have: a label, a class "
                                                   "list or a node's description naming more is refused (a "
                                                   "guard against a corrupt or hostile file exhausting memory)")
    cache: bool = cache_option()
    bit_depth: int = bit_depth_option()
    standardize: str = option("auto", choices=STANDARDIZE_CHOICES,
                              help="tensor clients with float N x F features, scaled to mean 0 and std 1 per "
                                   "feature: federated (one scaling shared by every site: the mean and std of all "
                                   "sites' training rows pooled, combined from each site's count, sum and sum of "
                                   "squares), client (each site's own training mean and std: nothing leaves it, but "
                                   "sites of different classes are mapped onto each other), none (as saved), or "
                                   "auto (federated; client under privacy=, whose noise the sums do not carry)")
    statistics_limit: float = option(STATISTICS_LIMIT, min=0.0,
                                     help="data.standardize=federated with 3 sites or more: a site whose feature "
                                          "sums make a feature's pooled std more than this many times what the "
                                          "other sites give is left out of the shared scaling, with a warning "
                                          "(a guard against one site's sums squashing every site's inputs); 0: off")
    feature_mean: list[float] | None = option(None, help="data.standardize=federated: the shared mean per feature "
                                                         "(default: combined from the sites' sums; a resumed run "
                                                         "and late Flower nodes get the run's own)")
    feature_std: list[float] | None = option(None, help="data.standardize=federated: the shared std per feature, "
                                                        "each > 0 (with data.feature_mean)")
    feature_low: list[float] | None = option(None, help="data.standardize=federated under secure aggregation "
                                                        "(SecAgg+): each feature's public lower bound; the sums "
                                                        "the server adds up securely are of features clipped to "
                                                        "[feature_low, feature_high] (training uses them as they are)")
    feature_high: list[float] | None = option(None, help="data.standardize=federated under SecAgg+: each feature's "
                                                         "public upper bound, above its data.feature_low")
    label_column: str = option("label", help="CSV clients and tables: the column of labels, class indices 0..C-1 or "
                                             "class names (text); every other column is a numeric feature")
    site_column: str = option("site", help="data_dir=one table (a .csv file, or a folder with train.csv and "
                                           "test.csv): the column naming each row's site")
    split_column: str = option("split", help="data_dir=one .csv file of several sites: the column saying train or "
                                             "test for each row")
    untrained_classes: str = option("refuse", choices=UNTRAINED_CHOICES,
                                    help="a class with test samples but no training sample at any client, which the "
                                         "model never learns: refuse (the run stops, naming it) or keep (its test "
                                         "samples are tested, and count as errors; a note names it)")


DECLARATION = DatasetDeclaration(
    name="clients",
    options=ClientsOptions,
    description="your federation, already split: data_dir=PATH with one folder per client (train/<class>/ images "
                "or train.npz/.pt/.csv tables, optional test split), or one CSV table with a site column",
)

__all__ = ["ClientsOptions", "DECLARATION", "UNTRAINED_CHOICES"]
