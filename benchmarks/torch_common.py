"""PyTorch pieces shared by the hand-written loop (bench_torch.py) and the Flower clients
(bench_flower.py): the paper's models, a client's local training, n_k-weighted averaging.

Same models as fedax (``fedax.models.mnist``): 2NN 784-200-200-10 (199,210 params) and CNN
conv5x5x32 'same' -> maxpool 2 -> conv5x5x64 'same' -> maxpool 2 -> fc 512 -> fc 10
(1,663,370 params), ReLU, Glorot-uniform kernels and zero biases; plain SGD, mean
cross-entropy over each batch of B = 10.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PARAM_COUNTS = {"2nn": 199_210, "cnn": 1_663_370}


def build_model(model: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if model == "2nn":
        net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 200), nn.ReLU(),
            nn.Linear(200, 200), nn.ReLU(),
            nn.Linear(200, 10),
        )
    elif model == "cnn":
        net = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(7 * 7 * 64, 512), nn.ReLU(),
            nn.Linear(512, 10),
        )
    else:
        raise ValueError(model)
    for m in net.modules():
        if isinstance(m, nn.Linear | nn.Conv2d):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    count = sum(p.numel() for p in net.parameters())
    assert count == PARAM_COUNTS[model], (model, count)
    return net


def to_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """fedax's MNIST arrays (``[N, 28, 28, 1]`` float32, int32) as NCHW / int64 tensors."""
    return torch.from_numpy(x.reshape(-1, 1, 28, 28)), torch.from_numpy(y.astype(np.int64))


def train_client(
    net: nn.Module,
    global_state: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    batches: list[np.ndarray],
    lr: float,
) -> tuple[dict[str, torch.Tensor], float]:
    """ClientUpdate: start from ``global_state``, one SGD step per batch of example
    indices, in order. Returns (the client's new state, mean training loss). On a GPU,
    ``net``, ``global_state``, ``x`` and ``y`` live on it and each batch's indices are copied
    there; the loss read at the end waits for the client's steps."""
    net.load_state_dict(global_state)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    total = torch.zeros((), device=x.device)
    for b in batches:
        index = torch.from_numpy(b).to(x.device)
        xb, yb = x.index_select(0, index), y.index_select(0, index)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        total += loss.detach()
    state = OrderedDict((k, v.detach().clone()) for k, v in net.state_dict().items())
    return state, float(total) / max(len(batches), 1)


def weighted_sum(
    acc: dict[str, torch.Tensor] | None, state: dict[str, torch.Tensor], weight: float
) -> dict[str, torch.Tensor]:
    """``acc + weight * state`` (``acc`` None: a fresh sum)."""
    if acc is None:
        return OrderedDict((k, v * weight) for k, v in state.items())
    for k, v in state.items():
        acc[k].add_(v, alpha=weight)
    return acc


def scale(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return OrderedDict((k, v * factor) for k, v in state.items())
