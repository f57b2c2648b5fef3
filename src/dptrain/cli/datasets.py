"""The image datasets of ``dptrain train``: scikit-learn's digits, or torchvision's read from disk (never downloaded)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .output import CLIError

if TYPE_CHECKING:
    import torch


DATASETS = ("digits", "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn")

# Fixed, published per-channel statistics: normalising with statistics of the private
# training set would be a data-dependent release that no accountant covers.
_NORMALISATION = {
    "digits": ((0.5,), (0.5,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "kmnist": ((0.1918,), (0.3483,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


@dataclass
class ImageData:
    """Images kept in their compact stored form (uint8 for torchvision); scaled per batch on the device."""

    name: str
    train: torch.utils.data.TensorDataset
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    scale: float  # stored value * scale is in [0, 1]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        channels, height, width = self.test_x.shape[1:]  # images [N, C, H, W]
        return channels, height, width

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, -1, 1, 1)
        return (x.float() * self.scale - mean) / std


def load_dataset(name: str, data_dir: str) -> ImageData:
    import torch

    mean, std = _NORMALISATION[name]
    if name == "digits":
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError:
            raise CLIError("--dataset digits needs scikit-learn: pip install 'dptrain[cli]'") from None

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # [1797, 1, 8, 8], 0..16
        labels = torch.tensor(digits.target, dtype=torch.long)
        # A fixed split, independent of --seed, so runs with different seeds share one test set.
        train_idx, test_idx = train_test_split(
            torch.arange(len(labels)).numpy(), test_size=0.2, random_state=0, stratify=digits.target
        )
        train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
        return ImageData(name, torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
                         images[test_idx], labels[test_idx], 10, 1 / 16, mean, std)
    train_x, train_y, num_classes = _read_torchvision(name, data_dir, train=True)
    test_x, test_y, _ = _read_torchvision(name, data_dir, train=False)
    return ImageData(name, torch.utils.data.TensorDataset(train_x, train_y), test_x, test_y, num_classes,
                     1 / 255, mean, std)


def _read_torchvision(name: str, data_dir: str, train: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    import torch

    try:
        import torchvision.datasets as tvd
    except ImportError:
        raise CLIError(f"--dataset {name} needs torchvision: pip install 'dptrain[vision]'") from None
    classes = {"mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST, "kmnist": tvd.KMNIST,
               "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "svhn": tvd.SVHN}
    cls = classes[name]
    root = os.path.expanduser(data_dir)
    try:
        if name == "svhn":
            ds = cls(root, split="train" if train else "test", download=False)
        else:
            ds = cls(root, train=train, download=False)
    except RuntimeError:  # torchvision's "Dataset not found or corrupted"
        raise CLIError(
            f"dataset {name} not found in {root!r} (dptrain never downloads); fetch it once with "
            f"torchvision.datasets.{cls.__name__}({root!r}, download=True) or point --data-dir at it"
        ) from None
    if name == "svhn":
        x, y = torch.as_tensor(ds.data), torch.as_tensor(ds.labels)  # [N, 3, 32, 32]
        num_classes = 10
    elif name in ("cifar10", "cifar100"):
        x, y = torch.as_tensor(ds.data).permute(0, 3, 1, 2).contiguous(), torch.as_tensor(ds.targets)
        num_classes = len(ds.classes)
    else:
        x, y = ds.data.unsqueeze(1), torch.as_tensor(ds.targets)  # [N, 1, 28, 28] uint8
        num_classes = len(ds.classes)
    return x, y.long(), num_classes
