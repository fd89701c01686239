"""FedProto (Tan et al., AAAI 2022), as ``baselines.md`` fixes it.

Client: ``CE + lam * MSE(z, P_y)`` where ``P`` are the global prototypes; a sample whose class has
no global prototype is not regularised (all samples in round 0), and the MSE is the authors'
``nn.MSELoss`` over the whole ``B x d`` batch (see :func:`prototypes.prototype_mse`). After training
the client uploads its local prototypes ``p_k^c`` (Eq. 2, trained model, eval mode, one pass) and
class counts.

Server: ``P^c = 1/|A^c| sum_{k in A^c} p_k^c``, the UNWEIGHTED mean over the clients ``A^c`` that
hold class ``c`` this round (the authors' ``proto_aggregation``). A class nobody holds this round
keeps its previous prototype (its mask stays as it was: a class never held is absent, never zeros).

Protocols: ``dagger`` (default, the paper's FedProto†) also does FedAvg on the weights;
``proto-only`` exchanges prototypes only. ``prototypes=hyper`` sends FedHPro's averaged
hyper-prototypes instead of ``P`` (Table 3).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedhpro import functional
from fedhpro.methods.base import MethodSpec
from fedhpro.methods.fedproto_options import DECLARATION
from fedhpro.methods.fedproto_options import FedProtoOptions as FedProtoOptions
from fedhpro.methods.layout import HOLDERS, Payload
from fedhpro.methods.prototypes import (
    NEAREST_PROTOTYPE,
    PrototypeClient,
    PrototypeServer,
    Uploads,
    merge_prototypes,
)


class FedProtoServer(PrototypeServer):
    rows_averaged = HOLDERS  # P^c: the unweighted mean over the clients that hold class c

    def prototype_step(self, round: int, uploads: Uploads, replies: Sequence[Payload]) -> dict[str, float]:
        new, held = functional.mean_client_prototypes(uploads.prototypes, uploads.present)
        self.prototypes, self.prototype_mask = merge_prototypes(self.prototypes, self.prototype_mask, new, held)
        return {}


class FedProtoClient(PrototypeClient):
    pass


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=FedProtoServer,
    client=FedProtoClient,
    inference_rule=NEAREST_PROTOTYPE,
)
