"""The declaration of ``dataset=huggingface`` (its ``data.*`` options), without torch: a config reads it before
torch loads (the data set's code: :mod:`fedhpro.data.huggingface`)."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.data.spec import DatasetDeclaration
from fedhpro.options import option


@dataclass
class HuggingFaceOptions:
    """``data.*`` of ``dataset=huggingface``."""

    path: str | None = option(None, help="a folder saved with save_to_disk, or a hub name (needs the network)")
    config_name: str | None = option(None, help="hub data sets: the configuration (load_dataset's name=)")
    image_column: str | None = option(None, help="the column of the images (default: the one column whose "
                                                  "feature type is datasets.Image, else the column 'image')")
    text_column: str | None = option(None, help="the column of texts; set it for text (model=textcnn)")
    label_column: str | None = option(None, help="the column of the class labels (default: the one column whose "
                                                  "feature type is datasets.ClassLabel, else the column 'label')")
    max_classes: int = option(100_000, min=1, help="the most classes the data set may have: a larger label is "
                                                   "refused (a guard against a corrupt file exhausting memory)")
    train_split: str = option("train", help="the training split of a DatasetDict")
    test_split: str = option("test", help="the test split of a DatasetDict (absent: held out of the training split)")
    test_fraction: float = option(0.2, gt=0.0, max=0.9, help="share of each class held out for testing where "
                                                             "there is no test split")
    split_seed: int = option(0, min=0, help="seed of that held-out split (fixed, not the run seed)")
    image_size: int = option(32, min=1, help="side of the square images every image is resized to")
    max_length: int = option(256, min=1, help="text: tokens per text (cut or padded)")
    vocab_size: int = option(30000, min=3, max=30000, help="text: vocabulary from the training split, incl. "
                                                           "padding (0) and unknown (1)")


DECLARATION = DatasetDeclaration(
    name="huggingface",
    options=HuggingFaceOptions,
    description="a Hugging Face data set (data.path=FOLDER from save_to_disk, or a hub name; images or "
                "data.text_column), split by partition=dirichlet|nid2|iid|longtail; needs fedhpro[hf]",
)

__all__ = ["DECLARATION", "HuggingFaceOptions"]
