"""FedDecorr (Shi et al., ICLR 2023): FedAvg plus a feature-decorrelation term, a client-side plug-in.

Each client minimises ``CE + beta * L_decorr`` on every batch, where ``L_decorr``
is the squared Frobenius norm of the correlation matrix of the batch's features
``z`` (standardised per dimension over the batch), divided by ``d^2``. It fights
the dimensional collapse of the features under heterogeneous data. The server is
FedAvg's.

The client shows the hooks of :class:`fedhpro.methods.Client` (its ``fit`` is one
fixed sequence for every method; a method only fills in the hooks):

* ``prepare(round)``: before training, on the received model; here it notes the
  features' width, reported with the losses (``round.notes``);
* ``loss_terms(round)``: returns ``Batch -> {name: term}``; the batch carries
  ``x, y, z, logits`` (and the outputs of ``activation_modules``, if declared);
* ``upload(round)``: what the reply holds besides the weights; a key uploaded
  here must be declared in the server's ``reply_layout`` (per-class tensors as
  ``ClassRows``). Here: the class counts, so the server can report how many
  classes the round saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedhpro.methods import Batch, ClassRows, Client, LocalRound, MethodSpec, Server
from fedhpro.options import option


@dataclass
class FedDecorrOptions:
    beta: float = option(0.1, min=0.0, help="weight of the decorrelation term (0: FedAvg)")


def decorrelation_loss(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``||corr(z)||_F^2 / d^2`` of a ``B x d`` batch of features."""
    z = z.reshape(z.shape[0], -1)
    z = (z - z.mean(0)) / (z.std(0) + eps)
    corr = z.T @ z / z.shape[0]
    return corr.pow(2).sum() / z.shape[1] ** 2


class FedDecorrClient(Client):
    def prepare(self, round: LocalRound) -> None:
        round.notes["feature_dim"] = float(round.model.classifier.in_features)

    def loss_terms(self, round: LocalRound):
        beta = float(self.options.beta)
        if beta == 0:
            return None  # CE only: FedAvg's update, bit for bit

        def terms(batch: Batch) -> dict[str, torch.Tensor]:
            return {"decorr": beta * decorrelation_loss(batch.z)}

        return terms

    def upload(self, round: LocalRound):
        return {"class_counts": torch.bincount(round.data.y, minlength=self.num_classes)[:self.num_classes]}


class FedDecorrServer(Server):
    def reply_layout(self):
        return {**super().reply_layout(), "class_counts": ClassRows((self.num_classes,), torch.int64)}

    def aggregate(self, round, replies):
        metrics = super().aggregate(round, replies)
        held = torch.stack([reply["class_counts"] for reply in replies]).sum(0) > 0
        return {**metrics, "classes_seen": float(held.sum())}


METHOD = MethodSpec(name="feddecorr", options=FedDecorrOptions, server=FedDecorrServer, client=FedDecorrClient,
                    description="FedDecorr: CE + beta * feature-decorrelation term on the clients; FedAvg server")
