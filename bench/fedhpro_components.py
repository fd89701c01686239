"""Where FedHPro's extra client cost goes: one client's round, FedHPro against FedAvg, by component.

On one client of the default federation (digits-offline, ``--client``, the
default ``cnn``, E = ``--epochs``, batch 64), the package's own code paths,
interleaved (see ``harness.py``):

* ``fit, fedavg`` / ``fit, fedhpro``: a whole client round (``Client.fit``:
  load the weights, prepare, E epochs, upload) of each method, on the same
  received weights and batch order;
* ``margin``: FedHPro's ``prepare`` (Eq. 10: one eval-mode pass of the
  received model over the local data, the class prototypes, d_k);
* ``class gradients``: the upload's statistics (Eq. 5 and Eq. 2: one
  eval-mode pass of the trained model, g_k^c in one backward through the
  head, p_k^c);
* ``epochs, CE`` / ``epochs, CE + HPCL + HPAL``: FedHPro's ``prepare`` then
  the E epochs, without and with its loss terms (Eq. 11-13, as the client
  builds them): their difference is the loss terms' cost (a few percent of
  an epoch, so it needs quiet repeats to resolve);
* ``HPCL + HPAL alone``: the same loss terms by themselves, forward and
  backward to the features, on each batch of a round (E epochs of batches of
  the received model's features, made leaves that require grad): the loss
  terms' cost without the noise of the epochs around them (one backward
  call per batch, which the training loop shares with CE: an upper bound);
* ``server step``: FedHPro's aggregation of ``--clients-on-server`` replies
  (FedAvg on the weights, Eq. 6, 30 gradient-matching steps, Eq. 7-9), per
  client.

It prints each median in ms per client round and as a share of the FedAvg
round, and FedHPro's extra cost split into the margin pass, the
class-gradient pass, the loss terms and the server step.

    python bench/fedhpro_components.py --threads 1
    python bench/fedhpro_components.py --client 3 --epochs 10 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness
import torch

from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.methods.base import load_weights
from fedhpro.methods.fedhpro.hyper import class_statistics
from fedhpro.methods.parts import features_of
from fedhpro.methods.training import Batch, LocalRound, train_epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", type=int, default=0, help="which client of digits-offline")
    parser.add_argument("--epochs", type=int, default=5, help="E (the package default: 5)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clients-on-server", type=int, default=20, help="replies the server step aggregates")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall seconds, or this thread's CPU seconds (steadier on a machine others load)")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    harness.prepare_torch(args.threads)

    federation, config = harness.digits_federation(None, args.data_dir)
    data = federation.clients[args.client]
    train = TrainSettings(epochs=args.epochs)
    factory = harness.cnn_factory(federation)
    simulators = {name: Simulator(METHODS[name], config.methods[name], federation, factory, train,
                                  rounds=10 ** 9, eval_every=10 ** 9) for name in ("fedavg", "fedhpro")}
    payloads = {name: simulator.server.broadcast(0) for name, simulator in simulators.items()}
    client = simulators["fedhpro"].client
    server = simulators["fedhpro"].server
    model = factory()

    def fit(name: str):
        return simulators[name].client.fit(model, payloads[name], data, {}, torch.Generator().manual_seed(0))

    def local_round() -> LocalRound:
        load_weights(model, payloads["fedhpro"]["weights"])
        return LocalRound(model, payloads["fedhpro"], data, {}, torch.Generator().manual_seed(0))

    def epochs(with_terms: bool) -> None:
        round = local_round()
        client.prepare(round)
        train_epochs(model, data, train, round.generator, loss_terms=client.loss_terms(round) if with_terms else None)

    def round_batches() -> list[Batch]:
        # the batches of a round as the training loop cuts them (E epochs, a permutation each), with the received
        # model's features (eval mode, no grad) in place of the training forward's
        round = local_round()
        with torch.no_grad():
            model.eval()
            z = features_of(model)(data.x)
            model.train()
        batches = []
        for _ in range(train.epochs):
            order = torch.randperm(len(data), generator=round.generator)
            for start in range(0, len(data), train.batch_size):
                index = order[start:start + train.batch_size]
                if index.numel() >= 2 or len(data) <= 1:
                    batches.append(Batch(data.x[index], data.y[index], z[index], None))  # type: ignore[arg-type]
        return batches

    terms_round = local_round()
    client.prepare(terms_round)
    terms_of = client.loss_terms(terms_round)
    batches = round_batches()

    def terms_alone() -> None:
        for batch in batches:
            z = batch.z.detach().requires_grad_(True)
            terms = terms_of(Batch(batch.x, batch.y, z, batch.logits))
            first, *rest = terms.values()
            sum(rest, first).backward()

    reply, _ = fit("fedhpro")
    replies = [reply] * args.clients_on_server
    server_state = server.state_dict()

    def server_step() -> None:
        server.aggregate(0, replies)
        server.load_state_dict(server_state)

    variants = {
        "fit, fedavg": lambda: fit("fedavg"),
        "fit, fedhpro": lambda: fit("fedhpro"),
        "margin (prepare)": lambda: client.prepare(local_round()),
        "class gradients (upload)": lambda: class_statistics(model, data, federation.num_classes),
        "epochs, CE": lambda: epochs(False),
        "epochs, CE + HPCL + HPAL": lambda: epochs(True),
        "HPCL + HPAL alone": terms_alone,
        "server step": server_step,
    }
    harness.print_header(f"FedHPro's client cost by component: client {args.client} of digits-offline "
                         f"({len(data)} samples), cnn, E = {args.epochs}, batch {train.batch_size}")
    if args.clock == "cpu":  # the thread's CPU seconds of each call, in the same interleaved order
        cpu: dict[str, list[float]] = {name: [] for name in variants}

        def cpu_timed(name: str, run):
            def call() -> None:
                start = time.thread_time()
                run()
                cpu[name].append(time.thread_time() - start)
            return call

        harness.interleaved({name: cpu_timed(name, run) for name, run in variants.items()}, args.repeats)
        times = {name: values[1:] for name, values in cpu.items()}  # the first was the warm-up
    else:
        times = harness.interleaved(variants, args.repeats)
    median = {name: statistics.median(values) for name, values in times.items()}
    median["server step"] /= args.clients_on_server
    fedavg = median["fit, fedavg"]
    print(f"{args.clock} ms per client round, median [min - max]; share of the FedAvg round:")
    for name, values in times.items():
        scale = 1e3 / (args.clients_on_server if name == "server step" else 1)
        print(f"  {name:30s} {median[name] * 1e3:8.1f} [{min(values) * scale:.1f} - {max(values) * scale:.1f}]"
              f"  {100 * median[name] / fedavg:6.1f} %")
    extra = {
        "margin pass + Eq. 10": median["margin (prepare)"],
        "class-gradient pass + Eq. 5": median["class gradients (upload)"],
        "HPCL + HPAL (forward + backward)": median["epochs, CE + HPCL + HPAL"] - median["epochs, CE"],
        "server step (per client)": median["server step"],
    }
    measured = median["fit, fedhpro"] - fedavg
    print(f"FedHPro's extra: {measured * 1e3:.1f} ms = {100 * measured / fedavg:.1f} % of the FedAvg round "
          f"(ratio {median['fit, fedhpro'] / fedavg:.3f}); by component:")
    for name, seconds in extra.items():
        print(f"  {name:34s} {seconds * 1e3:7.1f} ms  {100 * seconds / fedavg:5.1f} %")
    print(f"  sum of the components              {sum(extra.values()) * 1e3:7.1f} ms  "
          f"{100 * sum(extra.values()) / fedavg:5.1f} %")
    alone = median["HPCL + HPAL alone"]
    print(f"  HPCL + HPAL alone: {alone * 1e3:.1f} ms = {1e6 * alone / len(batches):.0f} us a batch over "
          f"{len(batches)} batches, {100 * alone / fedavg:.1f} % of the FedAvg round")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
