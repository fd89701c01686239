"""How a federation's clients are tested, where the federation is held: the in-process simulator, and the
Flower ServerApp in partition mode (it builds the data set, not a simulator).

One global model on test sets shared per domain is tested once per test set; personal models, or a
federation that arrives split (each client with its own test split), are tested client by client and the
counts pooled per test set (:meth:`~fedhpro.engines.protocol.RoundProtocol.pooled_accuracy`). A Flower node
computes one client's count with the same :func:`~fedhpro.engines.one_round.test_client`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from fedhpro.data.federation import Federation
from fedhpro.engines.evaluation import TestCount, pool_accuracy
from fedhpro.engines.one_round import count_correct, test_client
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.errors import ConfigError
from fedhpro.methods.no_grad import no_grad_precision
from fedhpro.methods.training import TrainSettings, train_epochs


def evaluate(model: nn.Module, test_sets: dict[str, tuple[Tensor, Tensor]],
             batch_size: int | None = None, amp: str = "off") -> dict[str, float]:
    """Accuracy in percent on each test set, plus ``AVG``, their unweighted mean (the paper's AVG); the forward
    passes in the precision of the run's training (``amp``: :func:`~fedhpro.methods.no_grad.no_grad_precision`)."""
    counts = []
    for name, (x, y) in test_sets.items():
        with no_grad_precision(amp, x.device):
            counts.append(TestCount(name, count_correct(model, x, y, batch_size), int(y.shape[0])))
    return pool_accuracy(counts)


class FineTune(NamedTuple):
    """How an unseen client fine-tunes a copy of the global model before its last test: ``epochs`` of the
    shared training loop with plain cross-entropy under the run's ``train`` settings, its batches drawn from
    a generator of its own (the run's ``seed`` and its index); ``epochs`` 0: no fine-tuning."""

    train: TrainSettings
    epochs: int = 0
    seed: int = 0


#: the generator stream of an unseen client's fine-tuning
FINETUNE_STREAM = 0x66746E


class ClientTests:
    """The tests of ``federation``'s clients: the method's ``server`` part (its global weights and inference
    rule), the clients' ``models`` (:class:`~fedhpro.engines.simulator.ClientModels`), the run's ``protocol``
    (its bounds on pooled test counts) and its training precision ``amp``; ``finetune``: how the unseen
    clients (``federation.unseen``) fine-tune before the last test."""

    def __init__(self, federation: Federation, models: Any, server: Any, protocol: RoundProtocol, amp: str = "off",
                 finetune: FineTune | None = None):
        self.federation, self.models, self.server, self.protocol, self.amp = federation, models, server, protocol, amp
        self.finetune = finetune
        if federation.unseen is not None and self.personal:
            raise ConfigError("unseen_clients / unseen_domain: this run trains personal models (heterogeneous "
                              "models or a prototype-only protocol), and an unseen client has none to be tested "
                              "with; not available yet for such runs")

    @property
    def personal(self) -> bool:
        """Whether each client keeps a model of its own (heterogeneous or prototype-only)."""
        return bool(self.models.personal)

    def client_test(self, k: int) -> tuple[str, tuple[Tensor, Tensor]]:
        """``(test-set name, (x, y))`` client ``k`` is tested on: its own split (federations that arrive
        split), else its domain's test set."""
        name = self.federation.client_test_name(k)
        if self.federation.client_tests is not None:
            return name, self.federation.client_tests[k]
        return name, self.federation.test_sets[name]

    def pooled_test_sizes(self) -> list[tuple[str, int]]:
        """Each client's ``(test-set name, size)`` when :meth:`evaluate_clients` pools the clients' test counts
        (personal models, or a federation that arrives split); ``[]`` for one global model on shared test sets,
        which is tested once per test set (no client's count is pooled). What
        :func:`~fedhpro.engines.size_claims.pooled_share_warnings` reads."""
        if not self.personal and self.federation.client_tests is None:
            return []
        return [(name, int(y.shape[0])) for name, (_, y) in map(self.client_test, range(self.federation.num_clients))]

    def evaluate_client(self, k: int, model: nn.Module | None = None,
                        test: tuple[str, tuple[Tensor, Tensor]] | None = None) -> TestCount:
        """Client ``k``'s test count: the global model (one shared model), or its personal model with the
        global shared part, through the server's inference rule, on :meth:`client_test` (or on ``test``, a
        named set: its validation part). A Flower node computes the same with its own model and data."""
        shared = None
        if model is None:
            model = self.models.model_for(k) if self.personal else self.models.eval_model
            shared = self.server.global_weights()
        name, data = self.client_test(k) if test is None else test
        return test_client(self.server, model, name, data, shared, personal=self.personal, amp=self.amp)

    @property
    def validates(self) -> bool:
        """Whether the clients hold validation parts (``validation=``)."""
        return self.federation.client_validation is not None

    def evaluate_validation(self) -> dict[str, float]:
        """Accuracy on the clients' validation parts, as :meth:`evaluate_clients` measures the test sets: each
        client's part tested with the model it would be tested with (the global one, or its personal model),
        the counts pooled per domain (the clients' ``client_domains``; ``all`` for a client without one) and
        ``AVG`` their unweighted mean."""
        parts = self.federation.client_validation
        assert parts is not None, "no validation parts: validation=0"
        eval_model = None if self.personal else self.models.eval_model
        if eval_model is not None:
            eval_model.load_state_dict(self.server.global_weights())
        names = [domain or "all" for domain in self.federation.client_domains] or ["all"] * len(parts)
        counts = [self.evaluate_client(k, eval_model, (names[k], part)) for k, part in enumerate(parts)
                  if part[1].numel()]
        return self.protocol.pooled_accuracy(counts, list(dict.fromkeys(names)))

    def evaluate_clients(self) -> tuple[dict[str, float], list[float | None]]:
        """``(accuracy per test set and AVG, accuracy of each client on its own test distribution)``.

        Personal models, or a federation that arrives split (``client_tests``): every client is tested
        (:meth:`evaluate_client`) and the counts pooled per test set. One global model on shared test sets:
        the global model on each test set; a client's accuracy is then its test set's (clients of one domain
        share it; a client whose domain names no test set is scored by the AVG over the test sets). A client of
        a split federation without test data of its own is not tested: None (left out of the fairness
        statistics, never given the pooled accuracy)."""
        federation = self.federation
        eval_model = None if self.personal else self.models.eval_model  # personal models have no global one here
        if eval_model is not None:
            eval_model.load_state_dict(self.server.global_weights())
            if federation.client_tests is None:
                accuracy = evaluate(self.server.inference_model(eval_model), federation.test_sets, amp=self.amp)
                if federation.client_matched_tests is not None:
                    return accuracy, self._matched(eval_model)
                return accuracy, [accuracy.get(federation.client_test_name(k), accuracy["AVG"])
                                  for k in range(federation.num_clients)]
        counts = [self.evaluate_client(k, eval_model) for k in range(federation.num_clients)]
        accuracy = self.protocol.pooled_accuracy(counts, list(federation.test_sets))
        if federation.client_matched_tests is not None:
            return accuracy, self._matched(eval_model)
        return accuracy, [c.accuracy if c.total else None for c in counts]

    def evaluate_unseen(self, last: bool) -> dict[str, dict[str, float]]:
        """The row keys of the unseen clients (``{}`` without any): ``unseen``, the global model on each unseen
        client's test, pooled per test set (their domain, or ``all``) and AVG their unweighted mean; at the
        ``last`` round with fine-tuning on, also ``unseen_finetuned``: each client's copy of the global model
        after :class:`FineTune`'s epochs on its own training data, tested and pooled the same way."""
        unseen = self.federation.unseen
        if unseen is None:
            return {}
        model = self.models.eval_model
        model.load_state_dict(self.server.global_weights())
        order = list(dict.fromkeys(unseen.groups))
        counts = [test_client(self.server, model, group, test, None, amp=self.amp)
                  for group, test in zip(unseen.groups, unseen.tests) if test[1].numel()]
        out = {"unseen": self.protocol.pooled_accuracy(counts, order)}
        if last and self.finetune is not None and self.finetune.epochs > 0:
            settings = dataclasses.replace(self.finetune.train, epochs=self.finetune.epochs)
            tuned_counts = []
            for k, (data, group, test) in enumerate(zip(unseen.clients, unseen.groups, unseen.tests)):
                if not test[1].numel():
                    continue
                tuned = copy.deepcopy(model)
                seed = int(np.random.SeedSequence([self.finetune.seed, FINETUNE_STREAM, k]).generate_state(1)[0])
                train_epochs(tuned, data, settings, torch.Generator().manual_seed(seed))
                tuned_counts.append(test_client(self.server, tuned, group, test, None, amp=self.amp))
            out["unseen_finetuned"] = self.protocol.pooled_accuracy(tuned_counts, order)
        return out

    def _matched(self, eval_model: nn.Module | None) -> list[float | None]:
        """Each client's accuracy on its matched test set (``client_test=matched``), with the model it is
        tested with; None for a client whose set is empty."""
        matched = self.federation.client_matched_tests
        assert matched is not None
        counts = [self.evaluate_client(k, eval_model, (self.federation.client_test_name(k), part))
                  if part[1].numel() else None for k, part in enumerate(matched)]
        return [c.accuracy if c is not None else None for c in counts]
