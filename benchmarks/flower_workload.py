"""The Flower side of benchmarks/vs_flower.py: the same workload in Flower's simulation engine
(run by the Flower virtual environment's Python: flwr[simulation] pins its own Ray).

    FLOWER_PYTHON benchmarks/flower_workload.py DATA.npz ROUNDS PER_ROUND

DATA.npz holds fedray's partition (x, y, offsets, x_test, y_test) and the initial weights, so
both frameworks train the same clients from the same model. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from torch import nn


def main() -> None:
    path, rounds, per_round = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = np.load(path)
    x, y, offsets = data["x"], data["y"], data["offsets"]
    x_test, y_test = torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])
    n_clients, hidden, classes = len(offsets) - 1, int(data["hidden"]), int(data["classes"])
    lr, batch = float(data["lr"]), int(data["batch"])
    init = [data[f"w{i}"] for i in range(4)]

    from flwr.client import ClientApp, NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    def model() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(x.shape[1], hidden), nn.ReLU(),
                             nn.Linear(hidden, classes))

    def set_weights(m: nn.Module, ws) -> None:
        with torch.no_grad():
            for p, w in zip(m.parameters(), ws):
                p.copy_(torch.from_numpy(np.asarray(w)))

    class Client(NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid

        def fit(self, parameters, config):
            torch.set_num_threads(1)
            m = model()
            set_weights(m, parameters)
            lo, hi = int(offsets[self.cid]), int(offsets[self.cid + 1])
            xc, yc = torch.from_numpy(x[lo:hi]), torch.from_numpy(y[lo:hi])
            opt = torch.optim.SGD(m.parameters(), lr=lr)
            perm = torch.randperm(hi - lo, generator=torch.Generator().manual_seed(
                int(config.get("round", 0)) * 100_003 + self.cid))
            for i in range(0, hi - lo, batch):  # one local epoch
                idx = perm[i : i + batch]
                opt.zero_grad()
                nn.functional.cross_entropy(m(xc[idx]), yc[idx]).backward()
                opt.step()
            return [p.detach().numpy() for p in m.parameters()], hi - lo, {}

    def client_fn(context):
        return Client(int(context.node_config["partition-id"])).to_client()

    final = {}

    def evaluate(server_round, parameters, config):
        if server_round == rounds:
            m = model()
            set_weights(m, parameters)
            with torch.no_grad():
                acc = float((m(x_test).argmax(1) == y_test).float().mean())
            final["accuracy"] = acc
            return 0.0, {"accuracy": acc}
        return None

    def server_fn(context):
        strategy = FedAvg(fraction_fit=per_round / n_clients, fraction_evaluate=0.0,
                          min_fit_clients=per_round, min_available_clients=n_clients,
                          evaluate_fn=evaluate, initial_parameters=ndarrays_to_parameters(init),
                          on_fit_config_fn=lambda r: {"round": r})
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    t0 = time.perf_counter()
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=n_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"include_dashboard": False}})
    print(json.dumps({"seconds": time.perf_counter() - t0, "accuracy": final.get("accuracy")}))


if __name__ == "__main__":
    main()
