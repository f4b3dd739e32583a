"""The four ImageNet networks of the SPD-KFAC paper (Shi, Zhang, Li, ICDCS 2021) as plain PyTorch modules.

ResNet-50 and ResNet-152 (He et al. 2016, bottleneck "v1.5": the stride sits on the 3x3 convolution),
DenseNet-201 (Huang et al. 2017) and Inception-v4 (Szegedy et al. 2016), with ImageNet shapes. Only
standard layers are used (``nn.Conv2d``, ``nn.Linear``, ``nn.BatchNorm2d``, pooling, ReLU and
concatenation), so K-FAC layer discovery (``nn.Conv2d`` and ``nn.Linear``) sees exactly the
convolutions and the final fully connected layer. Every convolution is bias-free and followed by (or, in
DenseNet, preceded by) a BatchNorm; every classifier has a bias.

The constructors keep PyTorch's default layer initialisation (no second initialisation pass), so they
are quick to build, and they build on the meta device: ``with torch.device("meta"): resnet50()`` gives a
module whose forward on a meta tensor yields all shapes without allocating memory. That is how the
simulator reads layer shapes.

:data:`PAPER_MODELS` maps each name to ``(constructor, input shape CHW, the paper's per-GPU batch size)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import validation as val

__all__ = ["PAPER_MODELS", "densenet201", "inception_v4", "resnet50", "resnet152"]


# ---------------------------------------------------------------------------------------------------
# ResNet
# ---------------------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, v1.5), 1x1 expand by 4; BatchNorm after each conv; the
    shortcut is a 1x1 strided conv + BatchNorm when the shape changes, the identity otherwise."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ImageNet ResNet with bottleneck blocks: 7x7/2 stem conv, 3x3/2 max pool, four stages of widths
    64, 128, 256, 512 (the last three start with stride 2), global average pool, fc to ``num_classes``.
    A 224x224 input gives a 7x7x2048 final feature map."""

    def __init__(self, layers: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        if len(val.check_ints("layers", layers, low=1)) != 4:
            raise ValueError(f"layers must be four block counts >= 1 (one per stage), got {tuple(layers)}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        stages = []
        for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            stage = []
            for b in range(int(blocks)):
                stage.append(Bottleneck(in_channels, width, stride if b == 0 else 1))
                in_channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The final feature map, before pooling (B, 2048, 7, 7 for a 224x224 input)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.features(x)), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 v1.5 (blocks 3, 4, 6, 3): 25,557,032 parameters with 1000 classes; input 3x224x224."""
    return ResNet((3, 4, 6, 3), num_classes)


def resnet152(num_classes: int = 1000) -> nn.Module:
    """ResNet-152 v1.5 (blocks 3, 8, 36, 3): 60,192,808 parameters with 1000 classes; input 3x224x224."""
    return ResNet((3, 8, 36, 3), num_classes)


# ---------------------------------------------------------------------------------------------------
# DenseNet
# ---------------------------------------------------------------------------------------------------
class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1 (to ``bn_size * growth`` channels), BN-ReLU-conv3x3 (to ``growth`` channels).
    Takes the list of all earlier feature maps of the block and returns only its new ``growth`` maps."""

    def __init__(self, in_channels: int, growth: int, bn_size: int):
        super().__init__()
        inner = bn_size * growth
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_channels, inner, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(inner)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(inner, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    """``num_layers`` dense layers; each sees the concatenation of the block input and all earlier
    layers' outputs; the block returns that concatenation including the last layer's output."""

    def __init__(self, num_layers: int, in_channels: int, growth: int, bn_size: int):
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_channels + i * growth, growth, bn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-conv1x1 (compressing the channels) and a 2x2/2 average pool."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            nn.AvgPool2d(2, stride=2),
        )


class DenseNet(nn.Module):
    """ImageNet DenseNet-BC: 7x7/2 conv + BN + ReLU + 3x3/2 max pool, dense blocks separated by
    transitions with compression 0.5, a final BN, ReLU, global average pool and the classifier."""

    def __init__(
        self,
        growth: int = 32,
        blocks: Sequence[int] = (6, 12, 48, 32),
        init_features: int = 64,
        bn_size: int = 4,
        compression: float = 0.5,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        val.check_real("compression", compression, val.Bound(low=0.0, high=1.0, low_open=True))
        mods: OrderedDict[str, nn.Module] = OrderedDict(
            conv0=nn.Conv2d(3, init_features, 7, stride=2, padding=3, bias=False),
            norm0=nn.BatchNorm2d(init_features),
            relu0=nn.ReLU(inplace=True),
            pool0=nn.MaxPool2d(3, stride=2, padding=1),
        )
        channels = init_features
        for i, n in enumerate(blocks):
            mods[f"denseblock{i + 1}"] = DenseBlock(int(n), channels, growth, bn_size)
            channels += int(n) * growth
            if i != len(blocks) - 1:
                out = int(channels * compression)
                mods[f"transition{i + 1}"] = Transition(channels, out)
                channels = out
        mods["norm5"] = nn.BatchNorm2d(channels)
        mods["relu5"] = nn.ReLU(inplace=True)
        self.features = nn.Sequential(mods)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def densenet201(num_classes: int = 1000) -> nn.Module:
    """DenseNet-201 (growth 32, blocks 6, 12, 48, 32, bn_size 4, compression 0.5, 64 initial features):
    20,013,928 parameters with 1000 classes; input 3x224x224, final feature map 7x7x1920."""
    return DenseNet(32, (6, 12, 48, 32), 64, 4, 0.5, num_classes)


# ---------------------------------------------------------------------------------------------------
# Inception-v4
# ---------------------------------------------------------------------------------------------------
class ConvBN(nn.Sequential):
    """Bias-free conv, BatchNorm (eps 1e-3, as in the reference TensorFlow model), ReLU. ``padding``
    is in pixels per side (0 = 'valid'); ``kernel`` may be an int or (kh, kw)."""

    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(cout, eps=1e-3),
            nn.ReLU(inplace=True),
        )


def _seq(*mods: nn.Module) -> nn.Sequential:
    return nn.Sequential(*mods)


class _Branches(nn.Module):
    """Runs each branch on the same input and concatenates the outputs along the channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


class _Split(nn.Module):
    """A trunk followed by two parallel heads (1x3 and 3x1) whose outputs are concatenated."""

    def __init__(self, trunk: nn.Module, head_a: nn.Module, head_b: nn.Module):
        super().__init__()
        self.trunk, self.head_a, self.head_b = trunk, head_a, head_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.trunk(x)
        return torch.cat([self.head_a(t), self.head_b(t)], 1)


def _avgpool_1x1(cin: int, cout: int) -> nn.Sequential:
    """3x3/1 average pool (padding not counted) then a 1x1 ConvBN: the pooling branch of A, B, C."""
    return _seq(nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), ConvBN(cin, cout, 1))


def _stem() -> nn.Sequential:
    """299x299x3 -> 35x35x384 (Fig. 3 of the paper)."""
    return _seq(
        ConvBN(3, 32, 3, stride=2),  # 149
        ConvBN(32, 32, 3),  # 147
        ConvBN(32, 64, 3, padding=1),  # 147
        _Branches(nn.MaxPool2d(3, stride=2), ConvBN(64, 96, 3, stride=2)),  # 73x73x160
        _Branches(
            _seq(ConvBN(160, 64, 1), ConvBN(64, 96, 3)),
            _seq(
                ConvBN(160, 64, 1),
                ConvBN(64, 64, (1, 7), padding=(0, 3)),
                ConvBN(64, 64, (7, 1), padding=(3, 0)),
                ConvBN(64, 96, 3),
            ),
        ),  # 71x71x192
        _Branches(ConvBN(192, 192, 3, stride=2), nn.MaxPool2d(3, stride=2)),  # 35x35x384
    )


def _inception_a() -> _Branches:
    """35x35x384 -> 35x35x384 (Fig. 4)."""
    return _Branches(
        ConvBN(384, 96, 1),
        _seq(ConvBN(384, 64, 1), ConvBN(64, 96, 3, padding=1)),
        _seq(ConvBN(384, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1)),
        _avgpool_1x1(384, 96),
    )


def _reduction_a() -> _Branches:
    """35x35x384 -> 17x17x1024 (Fig. 7 with k, l, m, n = 192, 224, 256, 384)."""
    return _Branches(
        ConvBN(384, 384, 3, stride=2),
        _seq(ConvBN(384, 192, 1), ConvBN(192, 224, 3, padding=1), ConvBN(224, 256, 3, stride=2)),
        nn.MaxPool2d(3, stride=2),
    )


def _inception_b() -> _Branches:
    """17x17x1024 -> 17x17x1024 (Fig. 5)."""
    return _Branches(
        ConvBN(1024, 384, 1),
        _seq(
            ConvBN(1024, 192, 1),
            ConvBN(192, 224, (1, 7), padding=(0, 3)),
            ConvBN(224, 256, (7, 1), padding=(3, 0)),
        ),
        _seq(
            ConvBN(1024, 192, 1),
            ConvBN(192, 192, (7, 1), padding=(3, 0)),
            ConvBN(192, 224, (1, 7), padding=(0, 3)),
            ConvBN(224, 224, (7, 1), padding=(3, 0)),
            ConvBN(224, 256, (1, 7), padding=(0, 3)),
        ),
        _avgpool_1x1(1024, 128),
    )


def _reduction_b() -> _Branches:
    """17x17x1024 -> 8x8x1536 (Fig. 8)."""
    return _Branches(
        _seq(ConvBN(1024, 192, 1), ConvBN(192, 192, 3, stride=2)),
        _seq(
            ConvBN(1024, 256, 1),
            ConvBN(256, 256, (1, 7), padding=(0, 3)),
            ConvBN(256, 320, (7, 1), padding=(3, 0)),
            ConvBN(320, 320, 3, stride=2),
        ),
        nn.MaxPool2d(3, stride=2),
    )


def _inception_c() -> _Branches:
    """8x8x1536 -> 8x8x1536 (Fig. 6)."""
    return _Branches(
        ConvBN(1536, 256, 1),
        _Split(ConvBN(1536, 384, 1), ConvBN(384, 256, (1, 3), padding=(0, 1)), ConvBN(384, 256, (3, 1), padding=(1, 0))),
        _Split(
            _seq(
                ConvBN(1536, 384, 1),
                ConvBN(384, 448, (1, 3), padding=(0, 1)),
                ConvBN(448, 512, (3, 1), padding=(1, 0)),
            ),
            ConvBN(512, 256, (1, 3), padding=(0, 1)),
            ConvBN(512, 256, (3, 1), padding=(1, 0)),
        ),
        _avgpool_1x1(1536, 256),
    )


class InceptionV4(nn.Module):
    """Inception-v4 (Fig. 9): stem, 4x Inception-A, Reduction-A, 7x Inception-B, Reduction-B,
    3x Inception-C, global average pool (over 8x8x1536 for a 299x299 input), fc to ``num_classes``.
    (The reference TensorFlow model also has dropout before the fc; it holds no parameters and is
    left out.)"""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.features = _seq(
            _stem(),
            *[_inception_a() for _ in range(4)],
            _reduction_a(),
            *[_inception_b() for _ in range(7)],
            _reduction_b(),
            *[_inception_c() for _ in range(3)],
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(1536, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.features(x)), 1))


def inception_v4(num_classes: int = 1000) -> nn.Module:
    """Inception-v4 with ImageNet shapes; input 3x299x299, final feature map 8x8x1536."""
    return InceptionV4(num_classes)


# name -> (constructor, input shape CHW, per-GPU batch size used in the paper's experiments)
PAPER_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, int, int], int]] = {
    "resnet50": (resnet50, (3, 224, 224), 32),
    "resnet152": (resnet152, (3, 224, 224), 8),
    "densenet201": (densenet201, (3, 224, 224), 16),
    "inception_v4": (inception_v4, (3, 299, 299), 16),
}
