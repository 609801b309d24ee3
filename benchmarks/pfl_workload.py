"""The pfl-research side of benchmarks/vs_pfl.py: pfl 0.6's simulation (its ``SimulatedBackend``
and ``FederatedAveraging``, as its benchmarks/image_classification/pytorch/train.py builds them)
on the partition and initial weights fedray exported (run by the pfl virtual environment's
Python: ``make pfl-venv``).

    PFL_PYTHON benchmarks/pfl_workload.py DATA.npz ROUNDS COHORT

Prints one JSON line: seconds for the whole run, the steady-state seconds per round (median
gap between central iterations after the first 3, the last one left out: it evaluates), the
final accuracy on the test set.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

T0 = time.perf_counter()

import numpy as np
import torch
from torch import nn


def main() -> None:
    path, rounds, cohort = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = np.load(path)
    def pixels(a: np.ndarray) -> np.ndarray:  # uint8 images to [0, 1], as fedray's workers
        return a.astype(np.float32) / 255.0 if a.dtype == np.uint8 else a.astype(np.float32)

    x = pixels(data["x"])
    y, offsets = data["y"].astype(np.int64), data["offsets"]
    x_test = torch.from_numpy(pixels(data["x_test"]))
    y_test = torch.from_numpy(data["y_test"].astype(np.int64))
    lr, server_lr, batch = float(data["lr"]), float(data["server_lr"]), int(data["batch"])

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(int(data["threads"]))
    c, h, w = x.shape[1:]
    net = nn.Sequential(  # pfl's simple_cnn on NCHW input, without its dropout (as fedray's)
        nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128), nn.ReLU(),
        nn.Linear(128, int(data["classes"])))
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(torch.from_numpy(data[f"w{i}"]))

    def loss(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(inputs), targets.long())

    @torch.no_grad()
    def metrics(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                eval: bool = True) -> dict:
        self.eval() if eval else self.train()
        logits = self(inputs)
        n, targets = len(inputs), targets.long()
        return {"loss": Weighted(nn.functional.cross_entropy(logits, targets, reduction="sum")
                                 .item(), n),
                "accuracy": Weighted((logits.argmax(1) == targets).sum().item(), n)}

    import types

    net.loss = types.MethodType(loss, net)
    net.metrics = types.MethodType(metrics, net)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)  # as pfl's benchmark: tensors per user
    users = {u: [xt[offsets[u]:offsets[u + 1]], yt[offsets[u]:offsets[u + 1]]]
             for u in range(len(offsets) - 1)}
    train = FederatedDataset.from_slices(users, get_user_sampler("random", list(users)))
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), server_lr))
    backend = SimulatedBackend(training_data=train, val_data=None,
                               postprocessors=[WeightByUser()])
    ends: list[float] = []

    class Clock(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            ends.append(time.perf_counter())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=rounds,
                                           train_cohort_size=cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=lr, local_num_epochs=1,
                                              local_batch_size=batch),
        model_eval_params=NNEvalHyperParams(local_batch_size=10_000), callbacks=[Clock()])
    net.eval()
    with torch.no_grad():
        acc = float((net(x_test).argmax(1) == y_test).float().mean())
    gaps = [b - a for a, b in itertools.pairwise(ends[3:-1])]
    print(json.dumps({"seconds": time.perf_counter() - T0, "round": statistics.median(gaps),
                      "accuracy": acc}))


if __name__ == "__main__":
    main()
