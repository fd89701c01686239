"""What a table's caption says about the data the runs were trained on: the data set and its partition with the
parameters that shape it ("Dirichlet label skew (alpha = 0.3)"), read from each run's settings (its
``config.yaml``, or the :class:`~fedhpro.config.Config` of a run about to start), and, for ``partition=auto``,
the scheme the run resolved it to (its ``partition.json``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhpro.bounded import read_json_file, run_file
from fedhpro.errors import DataError

#: the keys of the ``partition`` section every scheme has (a plug-in partitioner's own knobs are the others)
BASE_KEYS = ("scheme", "alpha", "min_size", "max_retries", "rho", "single_class_clients", "two_class_fraction",
             "seed", "load")


def _number(value: Any) -> str:
    """``0.3`` -> "0.3", ``100.0`` -> "100" (as a person writes a parameter)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolved_scheme(folder: Path | None) -> str | None:
    """The scheme a run of ``partition=auto`` used, as its ``partition.json`` records it; None when the folder
    has none (the run has not drawn its partition yet, or it was written by hand)."""
    if folder is None:
        return None
    path = run_file(folder, "partition.json")
    if not path.is_file():
        return None
    record = read_json_file(path, DataError)
    scheme = record.get("scheme") if isinstance(record, dict) else None
    return scheme if isinstance(scheme, str) else None


def scheme_text(scheme: str, section: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    """One partition scheme with the parameters that shape it, in words (``section``: the ``partition``
    settings; ``data``: the ``data`` settings, whose ``fraction`` sizes a domain-skew client)."""
    alpha = _number(section.get("alpha", 0.5))
    if scheme == "iid":
        return "IID (every client the same label mix)"
    if scheme == "dirichlet":
        return f"Dirichlet label skew (alpha = {alpha})"
    if scheme == "longtail":
        rho = _number(section.get("rho", 100.0))
        return f"long-tailed classes (rho = {rho}), Dirichlet label skew (alpha = {alpha})"
    if scheme == "nid2":
        single = section.get("single_class_clients")
        return ("NID2 pathological label skew (" + ("K - 1" if single is None else str(single))
                + " single-class clients, the others every class)")
    if scheme == "ag-nid":
        share = section.get("two_class_fraction")
        return ("AG-NID label skew (2-class clients: " + ("50% for K <= 10, else 80%" if share is None
                                                          else f"{float(share):.0%}") + ")")
    if scheme == "domains":
        fraction = data.get("fraction")
        share = f"{float(fraction):.0%}" if isinstance(fraction, (int, float)) else "a share"
        return f"domain skew (each client samples {share} of one domain)"
    own = [f"{key} = {_number(value)}" for key, value in section.items() if key not in BASE_KEYS]
    return f"partition={scheme}" + (f" ({', '.join(own)})" if own else "")


def partition_text(config: Mapping[str, Any], folder: Path | None = None) -> str:
    """A run's partition in words, from its nested settings (``config.yaml``, ``Config.to_dict()``): the scheme and
    its parameters (:func:`scheme_text`), the partition's own seed when set, the file it was loaded from
    (``partition.load``). ``partition=auto`` is the scheme the run resolved it to (``folder``'s
    ``partition.json``), or "the data set's own partition" before the run has drawn it."""
    section = config.get("partition")
    if not isinstance(section, Mapping):
        return "partition not recorded"
    data = config.get("data")
    data = data if isinstance(data, Mapping) else {}
    if section.get("load"):
        return f"the partition loaded from {section['load']}"
    scheme = str(section.get("scheme", "auto"))
    if scheme == "auto":
        resolved = resolved_scheme(folder)
        text = "the data set's own partition (partition=auto)" if resolved is None else \
            scheme_text(resolved, section, data)
    else:
        text = scheme_text(scheme, section, data)
    return text + (f", partition seed {section['seed']}" if section.get("seed") is not None else "")


def data_text(config: Mapping[str, Any], folder: Path | None = None) -> str | None:
    """The data set and its partition: ``digits-offline, Dirichlet label skew (alpha = 0.3)``; None for settings
    that record neither (a run folder without its ``config.yaml``)."""
    if "dataset" not in config and "partition" not in config:
        return None
    return f"{config.get('dataset', 'data set not recorded')}, {partition_text(config, folder)}"


def data_sentence(described: Mapping[str, str | None], names: Sequence[str] | None = None) -> str:
    """``described`` (a row's name -> its data in words, :func:`data_text`; None: not recorded) as a caption's
    sentence: ``Data: <text>.`` when every row has the same, else each text with the rows it holds for
    (``Data: A, for FedAvg, FedProx; B, for FedHPro.``), never one text claimed for rows it does not fit; ``""``
    when no row recorded its data. ``names``: how the rows are shown (default: their keys)."""
    shown = dict(zip(described, names if names is not None else list(described)))
    texts: dict[str | None, list[str]] = {}
    for row, text in described.items():
        texts.setdefault(text, []).append(shown[row])
    if set(texts) == {None}:
        return ""
    if len(texts) == 1:
        return f"Data: {next(iter(texts))}."
    each = [f"{text or 'not recorded'}, for {', '.join(rows)}" for text, rows in texts.items()]
    return "Data: " + "; ".join(each) + "."
