"""How a run speaks to its user: the :class:`Voice` (printed by ``fedhpro run``, logged by the Flower
ServerApp), the progress bar's text and the final table (:func:`final_printout`) with its lines of
summary.json's blocks."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm.auto import tqdm

from fedhpro import reports


class Voice(Protocol):
    """How a run speaks to its user: :class:`ConsoleVoice` prints (``fedhpro run``), the Flower ServerApp logs."""

    def note(self, line: str) -> None:
        """A note of the run's start (how the data were read), kept in summary.json's notes too."""
        ...

    def warning(self, line: str) -> None:
        """A warning: said before the first round (and kept in summary.json's notes), or a dropped client."""
        ...

    def stopped(self, line: str) -> None:
        """The line of a run that ``privacy.max_epsilon`` ended before its last round (a normal end)."""
        ...

    def printout(self, text: str) -> None:
        """The run's final table (:func:`final_printout`)."""
        ...


def warn_line(message: str) -> None:
    """One warning line on stderr that leaves the progress bar intact."""
    tqdm.write(f"fedhpro: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class ConsoleVoice:
    """``fedhpro run``'s voice: warnings on stderr always; with ``echo`` notes and the final table on stdout."""

    echo: bool = False

    def note(self, line: str) -> None:
        if self.echo:
            print(f"note: {line}")

    def warning(self, line: str) -> None:
        warn_line(line)

    def stopped(self, line: str) -> None:
        tqdm.write(f"fedhpro: {line}", file=sys.stderr)  # below a progress bar, if one is shown

    def printout(self, text: str) -> None:
        if self.echo:
            print(text)


#: the voice of a run that prints nothing but its warnings
QUIET = ConsoleVoice()


def final_printout(summary: Mapping[str, Any], title: str) -> str:
    """What a run prints at its end (``summary``: its summary.json): ``title``, the pooled accuracy per test
    set and AVG (or that no round was evaluated), the clients' own accuracies' unweighted mean and median and,
    with privacy on, the (epsilon, delta) spent. Where sizes are claims (``size_claims``) it leads with the
    median site's accuracy, which one site cannot carry, and says how the pooled figure is bounded."""
    if summary["accuracy"] is None:
        lines = [f"{title} no round evaluated"]
    else:
        lines = [reports.accuracy_table({**summary["per_domain"], "AVG": summary["accuracy"]}, title)]
        if "site_accuracy" in summary:
            lines.append(site_accuracy_line(summary["site_accuracy"], summary["clients"]))
        claims = summary.get("size_claims")
        if claims is not None:
            lines = [lines[-1] + " (one site cannot move the median)"] + lines[:-1]
            bounds = ([f"{claims['max_ratio']:g} x the median site's"] if claims["max_ratio"] > 0 else []) + (
                [f"{claims['max_share']:g} of a test set's total"] if claims["max_share"] < 1 else [])
            lines.append("pooled accuracy: the sites' test sizes are claims; "
                         + (f"each counts as at most {' and '.join(bounds)}" if bounds else "nothing bounds them"))
    if summary.get("validation", {}).get("best_round") is not None:
        lines.append(validation_line(summary["validation"]))
    if "unseen" in summary:
        unseen = summary["unseen"]
        shown = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
        lines.append(f"unseen clients (never trained): global model AVG {shown(unseen['accuracy']['AVG'])}"
                     + (f"; after fine-tuning AVG {shown(unseen['finetuned']['AVG'])}" if "finetuned" in unseen
                        else ""))
    if "privacy" in summary:
        lines.append(privacy_line(summary["privacy"]))
    return "\n".join(lines)


def validation_line(validation: Mapping[str, Any]) -> str:
    """The printout's line of summary.json's ``validation``: the final validation AVG, and the round chosen on
    it with its test AVG."""
    final = validation["accuracy"]
    test = validation["test_at_best"]
    return (f"validation (held out of training): AVG {'-' if final is None else f'{final:.2f}'}; best round "
            f"{validation['best_round'] + 1} by validation ({validation['best_accuracy']:.2f}), test AVG there "
            f"{'-' if test is None else f'{test:.2f}'}")



def progress_bar(total: int, description: str, enabled: bool, initial: int = 0) -> Any:
    if not enabled:
        return None
    return tqdm(total=total, initial=initial, desc=description, unit="round", file=sys.stderr, dynamic_ncols=True,
                bar_format="{desc}: round {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")


def progress_text(train: Mapping[str, float], accuracy: Mapping[str, float] | None,
                  privacy: Mapping[str, float] | None = None) -> str:
    """The progress bar's text after a round: the clients' mean cross-entropy (``ce`` in metrics.jsonl's
    ``train``) when the method reports it, else its whole training loss, each labelled (the whole loss can
    hold constant terms, such as HPCL's, that make it climb while training improves); then the last AVG;
    with privacy on, the (epsilon, delta) spent so far."""
    shown = next(((label, train[name]) for name, label in (("ce", "train CE"), ("loss", "train loss"))
                  if name in train), None)
    loss = f"{shown[0]} {shown[1]:.3f}  " if shown is not None else ""
    text = loss + "AVG " + (f"{accuracy['AVG']:.2f}%" if accuracy else "-")
    if privacy is not None:
        text += f"  eps {privacy['epsilon']:.3g} (delta {privacy['delta']:.2g})"
    return text



def site_accuracy_line(site: Mapping[str, Any], clients: int) -> str:
    """The printout's line of :func:`site_accuracy` for a run of ``clients`` clients."""
    tested = site["tested"]
    counted = f"{tested} tested" if tested == clients else f"{tested} of {clients} tested"
    if site["mean"] is None:
        return f"per client (unweighted): no client tested ({counted})"
    return f"per client (unweighted, {counted}): mean {site['mean']:.1f}, median {site['median']:.1f}"


def privacy_line(privacy: Mapping[str, Any]) -> str:
    """The printout's line of summary.json's ``privacy``: the (epsilon, delta) the run spent, and whether
    ``privacy.max_epsilon`` stopped it (printed whatever ``progress`` is: the progress bar is not a record)."""
    delta = privacy.get("delta")
    rounds = privacy.get("rounds_run")
    text = (f"privacy ({privacy.get('mode', 'on')}): (epsilon, delta) = ({float(privacy['epsilon']):.4g}, "
            + (f"{float(delta):.3g}" if delta is not None else "-") + ")"
            + (f" after {rounds} round{'s' if rounds != 1 else ''}" if rounds is not None else ""))
    if privacy.get("stopped"):
        text += "; stopped at privacy.max_epsilon"
    if privacy.get("noise_cohort"):
        text += f", as if {privacy['noise_cohort']} clients took part a round (privacy.noise_cohort: simulated)"
    return text
